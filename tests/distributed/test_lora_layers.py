"""LoRA adapters inside ColumnParallelLinear / RowParallelLinear (parallel/dist/layers.py) at tp 2 against the
same layers at tp 1, in one spawn of 2 gloo ranks: outputs and the gradients of x, A and B (fp32), and the
collectives: a Column (fused q, k, v, adapters on q and v) and a Row layer with adapters issue the all-reduces
they issue without them (Row's forward, Column's backward), each r (or 2 r) elements wider per token, no other.
"""
from __future__ import annotations

import torch

from parallel.dist.comm import count_comm, gather_shards
from parallel.dist.layers import ColumnParallelLinear, RowParallelLinear
from parallel.dist.topology import ParallelContext, ParallelDims
from tests.dist_utils import run_ranks

B, S, H, R = 2, 5, 16, 4
PARTS = [0, 2]                       # adapters on q and v of the fused [q; k; v]


def _pair(ctx):
    torch.manual_seed(3)
    col = ColumnParallelLinear(H, [H, H, H], ctx=ctx)
    row = RowParallelLinear(3 * H, H, ctx=ctx, input_is_parallel=False)
    col.add_lora(R, 2.0 * R, PARTS, torch.Generator().manual_seed(5))
    row.add_lora(R, 2.0 * R, torch.Generator().manual_seed(6))
    g = torch.Generator().manual_seed(7)           # non-zero B (peft starts at 0), the same full B everywhere
    for layer, dim in ((col, 0), (row, None)):
        full = torch.randn(len(PARTS) * H if dim == 0 else H, R, generator=g)
        if dim == 0:                                # this rank's rows of each adapted part
            full = torch.cat([p.chunk(ctx.tp_size)[ctx.tp_rank] for p in full.chunk(len(PARTS))])
        layer.lora_B.data.copy_(full)
    return col, row


def _run(ctx):
    col, row = _pair(ctx)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(B, S, H, generator=g).requires_grad_()
    z = torch.randn(B, S, 3 * H, generator=g).requires_grad_()       # Row's full input (it scatters it)
    dq, dy = torch.randn(B, S, 3 * H, generator=g), torch.randn(B, S, H, generator=g)
    full = lambda p, dim, parts=None: gather_shards(p, ctx, dim, parts) if ctx.tp_size > 1 else p  # noqa: E731
    dq_local = torch.cat([p.chunk(ctx.tp_size, -1)[ctx.tp_rank] for p in dq.chunk(3, -1)], -1)
    with count_comm() as comm:
        q, y = col(x), row(z)
        q.backward(dq_local)
        y.backward(dy)
    grads = {"col.A": col.lora_A.grad, "row.B": row.lora_B.grad,
             "col.B": full(col.lora_B.grad, 0, col.lora_B.tp_parts), "row.A": full(row.lora_A.grad, 1)}
    calls = [c for c in comm.calls if c[0] == "all_reduce"]
    return {"q": full(q.detach(), 2, [H // ctx.tp_size] * 3), "y": y.detach(), "x.grad": x.grad, "z.grad": z.grad,
            **grads, "calls": calls}


def _rank(rank, world_size):
    out = {"tp1": _run(ParallelContext.single())}
    ctx = ParallelContext.build(ParallelDims(tp_size=2, pp_size=1, dp_size=1))
    out["tp2"] = _run(ctx)
    return out


def test_adapters_split_like_their_weights_and_ride_on_the_existing_all_reduces():
    results = run_ranks(_rank, 2)
    for rank, out in enumerate(results):
        ref, got = out["tp1"], out["tp2"]
        for key in ("q", "y", "x.grad", "z.grad", "col.A", "col.B", "row.A", "row.B"):
            torch.testing.assert_close(got[key], ref[key], msg=lambda m: f"rank {rank} {key}: {m}")
        assert ref["calls"] == []
        tokens = B * S
        # forward: Row's all-reduce of [z_i W_i^T, u_i] (H + R); backward: Column's of [dx, du] (H + 2 R)
        assert got["calls"] == [("all_reduce", tokens * (H + R)), ("all_reduce", tokens * (H + len(PARTS) * R))]
