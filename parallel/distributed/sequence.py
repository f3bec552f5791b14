"""Ulysses sequence parallelism: tokens split over the sp ranks outside attention, heads inside it.

With `parallel.sp_size = s`, every sp rank holds S/s consecutive tokens of the sequence (CogVideoX: text
tokens first, then video tokens; STDiT: video tokens in (t, h, w) order) through the norms, projections
and FFNs. Self-attention needs every token: DeepSpeed's `DistributedAttention` turns q, k, v from
[B, S/s, n, d] into [B, S, n/s, d] with one all-to-all each, the model's own attention runs on the
full sequence for its n/s heads, and a fourth all-to-all brings the output back to [B, S/s, n, d].
Backward mirrors it: four all-to-alls per attention per micro-batch in each direction.

Gradients. To DeepSpeed the sp ranks are data-parallel ranks (they hold the same parameters, and the
gradient average runs over dp x sp), so each sp rank's loss is `s x` its share of the global mean
(`local_share`): the average over the s ranks is the serial loss and the averaged gradient is the
serial gradient. The split of a replicated tensor is therefore a plain slice whose backward pads
with zeros (`split_sequence`): each rank's parameters see only their own tokens' gradient, and the
average over dp x sp adds them up.

Padding. When s does not divide the token count S, `split_sequence` pads the sequence at its end (after
the last video token) with zero rows to S_pad = ceil(S / s) x s, so every rank holds S_pad / s tokens
and the all-to-alls stay even. `SequenceAttention` slices the gathered q, k, v back to the S real tokens
before the model's attention and pads its output with zeros again: no real token attends to a padded
key, so no mask is needed and the fused attention kernels stay in use. Everything else is per token, so
the padded rows never touch the real ones; they are left out of the loss (parallel/build.py) and of
the assembled prediction (`gather_sequence(..., total=S)`), so they get a zero gradient and give none.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn


def sp_size_of(ctx) -> int:
    return getattr(ctx, "sp_size", 1) if ctx is not None else 1


def padded_length(total: int, sp: int) -> int:
    """`total` rounded up to a multiple of sp: the length the sp ranks split (53,266 -> 53,268 at sp 4)."""
    return -(-total // sp) * sp


def local_range(total: int, ctx) -> tuple[int, int]:
    """[start, stop) of this sp rank's tokens among `total` padded to a multiple of sp (stop may exceed
    `total`: the rows from `total` on are padding)."""
    sp = sp_size_of(ctx)
    if sp == 1:
        return 0, total
    chunk = padded_length(total, sp) // sp
    return ctx.sp_rank * chunk, (ctx.sp_rank + 1) * chunk


def split_sequence(x: torch.Tensor, ctx, dim: int = 1) -> torch.Tensor:
    """This rank's chunk of a tensor replicated over the sp ranks, zero-padded at the end to a multiple of
    sp first (backward: zeros outside the chunk)."""
    sp = sp_size_of(ctx)
    if sp == 1:
        return x
    total = x.shape[dim]
    pad = padded_length(total, sp) - total
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)                   # (B, S_pad, H)
    start, stop = local_range(total, ctx)
    return x.narrow(dim, start, stop - start)


@torch.no_grad()
def gather_sequence(x: torch.Tensor, ctx, dim: int = 1, total: Optional[int] = None) -> torch.Tensor:
    """The full sequence from every sp rank's chunk, without the padding when `total` (the real token
    count) is given (no gradient: validation and sampling)."""
    if sp_size_of(ctx) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(ctx.sp_size)]
    dist.all_gather(parts, x.contiguous(), group=ctx.sp_group)
    full = torch.cat(parts, dim=dim)
    return full if total is None else full.narrow(dim, 0, total)


class SequenceAttention(nn.Module):
    """`attend(q, k, v)` on [B, S, n, d] (batch first, sequence, heads): over the full sequence.

    `attend` receives the full sequence of `tokens` real tokens (the padding sliced off) and this rank's
    heads, and returns [B, S, n_local, d]. Further positional arguments (`extra`: a key mask [B, L] of
    the leading text rows, the same on every sp rank) reach `attend` as they are. With sp_size = 1 it is called directly; otherwise through
    DeepSpeed's DistributedAttention (Ulysses), on the padded sequence [B, S_pad, n/sp, d] that
    `_unpadded` trims for it and pads again. `tokens` is an int, or a function giving the current step's
    count when the token grid changes from step to step (buckets: parallel/train/buckets.py).
    """

    def __init__(self, attend: Callable, ctx, tokens: "int | Callable[[], int]"):
        super().__init__()
        self.attend, self.sp, self.tokens = attend, sp_size_of(ctx), tokens
        self.ulysses = None
        if self.sp > 1 and ctx.sp_group is not None:
            from deepspeed.sequence.layer import DistributedAttention
            self.ulysses = DistributedAttention(self._unpadded, ctx.sp_group, scatter_idx=2, gather_idx=1)

    def _unpadded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *extra) -> torch.Tensor:
        """attend on the real tokens of [B, S_pad, n, d]; the padded rows' output is zero."""
        s, real = q.shape[1], self.tokens() if callable(self.tokens) else self.tokens
        if s == real:
            return self.attend(q, k, v, *extra)
        o = self.attend(q[:, :real], k[:, :real], v[:, :real], *extra)   # (B, S, n, d)
        return torch.cat([o, o.new_zeros(o.shape[0], s - real, *o.shape[2:])], dim=1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *extra) -> torch.Tensor:
        if self.ulysses is not None:
            return self.ulysses(q, k, v, 0, None, *extra)               # DeepSpeed passes *extra to _unpadded
        if self.sp == 1:
            return self.attend(q, k, v, *extra)
        # A planning context (no process group): one sp rank's shapes, [B, S_pad/sp, n, d] <-> [B, S_pad, n/sp, d].
        # The all-to-all keeps nothing for backward, and neither does a reshape.
        b, s, n, d = q.shape
        full = [t.reshape(b, s * self.sp, n // self.sp, d) for t in (q, k, v)]
        return self._unpadded(*full, *extra).reshape(b, s, n, d)
