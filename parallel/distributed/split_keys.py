"""Attention of queries that every sp rank holds whole over keys split across the sp ranks.

LTX-2's video-to-audio cross-attention under sequence parallelism (models/ltx2/model.py): the audio stream
(A tokens) is whole on every sp rank, the video stream (the keys and values) is split into S_pad / sp chunks.
Each rank attends its queries to its own chunk's real keys, a partial output O_r with its log-sum-exp L_r (ring
attention's blocks: parallel/distributed/ring.py `block_kernels`), and the partials of every sp rank, gathered,
merge exactly (per query row):

    L = log sum_r exp(L_r),    O = sum_r exp(L_r - L) O_r

One all-gather of B x n x A x (d + 1) fp32 numbers a rank, where gathering the keys and values instead would
move, and keep for backward, 2 x B x S x n x d on every rank.

Backward. Each rank's queries are its own copy, and its merged output feeds its own copy of the rest of the
network, so the gradient reaching O_r is the sum over the sp ranks of their outputs' gradients (one all-reduce
of B x A x n x d); with it each rank takes its keys' share of the softmax gradient with the merged O and L, as
ring attention's backward does: dK, dV of its own keys, and the part of dQ that flows through them (the other
ranks' parts reach their own copies of the queries). Summed over the sp ranks, which DeepSpeed's data axis
averages, these are the gradients of the sum of every rank's loss: the serial gradient when each rank's loss
counts the whole queries' stream once and its share of the split stream sp times (docs/models.md#ltx-2).

A planning context (sp > 1 without an sp group: parallel/plan/trace.py) attends to its own keys alone, which
saves what a rank saves (q, its keys and values, the merged output and log-sum-exp).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from parallel.distributed.ring import block_kernels
from parallel.distributed.sequence import sp_size_of


def _merge(o: torch.Tensor, lse: torch.Tensor, group, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sp rank's partial (o [B, n, A, d] fp32, lse [B, n, A]) merged: (O, L)."""
    mine = torch.cat([o, lse.unsqueeze(-1)], dim=-1).contiguous()                 # (B, n, A, d + 1) fp32
    parts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine, group=group)
    stacked = torch.stack(parts)                                                   # (sp, B, n, A, d + 1)
    lses = stacked[..., -1]
    total = torch.logsumexp(lses, dim=0)                                           # (B, n, A)
    weights = torch.exp(lses - total)                            # a rank without keys: exp(-inf - L) = 0
    return (weights.unsqueeze(-1) * stacked[..., :-1]).sum(0), total


class _SplitKeysAttention(torch.autograd.Function):
    """[B, n, A, d] queries, [B, n, c, d] keys and values (the first `real` rows real) -> [B, n, A, d]."""

    @staticmethod
    def forward(ctx, q, k, v, real: int, group, size: int, scale: float):
        fwd, bwd = block_kernels(q.device, q.dtype)
        kr, vr = k[:, :, :real], v[:, :, :real]
        if real:
            o, lse = fwd(q, kr, vr, scale)
            o, lse = o.float(), lse.float()
        else:                                                  # every row of this chunk is padding
            o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        if group is not None:
            o, lse = _merge(o, lse, group, size)
        # a copy also at fp32: torch 2.11's compiler loses the gradient of a returned tensor that another name in
        # the forward holds (parallel/distributed/comm.py's docstring), as o.to(fp32) would be o
        out = o.to(q.dtype, copy=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.real, ctx.group, ctx.scale, ctx.bwd = real, group, scale, bwd
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        real = ctx.real
        dout = dout.float()
        if ctx.group is not None:                              # every copy's output gradient reaches each partial
            dout = dout.contiguous()
            dist.all_reduce(dout, group=ctx.group)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        if not real:
            return torch.zeros_like(q), dk, dv, None, None, None, None
        dq, dkr, dvr = ctx.bwd(dout.to(q.dtype), q, k[:, :, :real].contiguous(), v[:, :, :real].contiguous(), out,
                               lse, ctx.scale)
        dk[:, :, :real], dv[:, :, :real] = dkr, dvr
        return dq, dk, dv, None, None, None, None


def split_keys_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: int, ctx,
                         scale: Optional[float] = None) -> torch.Tensor:
    """Full attention of q [B, A, n, d] (the same on every sp rank) over every sp rank's keys: k, v [B, c, n, d]
    are this rank's chunk, its first `real` rows real keys (the rest sp padding) -> [B, A, n, d], batch first.
    Equal to `F.scaled_dot_product_attention` of q over the concatenated real keys of the sp ranks in order."""
    if not 0 <= real <= k.shape[1]:
        raise ValueError(f"real={real} keys of a chunk of {k.shape[1]}")
    size = sp_size_of(ctx)
    group = ctx.sp_group if size > 1 else None
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    heads_first = [t.transpose(1, 2).contiguous() for t in (q, k, v)]             # (B, n, tokens, d)
    return _SplitKeysAttention.apply(*heads_first, real, group, size, scale).transpose(1, 2)
