"""ColumnParallelLinear / RowParallelLinear (parallel/distributed/layers.py) against torch.nn.Linear, on CPU with gloo.

Every tp size (2, 4) is spawned once: `_rank_main` builds the tp group, runs all checks in each rank
and returns the weight shards, a list of failed comparisons per check, and the collectives logged by
`count_comm()`. The tests assert on those in the parent, so one failing check does not hide another.
Inside a rank, all collectives of a check run before any comparison, so a failed comparison on one
rank can never leave the other ranks waiting in a collective.

Checked:
  * init: for the same seed, the shards concatenate exactly (torch.equal) to nn.Linear's weight and
    bias (Column along dim 0, Row along dim 1 with a replicated bias, fused Column per part), and the
    tp=1 layer (ParallelContext.single()) equals nn.Linear exactly;
  * fp32 and bf16: output, x.grad, weight.grad and bias.grad of Column (gather_output False/True),
    Row (input_is_parallel True/False) and Column -> GELU -> Row, against nn.Linear with the same
    weights (the reference grads sliced the way the weights are);
  * communication: the Column -> Row MLP does exactly one all-reduce forward and one backward, each of
    batch * seq * hidden elements, and nothing else;
  * compiled: each of the four regions (parallel/distributed/comm.py) under torch.compile gives eager's output
    and input gradient exactly, also on a [1, 1, IN] input, whose last-dim slice is contiguous.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from parallel.distributed.comm import copy_to_tp, count_comm, gather_from_tp, reduce_from_tp, scatter_to_tp
from parallel.distributed.layers import ColumnParallelLinear, RowParallelLinear
from parallel.distributed.topology import ParallelContext, ParallelDims
from tests.dist_utils import run_ranks

WORLD_SIZES = (2, 4)
B, S = 2, 5                  # input [B, S, IN]
IN, OUT, FFN = 16, 24, 32    # all divisible by 4
FUSED = (8, 16, 24)          # e.g. q, k, v sizes of a fused ColumnParallelLinear
SEED_COL, SEED_ROW, SEED_FUSED, SEED_FC1, SEED_FC2, SEED_DATA = 11, 12, 13, 14, 15, 1234

# bf16 tolerances: torch.testing.assert_close's bf16 defaults (rtol=1.6e-2, atol=1e-5) for everything a rank
# computes alone, _BF16_SUM_TOL for the all-reduced sums (Row output, Column input gradient, hence the
# MLP's output and x.grad). There each rank rounds its partial dot product to bf16 and gloo sums the
# partials in bf16, while the reference rounds one full-length dot product once; the error is relative
# to the partials, not to their sum, so near-cancelling entries miss the default atol=1e-5 (observed:
# up to 4.2e-3 absolute on ~6-10% of the entries at tp=2/4). atol=1e-2 (about one bf16 ulp at magnitude 1)
# with the default rtol covers that with margin.
_BF16 = {}
_BF16_SUM_TOL = {"atol": 1e-2, "rtol": 1.6e-2}


# ---------------------------------------------------------------- helpers (run inside the ranks)

def _ref_linear(seed: int, fin: int, fout: int, dtype) -> nn.Linear:
    """nn.Linear initialised (in fp32) after manual_seed(seed), then cast to dtype."""
    torch.manual_seed(seed)
    return nn.Linear(fin, fout).to(dtype)


def _inputs(fin: int, fout: int, dtype):
    """The same random input [B, S, fin] and upstream gradient [B, S, fout] on every rank."""
    gen = torch.Generator().manual_seed(SEED_DATA)
    x = torch.randn(B, S, fin, generator=gen).to(dtype)
    g = torch.randn(B, S, fout, generator=gen).to(dtype)
    return x, g


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def _close(fails: list, what: str, actual, expected, **tol) -> None:
    try:
        torch.testing.assert_close(actual.detach(), expected.detach(), **tol)
    except AssertionError as e:
        fails.append(f"{what}: {e}")


def _equal(fails: list, what: str, actual, expected) -> None:
    if not torch.equal(actual.detach(), expected.detach()):
        fails.append(f"{what}: not exactly equal (max abs diff "
                     f"{(actual.detach().float() - expected.detach().float()).abs().max().item():.3g})")


def _local(n: int, ctx) -> slice:
    m = n // ctx.tp_size
    return slice(ctx.tp_rank * m, (ctx.tp_rank + 1) * m)


# ---------------------------------------------------------------- checks (each returns failure messages)

def _check_column(ctx, dtype, gather_output: bool, tol_x: dict, tol: dict) -> list:
    cols = _local(OUT, ctx)
    ref = _ref_linear(SEED_COL, IN, OUT, dtype)
    torch.manual_seed(SEED_COL)
    tp = ColumnParallelLinear(IN, OUT, ctx=ctx, gather_output=gather_output, dtype=dtype)
    x, g = _inputs(IN, OUT, dtype)

    x_ref = _leaf(x)
    y_ref = ref(x_ref)
    y_ref.backward(g)
    x_tp = _leaf(x)
    y = tp(x_tp)
    y.backward(g if gather_output else g[..., cols])

    fails = []
    _equal(fails, "initial weight shard", tp.weight, ref.weight[cols])
    _close(fails, "output", y, y_ref if gather_output else y_ref[..., cols], **tol)
    _close(fails, "x.grad", x_tp.grad, x_ref.grad, **tol_x)   # all-reduced over ranks
    _close(fails, "weight.grad", tp.weight.grad, ref.weight.grad[cols], **tol)
    _close(fails, "bias.grad", tp.bias.grad, ref.bias.grad[cols], **tol)
    return fails


def _check_row(ctx, dtype, input_is_parallel: bool, tol_y: dict, tol: dict) -> list:
    cols = _local(IN, ctx)
    ref = _ref_linear(SEED_ROW, IN, OUT, dtype)
    torch.manual_seed(SEED_ROW)
    tp = RowParallelLinear(IN, OUT, ctx=ctx, input_is_parallel=input_is_parallel, dtype=dtype)
    x, g = _inputs(IN, OUT, dtype)

    x_ref = _leaf(x)
    y_ref = ref(x_ref)
    y_ref.backward(g)
    x_tp = _leaf(x[..., cols] if input_is_parallel else x)
    y = tp(x_tp)
    y.backward(g)

    fails = []
    _equal(fails, "initial weight shard", tp.weight, ref.weight[:, cols])
    _equal(fails, "initial bias", tp.bias, ref.bias)
    _close(fails, "output", y, y_ref, **tol_y)                # partial sums all-reduced
    _close(fails, "x.grad", x_tp.grad, x_ref.grad[..., cols] if input_is_parallel else x_ref.grad, **tol)
    _close(fails, "weight.grad", tp.weight.grad, ref.weight.grad[:, cols], **tol)
    _close(fails, "bias.grad", tp.bias.grad, ref.bias.grad, **tol)
    return fails


def _tp_mlp(ctx, dtype) -> nn.Sequential:
    torch.manual_seed(SEED_FC1)
    fc1 = ColumnParallelLinear(IN, FFN, ctx=ctx, dtype=dtype)
    torch.manual_seed(SEED_FC2)
    fc2 = RowParallelLinear(FFN, IN, ctx=ctx, input_is_parallel=True, dtype=dtype)
    return nn.Sequential(fc1, nn.GELU(), fc2)


def _check_mlp(ctx, dtype, tol_sum: dict, tol: dict) -> list:
    hid = _local(FFN, ctx)
    ref = nn.Sequential(_ref_linear(SEED_FC1, IN, FFN, dtype), nn.GELU(), _ref_linear(SEED_FC2, FFN, IN, dtype))
    tp = _tp_mlp(ctx, dtype)
    x, g = _inputs(IN, IN, dtype)

    x_ref = _leaf(x)
    y_ref = ref(x_ref)
    y_ref.backward(g)
    x_tp = _leaf(x)
    y = tp(x_tp)
    y.backward(g)

    fails = []
    _equal(fails, "initial fc1.weight shard", tp[0].weight, ref[0].weight[hid])
    _equal(fails, "initial fc2.weight shard", tp[2].weight, ref[2].weight[:, hid])
    _close(fails, "output", y, y_ref, **tol_sum)              # all-reduced in fc2's forward
    _close(fails, "x.grad", x_tp.grad, x_ref.grad, **tol_sum) # all-reduced in fc1's backward
    _close(fails, "fc1.weight.grad", tp[0].weight.grad, ref[0].weight.grad[hid], **tol)
    _close(fails, "fc1.bias.grad", tp[0].bias.grad, ref[0].bias.grad[hid], **tol)
    _close(fails, "fc2.weight.grad", tp[2].weight.grad, ref[2].weight.grad[:, hid], **tol)
    _close(fails, "fc2.bias.grad", tp[2].bias.grad, ref[2].bias.grad, **tol)
    return fails


def _check_regions_compiled(ctx) -> list:
    """Each region compiled (aot_eager: dynamo and AOTAutograd, eager's kernels; one graph) against eager, on an
    input that differs by rank: output and input gradient equal exactly. Under torch 2.11 reduce_from_tp's
    in-place all-reduce and the contiguous slice's no-op .contiguous() compiled to a zero input gradient
    (comm.py's docstring)."""
    fails = []
    regions = {"copy_to_tp": copy_to_tp, "reduce_from_tp": reduce_from_tp, "gather_from_tp": gather_from_tp,
               "scatter_to_tp": scatter_to_tp}
    for shape in ((B, S, IN), (1, 1, IN)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(SEED_DATA)) * (1 + ctx.tp_rank)
        for name, region in regions.items():
            def f(t):
                return region(t * t, ctx).sin()          # sin: the gradient depends on the output's values

            runs = []
            for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
                t = _leaf(x)
                y = fn(t)
                y.sum().backward()
                runs.append((y, t.grad))
            torch._dynamo.reset()
            (y, dx), (y_compiled, dx_compiled) = runs
            _equal(fails, f"{name} {list(shape)} compiled output", y_compiled, y)
            _equal(fails, f"{name} {list(shape)} compiled x.grad", dx_compiled, dx)
    return fails


F32 = torch.float32
BF16 = torch.bfloat16
CHECKS = {
    "fp32-column": lambda ctx: _check_column(ctx, F32, False, {}, {}),
    "fp32-column-gather": lambda ctx: _check_column(ctx, F32, True, {}, {}),
    "fp32-row-parallel-input": lambda ctx: _check_row(ctx, F32, True, {}, {}),
    "fp32-row-full-input": lambda ctx: _check_row(ctx, F32, False, {}, {}),
    "fp32-mlp": lambda ctx: _check_mlp(ctx, F32, {}, {}),
    # Column's x.grad is a sum of per-rank bf16 partial products: _BF16_SUM_TOL; the rest uses the defaults.
    "bf16-column": lambda ctx: _check_column(ctx, BF16, False, _BF16_SUM_TOL, _BF16),
    "bf16-column-gather": lambda ctx: _check_column(ctx, BF16, True, _BF16_SUM_TOL, _BF16),
    # Row's output is a sum of per-rank bf16 partial products: _BF16_SUM_TOL; the rest uses the defaults.
    "bf16-row-parallel-input": lambda ctx: _check_row(ctx, BF16, True, _BF16_SUM_TOL, _BF16),
    "bf16-row-full-input": lambda ctx: _check_row(ctx, BF16, False, _BF16_SUM_TOL, _BF16),
    # MLP: output (fc2's all-reduce) and x.grad (fc1's all-reduce) _BF16_SUM_TOL, the weight grads the defaults.
    "bf16-mlp": lambda ctx: _check_mlp(ctx, BF16, _BF16_SUM_TOL, _BF16),
    "fp32-regions-compiled": _check_regions_compiled,
}


def _shards(ctx) -> dict:
    """This rank's freshly initialised parameters of the layers whose init the parent checks."""
    out = {}
    for dtype in (F32, BF16):
        torch.manual_seed(SEED_COL)
        col = ColumnParallelLinear(IN, OUT, ctx=ctx, dtype=dtype)
        torch.manual_seed(SEED_ROW)
        row = RowParallelLinear(IN, OUT, ctx=ctx, dtype=dtype)
        torch.manual_seed(SEED_FUSED)
        fused = ColumnParallelLinear(IN, list(FUSED), ctx=ctx, dtype=dtype)
        for name, layer in (("column", col), ("row", row), ("fused", fused)):
            out[name, dtype] = {
                "weight": layer.weight.detach().clone(), "bias": layer.bias.detach().clone(),
                "weight_attrs": (getattr(layer.weight, "tensor_model_parallel", False),
                                 getattr(layer.weight, "partition_dim", None)),
                "bias_attrs": (getattr(layer.bias, "tensor_model_parallel", False),
                               getattr(layer.bias, "partition_dim", None)),
            }
    return out


def _comm_log(ctx) -> dict:
    """Collectives of one Column -> GELU -> Row forward and backward."""
    mlp = _tp_mlp(ctx, F32)
    x, g = _inputs(IN, IN, F32)
    x = _leaf(x)
    with count_comm() as counter:
        y = mlp(x)
        forward = list(counter.calls)
        y.backward(g)
        calls = list(counter.calls)
    return {"forward": forward, "backward": calls[len(forward):],
            "all_reduce_count": counter.count("all_reduce"), "all_reduce_numels": counter.numels("all_reduce"),
            "all_gather_count": counter.count("all_gather")}


def _rank_main(rank: int, world_size: int) -> dict:
    ctx = ParallelContext.build(ParallelDims(tp_size=world_size, pp_size=1, dp_size=1))
    assert ctx.tp_rank == rank and ctx.tp_size == world_size
    return {"shards": _shards(ctx), "comm": _comm_log(ctx),
            "checks": {name: check(ctx) for name, check in CHECKS.items()}}


# ---------------------------------------------------------------- tests (parent process)

@functools.lru_cache(maxsize=None)
def _results(world_size: int) -> tuple:
    """One spawn per world size, shared by every test below."""
    return tuple(run_ranks(_rank_main, world_size))


def _reference(seed: int, fin: int, fout: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(fin, fout)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_column_and_row_shards_concatenate_to_nn_linear(world_size, dtype):
    res = _results(world_size)

    ref = _reference(SEED_COL, IN, OUT)
    col = [r["shards"]["column", dtype] for r in res]
    assert torch.equal(torch.cat([s["weight"] for s in col], dim=0), ref.weight.detach().to(dtype))
    assert torch.equal(torch.cat([s["bias"] for s in col], dim=0), ref.bias.detach().to(dtype))

    ref = _reference(SEED_ROW, IN, OUT)
    row = [r["shards"]["row", dtype] for r in res]
    assert torch.equal(torch.cat([s["weight"] for s in row], dim=1), ref.weight.detach().to(dtype))
    for s in row:   # the bias is replicated, not sharded
        assert torch.equal(s["bias"], ref.bias.detach().to(dtype))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fused_column_shards_hold_each_part_slice(world_size, dtype):
    ref = _reference(SEED_FUSED, IN, sum(FUSED))
    w_parts = ref.weight.detach().to(dtype).split(FUSED, dim=0)
    b_parts = ref.bias.detach().to(dtype).split(FUSED, dim=0)
    for r, res in enumerate(_results(world_size)):
        s = res["shards"]["fused", dtype]
        sl = [slice(r * n // world_size, (r + 1) * n // world_size) for n in FUSED]
        assert torch.equal(s["weight"], torch.cat([p[i] for p, i in zip(w_parts, sl)], dim=0)), f"rank {r}"
        assert torch.equal(s["bias"], torch.cat([p[i] for p, i in zip(b_parts, sl)], dim=0)), f"rank {r}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_partition_attributes(world_size):
    for res in _results(world_size):
        for name in ("column", "fused"):
            assert res["shards"][name, F32]["weight_attrs"] == (True, 0)
            assert res["shards"][name, F32]["bias_attrs"] == (True, 0)
        assert res["shards"]["row", F32]["weight_attrs"] == (True, 1)
        assert res["shards"]["row", F32]["bias_attrs"][0] is False   # replicated


def test_single_context_equals_nn_linear():
    ctx = ParallelContext.single()
    ref = _reference(SEED_COL, IN, OUT)
    torch.manual_seed(SEED_COL)
    col = ColumnParallelLinear(IN, OUT, ctx=ctx)
    assert torch.equal(col.weight, ref.weight) and torch.equal(col.bias, ref.bias)
    ref = _reference(SEED_ROW, IN, OUT)
    torch.manual_seed(SEED_ROW)
    row = RowParallelLinear(IN, OUT, ctx=ctx)
    assert torch.equal(row.weight, ref.weight) and torch.equal(row.bias, ref.bias)

    ref_col = _reference(SEED_COL, IN, OUT)
    x, _ = _inputs(IN, OUT, F32)
    with count_comm() as counter, torch.no_grad():
        assert torch.equal(col(x), ref_col(x))
        assert torch.equal(row(x), ref(x))
    assert counter.calls == []   # tp=1 communicates nothing


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_forward_backward_matches_nn_linear(world_size, check):
    failures = [f"rank {r}: {msg}" for r, res in enumerate(_results(world_size)) for msg in res["checks"][check]]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_mlp_issues_one_all_reduce_each_way(world_size):
    numel = B * S * IN   # the Row output forward, the Column input gradient backward
    for r, res in enumerate(_results(world_size)):
        comm = res["comm"]
        assert comm["forward"] == [("all_reduce", numel)], f"rank {r}"
        assert comm["backward"] == [("all_reduce", numel)], f"rank {r}"
        assert comm["all_reduce_count"] == 2 and comm["all_reduce_numels"] == [numel, numel], f"rank {r}"
        assert comm["all_gather_count"] == 0, f"rank {r}"
