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
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn


def sp_size_of(ctx) -> int:
    return getattr(ctx, "sp_size", 1) if ctx is not None else 1


def local_range(total: int, ctx) -> tuple[int, int]:
    """[start, stop) of this sp rank's tokens among `total` (the checker makes total divisible)."""
    sp = sp_size_of(ctx)
    if sp == 1:
        return 0, total
    if total % sp:
        raise ValueError(f"{total} tokens cannot be split evenly over parallel.sp_size={sp}")
    chunk = total // sp
    return ctx.sp_rank * chunk, (ctx.sp_rank + 1) * chunk


def split_sequence(x: torch.Tensor, ctx, dim: int = 1) -> torch.Tensor:
    """This rank's chunk of a tensor replicated over the sp ranks (backward: zeros outside the chunk)."""
    if sp_size_of(ctx) == 1:
        return x
    start, stop = local_range(x.shape[dim], ctx)
    return x.narrow(dim, start, stop - start)


@torch.no_grad()
def gather_sequence(x: torch.Tensor, ctx, dim: int = 1) -> torch.Tensor:
    """The full sequence from every sp rank's chunk (no gradient: validation and sampling)."""
    if sp_size_of(ctx) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(ctx.sp_size)]
    dist.all_gather(parts, x.contiguous(), group=ctx.sp_group)
    return torch.cat(parts, dim=dim)


class SequenceAttention(nn.Module):
    """`attend(q, k, v)` on [B, S, n, d] (batch first, sequence, heads): over the full sequence.

    `attend` receives the full sequence and this rank's heads, and returns [B, S, n_local, d]. With
    sp_size = 1 it is called directly; otherwise through DeepSpeed's DistributedAttention (Ulysses).
    """

    def __init__(self, attend: Callable, ctx):
        super().__init__()
        self.attend, self.sp = attend, sp_size_of(ctx)
        self.ulysses = None
        if self.sp > 1 and ctx.sp_group is not None:
            from deepspeed.sequence.layer import DistributedAttention
            self.ulysses = DistributedAttention(attend, ctx.sp_group, scatter_idx=2, gather_idx=1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.ulysses is not None:
            return self.ulysses(q, k, v, 0)
        if self.sp == 1:
            return self.attend(q, k, v)
        # A planning context (no process group): one sp rank's shapes, [B, S/sp, n, d] <-> [B, S, n/sp, d].
        # The all-to-all keeps nothing for backward, and neither does a reshape.
        b, s, n, d = q.shape
        full = [t.reshape(b, s * self.sp, n // self.sp, d) for t in (q, k, v)]
        return self.attend(*full).reshape(b, s, n, d)
