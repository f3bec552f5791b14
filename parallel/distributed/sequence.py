"""Sequence parallelism: tokens split over the sp ranks outside attention; inside it Ulysses (heads split
by all-to-alls), ring attention (key/value chunks passed around, parallel/distributed/ring.py) or both
(sp = ulysses x ring: Ulysses inside a ring chunk, `SequenceAttention`).

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
the padded rows never touch the real ones; they are left out of the loss (parallel/model/build.py) and of
the assembled prediction (`gather_sequence(..., total=S)`), so they get a zero gradient and give none.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def sp_size_of(ctx) -> int:
    return getattr(ctx, "sp_size", 1) if ctx is not None else 1


def padded_length(total: int, sp: int) -> int:
    """`total` rounded up to a multiple of sp: the length the sp ranks split (53,266 -> 53,268 at sp 4)."""
    return -(-total // sp) * sp


def sp_pairs(heads: int, sp: int, ring: bool = True) -> list[tuple[int, int]]:
    """Every (ulysses, ring) with ulysses x ring = sp that `heads` heads per tp rank take: Ulysses must divide
    them, ring takes any count (`ring` False: an attention that cannot run under ring, Ulysses only)."""
    return [(u, sp // u) for u in range(1, sp + 1) if sp % u == 0 and heads % u == 0 and (u == sp or ring)]


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


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Full attention, batch first: [B, S, n, d] -> [B, S, n, d]; `keep` [B, m] bool: which of the first m keys
    take part (the rest all do; queries are not masked). The planner's meta trace leaves the mask out: on a
    device the mask-taking fused kernel saves what the unmasked one does (meta would fall back to the S x S
    math kernel)."""
    mask = None
    if keep is not None and q.device.type != "meta":
        s = k.shape[1]
        mask = F.pad(keep[:, :s], (0, s - min(keep.shape[1], s)), value=True)[:, None, None]    # (B, 1, 1, S)
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask).transpose(1, 2)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """[B, s, ...] -> [B, rows, ...] with zero rows after the s given."""
    if x.shape[1] == rows:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], rows - x.shape[1], *x.shape[2:])], dim=1)


class SequenceAttention(nn.Module):
    """Attention over the full sequence for q, k, v given as this sp rank's tokens, [B, S_pad/sp, n, d].

    The model gives either `attend(q, k, v)`, its whole attention on the full sequence of `tokens` real
    tokens (the padding sliced off) -> [B, S, n_local, d] (Ulysses only), or `prepare(q, k, v, start)`, its
    per-token transforms (q/k norms, rotary positions) for tokens start.. of the sequence, after which this
    module attends (`F.scaled_dot_product_attention`, or ring attention across the ring group). `tokens` is an
    int, or a function giving the current step's count when the token grid changes from step to step
    (buckets: parallel/train/buckets.py). Further positional arguments of forward (`extra`) reach `attend` as
    they are; with `prepare` there is at most one, `keep` [B, m] bool, the same on every sp rank: which of the
    sequence's first m keys take part (HunyuanVideo's text padding rows do not), honoured by the full
    attention and by the ring (parallel/distributed/ring.py: masked keys left out of their chunk's block).

    A model whose attention regroups the sequence (STDiT: per frame, per position) gives `chunk(q, k, v, start,
    ring)` for ring attention instead of `prepare`: its attention of this ring rank's chunk, tokens start.. of the
    sequence (no padding: every ring rank holds the same number of real tokens), where `ring(q, k, v)` is ring
    attention of batch-first [B', c', n, d] over every ring rank's same-shaped tensors.

    Ulysses x ring (sp = u x r): DeepSpeed's DistributedAttention all-to-alls over the Ulysses group turn
    [B, S_pad/sp, n, d] into this ring rank's chunk [B, S_pad/r, n/u, d]; ring attention
    (parallel/distributed/ring.py) runs it against the other ring ranks' chunks; the all-to-all brings the
    output back. With u = 1 there is no all-to-all, with r = 1 no ring (Ulysses as before).
    """

    def __init__(self, attend: Optional[Callable] = None, ctx=None, tokens: "int | Callable[[], int]" = 0, *,
                 prepare: Optional[Callable] = None, chunk: Optional[Callable] = None):
        super().__init__()
        if (attend is None) == (prepare is None):
            raise ValueError("SequenceAttention takes one of attend (the whole attention) or prepare (its per-token "
                             "transforms)")
        self.attend, self.prepare, self.chunk, self.sp, self.tokens = attend, prepare, chunk, sp_size_of(ctx), tokens
        self.ring_size = getattr(ctx, "ring_size", 1) if ctx is not None else 1
        self.ulysses_size = self.sp // self.ring_size
        if self.ring_size > 1 and prepare is None and chunk is None:
            raise ValueError(f"ring attention (ring_size={self.ring_size}) needs the model's per-token transforms "
                             f"(prepare=...) or its attention of a ring chunk (chunk=...): this attention gives only "
                             f"attend")
        self.ctx, self.ulysses, self.ring = ctx, None, None
        if self.sp > 1 and ctx.sp_group is not None:
            inner = self._unpadded
            if self.ring_size > 1:
                from parallel.distributed.ring import Ring
                self.ring, inner = Ring(ctx.ring_group), self._ring_chunk
            if self.ulysses_size > 1:
                from deepspeed.sequence.layer import DistributedAttention

                from parallel.distributed.deepspeed.ulysses import traceable_ulysses
                traceable_ulysses()                  # a compiled block's Ulysses output keeps its gradient
                self.ulysses = DistributedAttention(inner, ctx.ulysses_group, scatter_idx=2, gather_idx=1)

    def _real(self) -> int:
        return self.tokens() if callable(self.tokens) else self.tokens

    def _full(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *extra) -> torch.Tensor:
        """The whole sequence's real tokens [B, S, n, d] -> [B, S, n, d]."""
        if self.attend is not None:
            return self.attend(q, k, v, *extra)
        return _sdpa(*self.prepare(q, k, v, 0), *extra)

    def _unpadded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *extra) -> torch.Tensor:
        """attend on the real tokens of [B, S_pad, n, d]; the padded rows' output is zero."""
        s, real = q.shape[1], self._real()
        if s == real:
            return self._full(q, k, v, *extra)
        return _pad_rows(self._full(q[:, :real], k[:, :real], v[:, :real], *extra), s)      # (B, S_pad, n, d)

    def _ring_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This ring rank's chunk [B, c, n, d] of the padded sequence (c = S_pad / r) against every ring rank's."""
        from parallel.distributed.ring import ring_attention
        c, total, me = q.shape[1], self._real(), self.ring.index
        if self.chunk is not None:
            if c * self.ring.size != total:
                raise ValueError(f"{total} tokens padded to {c * self.ring.size} for ring {self.ring.size}: this "
                                 f"attention takes ring chunks of real tokens only; choose parallel.sp_size dividing "
                                 f"the tokens")
            return self.chunk(q, k, v, me * c,
                              lambda *qkv: ring_attention(*qkv, self.ring, [qkv[0].shape[1]] * self.ring.size))
        lengths = [min(max(total - j * c, 0), c) for j in range(self.ring.size)]     # real tokens per chunk
        real = lengths[me]
        q, k, v = (_pad_rows(t, c) for t in self.prepare(q[:, :real], k[:, :real], v[:, :real], me * c))
        return ring_attention(q, k, v, self.ring, lengths, keep=keep)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *extra) -> torch.Tensor:
        if self.ulysses is not None:
            return self.ulysses(q, k, v, 0, None, *extra)               # DeepSpeed passes *extra to the inner
        if self.ring is not None:
            return self._ring_chunk(q, k, v, *extra)
        if self.sp == 1:
            return self._full(q, k, v, *extra)
        # A planning context (no process group): one sp rank's shapes, [B, S_pad/sp, n, d] <-> [B, S_pad/r, n/u, d]
        # for Ulysses (the all-to-all keeps nothing for backward, and neither does a reshape). Under ring the
        # chunk attends to itself: ring attention saves what that saves (its q, k, v chunk, output and
        # log-sum-exp); its transient buffers are the planner's (parallel/plan/memory.py `ring_buffers`).
        b, s, n, d = q.shape
        u = self.ulysses_size
        q, k, v = (t.reshape(b, s * u, n // u, d) for t in (q, k, v))
        if self.ring_size == 1:
            return self._unpadded(q, k, v, *extra).reshape(b, s, n, d)
        if self.prepare is None:
            return self.chunk(q, k, v, 0, _sdpa).reshape(b, s, n, d)
        return _sdpa(*self.prepare(q, k, v, 0), *extra).reshape(b, s, n, d)
