"""Ring attention: exact full (bidirectional) attention over a sequence split into r chunks on r ranks.

Ring rank i holds the queries, keys and values of chunk i, [B, c, n, d] (batch first, c = S_pad / r tokens).
It keeps its queries and passes key/value chunks around the ring: at step t it attends to chunk
j = (i - t) mod r while the next chunk travels from rank i - 1 (send and receive posted together before
the step's attention, waited after it). Each block gives a partial output O_j and its log-sum-exp
L_j = log sum_k exp(q.k_k / sqrt(d)); the blocks merge exactly (per query row):

    L = log(exp(L_a) + exp(L_b)),    O = exp(L_a - L) O_a + exp(L_b - L) O_b

Backward recomputes per block with the merged O and L (P_j = exp(q K_j^T s - L) is the block's share of
the full softmax): dQ sums over the blocks locally; dK_j, dV_j are added into an fp32 accumulator that
travels around the ring one step behind chunk j's keys, so after r steps it reaches chunk j's owner
holding every rank's contribution. Traffic per attention: r - 1 key/value chunks forward, r - 1
key/value chunks and r fp32 dK/dV chunks backward, each 2 x B x c x n x d elements.

Padding: `lengths[j]` is the number of real tokens in chunk j (the sequence is padded at its end to a
multiple of the sp size). Padded keys are left out of every block and padded query rows give zero output,
as Ulysses' `SequenceAttention` does. The kernel that returns the log-sum-exp is chosen per device in
`block_kernels` only; the ring logic does not know it.

Key mask: `keep` [B, m] says which of the sequence's first m keys take part (HunyuanVideo's text padding rows
do not; queries are not masked). A chunk that holds masked keys is attended row by row of the batch over its
kept keys only (`_chunk_keys`: their indices), so every kernel stays unmasked and exact. A batch row whose
chunk keeps no key skips that block: its log-sum-exp stays -inf there and the merge, which only ever adds a
block with at least one key, never forms exp(-inf - -inf) (no NaN).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

# forward(q, k, v, scale) -> (o, lse); backward(do, q, k, v, o, lse, scale) -> (dq, dk, dv); [B, n, s, d]
Kernels = tuple[Callable, Callable]


def _math_forward(q, k, v, scale):
    """Plain attention in fp32 with its log-sum-exp: [B, n, s, d] -> ([B, n, s, d], [B, n, s] fp32)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale             # (B, n, s_q, s_k)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()).to(q.dtype), lse


def _math_backward(do, q, k, v, o, lse, scale):
    """dS = P * (dP - rowsum(dO * O)), P = exp(S - L): the softmax gradient with the merged O and L."""
    q32, k32, v32, do32 = q.float(), k.float(), v.float(), do.float()
    p = torch.exp(torch.matmul(q32, k32.transpose(-1, -2)) * scale - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), do32)
    dp = torch.matmul(do32, v32.transpose(-1, -2))
    ds = p * (dp - (do32 * o.float()).sum(-1, keepdim=True))
    dq, dk = torch.matmul(ds, k32) * scale, torch.matmul(ds.transpose(-1, -2), q32) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _cpu_forward(q, k, v, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)


def _cpu_backward(do, q, k, v, o, lse, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do.contiguous(), q, k, v, o, lse, 0.0, False, scale=scale)


def _flash_forward(q, k, v, scale):
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
    return o, lse


def _flash_backward(do, q, k, v, o, lse, scale):
    """The forward's own values for what it does not use: no varlen offsets (None, as the dense forward returns:
    defined offsets select the varlen kernel, which wants int32 ones), and the uint64 dropout seed and offset
    (not read at dropout 0). Empty int64 offsets failed on CUDA: 'cu_seqlens_q must have dtype int32'."""
    seed, offset = (torch.zeros(shape, dtype=torch.uint64, device=q.device) for shape in ((2,), ()))
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do.contiguous(), q, k, v, o, lse, None, None, q.shape[2], k.shape[2], 0.0, False, seed, offset,
        scale=scale)


def block_kernels(device: torch.device, dtype: torch.dtype) -> Kernels:
    """The attention that returns the log-sum-exp, for this device and dtype: PyTorch's CPU flash kernel on
    CPU, its flash kernel for 16-bit inputs on CUDA, plain fp32 math elsewhere (and for fp32 on CUDA)."""
    if device.type == "cpu":
        return _cpu_forward, _cpu_backward
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return _flash_forward, _flash_backward
    return _math_forward, _math_backward


class Ring:
    """This rank's place in a ring group: `size`, `index`, and the global ranks of its neighbours."""

    def __init__(self, group, ranks: Optional[Sequence[int]] = None):
        self.group = group
        self.ranks = list(ranks) if ranks is not None else dist.get_process_group_ranks(group)
        self.size, self.index = len(self.ranks), self.ranks.index(dist.get_rank())
        self.next, self.prev = self.ranks[(self.index + 1) % self.size], self.ranks[(self.index - 1) % self.size]

    def shift(self, t: torch.Tensor, tag: int) -> tuple[torch.Tensor, "Transfer"]:
        """Start sending `t` to the next rank and receiving the previous rank's into a new buffer: (buffer,
        transfer). Wait the transfer before reading the buffer or letting `t` go.

        The send and the receive are posted together (`batch_isend_irecv`: one NCCL group call). Posted one
        by one, every rank's isend to its next neighbour waits for a receive that rank has not posted yet, a
        cycle that hangs on NCCL while the pair's communicator is created (ring-flash-attn batches them too)."""
        buf = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag),
               dist.P2POp(dist.irecv, buf, self.prev, self.group, tag)]
        return buf, Transfer(dist.batch_isend_irecv(ops))


class Transfer:
    """The works of one batched send and receive (one coalesced work on NCCL, one per op on gloo)."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _chunk_keys(keep: Optional[torch.Tensor], lengths: Sequence[int], c: int) -> tuple:
    """Per ring chunk j of c tokens: None where its first lengths[j] keys all take part in every batch row
    (one block over them), else per batch row the indices of its kept keys among them (1-D int64 tensors on
    keep's device; masked and padded keys left out). keep [B, m]: the first m keys of the sequence."""
    if keep is None:
        return (None,) * len(lengths)
    host, plan = keep.bool().cpu(), []
    for j, n in enumerate(lengths):
        part = host[:, j * c:j * c + n]                                           # (B, <= n): mask in chunk j
        if part.all():
            plan.append(None)
            continue
        rows = torch.ones(host.shape[0], n, dtype=torch.bool)
        rows[:, :part.shape[1]] = part
        plan.append(tuple(r.nonzero().squeeze(1).to(keep.device) for r in rows))
    return tuple(plan)


def _blocks(keys, n: int):
    """(batch rows, key selection) pairs one chunk attends as: all rows over its first n keys, or per row its
    kept keys (rows with none left out)."""
    if keys is None:
        return [(slice(None), n)] if n else []
    return [(slice(b, b + 1), idx) for b, idx in enumerate(keys) if idx.numel()]


def _take(t: torch.Tensor, rows: slice, sel) -> torch.Tensor:
    """[B, n, c, d] -> the keys `sel` (a count from the start, or indices) of batch `rows`."""
    return t[rows, :, :sel] if isinstance(sel, int) else t[rows].index_select(2, sel)


def _put(dst: torch.Tensor, rows: slice, sel, src: torch.Tensor) -> None:
    """dst[rows, :, sel] = src for `sel` as in `_take`."""
    if isinstance(sel, int):
        dst[rows, :, :sel] = src
    else:
        dst[rows].index_copy_(2, sel, src)


_KV, _DKV = 1, 2           # message tags: key/value chunks and dK/dV accumulators travel on separate tags


class _RingAttention(torch.autograd.Function):
    """[B, n, c, d] heads-first chunks in, [B, n, c, d] out (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, lengths: tuple, scale: float, keys: tuple):
        fwd, bwd = block_kernels(q.device, q.dtype)
        rq = lengths[ring.index]
        qr = q[:, :, :rq]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        o, lo = out[:, :, :rq], lse[:, :, :rq]                                     # views: merged in place
        kv = torch.stack([k, v])                                                   # (2, B, n, c, d)
        for step in range(ring.size):
            j = (ring.index - step) % ring.size
            if step + 1 < ring.size:
                nxt, moving = ring.shift(kv, _KV)     # the next chunk travels during this one's attention
            for rows, sel in _blocks(keys[j], lengths[j]) if rq else ():
                oj, lj = fwd(qr[rows], _take(kv[0], rows, sel), _take(kv[1], rows, sel), scale)
                ob, lb = o[rows], lo[rows]                                                     # views
                new = torch.logaddexp(lb, lj)
                ob.mul_(torch.exp(lb - new).unsqueeze(-1)).add_(oj.float() * torch.exp(lj - new).unsqueeze(-1))
                lb.copy_(new)
            if step + 1 < ring.size:
                moving.wait()
                kv = nxt
        out = out.to(q.dtype, copy=True)     # a new tensor at fp32 too: torch 2.11 (parallel/distributed/comm.py)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.lengths, ctx.scale, ctx.bwd, ctx.keys = ring, lengths, scale, bwd, keys
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, lengths, scale, bwd, keys = ctx.ring, ctx.lengths, ctx.scale, ctx.bwd, ctx.keys
        rq = lengths[ring.index]
        qr, outr, lser, dor = (t[:, :, :rq].contiguous() for t in (q, out, lse, dout))
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        acc = None                # (accumulator sent on, the next one's buffer, its transfer)
        for step in range(ring.size):
            j = (ring.index - step) % ring.size
            if step + 1 < ring.size:
                nxt, moving = ring.shift(kv, _KV)
            mine = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)  # (2, B, n, c, d)
            for rows, sel in _blocks(keys[j], lengths[j]) if rq else ():
                dqj, dkj, dvj = bwd(dor[rows], qr[rows], _take(kv[0], rows, sel), _take(kv[1], rows, sel),
                                    outr[rows], lser[rows], scale)
                dq[rows, :, :rq] += dqj.float()
                _put(mine[0], rows, sel, dkj.float())
                _put(mine[1], rows, sel, dvj.float())
            if acc is not None:   # chunk j's dK/dV from every rank before us on its way round, and our last send
                _, buf, acc_moving = acc
                acc_moving.wait()
                mine += buf
            acc = (mine, *ring.shift(mine, _DKV))          # on to the next rank: chunk j's owner after step r-1
            if step + 1 < ring.size:
                moving.wait()
                kv = nxt
        _, dkv, acc_moving = acc
        acc_moving.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, lengths: Sequence[int],
                   scale: Optional[float] = None, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Full attention of this rank's queries over every ring rank's keys: q, k, v [B, c, n, d] (this rank's
    chunk, batch first) -> [B, c, n, d]. `lengths[j]`: real tokens in ring rank j's chunk (the rest is padding,
    its output zero); `keep` [B, m] bool, the same on every ring rank: which of the sequence's first m keys
    take part (None: all). Same as `F.scaled_dot_product_attention` on the concatenated real tokens with
    attn_mask = keep padded with True."""
    if len(lengths) != ring.size or any(not 0 <= n <= q.shape[1] for n in lengths):
        raise ValueError(f"lengths {list(lengths)} must give 0..{q.shape[1]} real tokens for each of {ring.size} "
                         f"ring ranks")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    heads_first = [t.transpose(1, 2).contiguous() for t in (q, k, v)]             # (B, n, c, d)
    keys = _chunk_keys(keep, lengths, q.shape[1])
    return _RingAttention.apply(*heads_first, ring, tuple(lengths), scale, keys).transpose(1, 2)
