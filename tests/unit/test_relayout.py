"""The slice arithmetic of the layout-free checkpoint copy (parallel/checkpoints/slicing.py), in one process: shards
written at one tp size reassemble into the shards the tensor-parallel layers build at another, fused QKV
parts and row splits included (the layers' own slicing is the oracle); and which checkpoints find_resume takes."""
import json

import pytest
import torch

from parallel.distributed.layers import ColumnParallelLinear
from parallel.checkpoints import checkpoint
from parallel.checkpoints.slicing import Slicing, assemble

FULL = torch.arange(24 * 6, dtype=torch.float32).reshape(24, 6)      # [out = 8 + 8 + 8 (q, k, v), in = 6]
PARTS = [8, 8, 8]


def column_shard(tp: int, rank: int, parts=PARTS) -> torch.Tensor:
    """ColumnParallelLinear's own shard of FULL: rank i holds [Wq_i; Wk_i; Wv_i]."""
    local = [n // tp for n in parts]
    return ColumnParallelLinear._shard(FULL, parts, local, rank, (sum(local), 6), None, None)


def row_shard(tp: int, rank: int) -> torch.Tensor:
    k = FULL.shape[1] // tp
    return FULL[:, rank * k:(rank + 1) * k]


def reader(tensor: torch.Tensor):
    def read(dim, start, n):
        return tensor if dim is None else tensor.narrow(dim, start, n)
    return read


def stored(shard_fn, tp: int, dim: int, parts) -> list:
    return [(Slicing(dim, tuple(parts), tp, r), reader(shard_fn(tp, r))) for r in range(tp)]


@pytest.mark.parametrize("old_tp, new_tp", [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (2, 2)])
def test_fused_column_shards_move_between_tp_sizes(old_tp, new_tp):
    pieces = stored(column_shard, old_tp, 0, PARTS)
    for r in range(new_tp):
        want = column_shard(new_tp, r)
        got = assemble(Slicing(0, tuple(PARTS), new_tp, r), tuple(want.shape), pieces)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(column_shard(2, 0), FULL[:12])        # fused parts: not one contiguous split


@pytest.mark.parametrize("old_tp, new_tp", [(1, 2), (2, 1), (3, 2), (2, 3)])
def test_row_shards_move_between_tp_sizes(old_tp, new_tp):
    pieces = stored(row_shard, old_tp, 1, [6])
    for r in range(new_tp):
        want = row_shard(new_tp, r)
        got = assemble(Slicing(1, (6,), new_tp, r), tuple(want.shape), pieces)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_replicated_tensor_is_read_whole():
    pieces = [(Slicing(None, (), 2, 0), reader(FULL))]
    torch.testing.assert_close(assemble(Slicing(None, (), 4, 3), tuple(FULL.shape), pieces), FULL)


@pytest.mark.parametrize("old_tp, new_tp", [(1, 2), (2, 1), (2, 4)])
def test_fp8_shards_are_re_cut_in_their_own_dtype(old_tp, new_tp):
    """The fp8 base's codes (a buffer, stored in its dtype) move between tp sizes byte for byte: no float32 copy."""
    codes = (FULL / FULL.abs().max() * 400).to(torch.float8_e4m3fn)
    pieces = [(Slicing(0, tuple(PARTS), old_tp, r), reader(ColumnParallelLinear._shard(
        codes, PARTS, [n // old_tp for n in PARTS], r, None, None, None))) for r in range(old_tp)]
    for r in range(new_tp):
        local = [n // new_tp for n in PARTS]
        want = ColumnParallelLinear._shard(codes, PARTS, local, r, None, None, None)
        got = assemble(Slicing(0, tuple(PARTS), new_tp, r), tuple(want.shape), pieces)
        assert got.dtype == torch.float8_e4m3fn and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_replicated_tensor_that_differed_between_tp_ranks_is_read_at_that_tp_only():
    """Written by each tp rank (an fp8 scale taken per shard): each rank of the same tp size reads its own, another tp
    size is refused, naming the tp to resume at."""
    pieces = [(Slicing(None, (), 2, r), reader(torch.tensor(float(r + 1)))) for r in range(2)]
    assert [assemble(Slicing(None, (), 2, r), (), pieces).item() for r in range(2)] == [1.0, 2.0]
    with pytest.raises(ValueError, match=r"differs between the tp ranks .* resume at parallel.tp_size=2, not 1"):
        assemble(Slicing(None, (), 1, 0), (), pieces)


def test_missing_shard_is_named():
    pieces = stored(column_shard, 2, 0, PARTS)[:1]               # tp rank 1's file lost
    with pytest.raises(ValueError, match="cover 12 of 24 entries along dim 0"):
        assemble(Slicing(0, tuple(PARTS), 1, 0), (24, 6), pieces)


def marked(directory, step, layout, copy=True):
    """A complete step{step} folder written at `layout` (with its layout-free state.json when `copy`)."""
    folder = directory / f"step{step}"
    (folder / "layout_free").mkdir(parents=True)
    files = {}
    if copy:
        (folder / "layout_free" / "state.json").write_text("{}")
        files["layout_free/state.json"] = 2
    (folder / checkpoint.MARKER).write_text(json.dumps({"step": step, "layout": layout, "files": files}))


SAVED = {"tp_size": 2, "pp_size": 2, "dp_size": 1, "zero_stage": 1, "global_batch": 4}    # no sp_size: an old marker


def test_find_resume_takes_another_layout_with_its_copy(tmp_path):
    marked(tmp_path, 3, SAVED)
    here = {"tp_size": 1, "sp_size": 1, "pp_size": 1, "dp_size": 4, "zero_stage": 2, "global_batch": 4}
    assert checkpoint.find_resume(tmp_path, here) == "step3"
    assert not checkpoint.same_layout(checkpoint.saved_layout(tmp_path / "step3"), here)
    assert checkpoint.same_layout(checkpoint.saved_layout(tmp_path / "step3"), {**SAVED, "sp_size": 1})


def test_find_resume_refuses_another_global_batch_and_a_checkpoint_without_a_copy(tmp_path):
    marked(tmp_path, 3, SAVED)
    with pytest.raises(ValueError, match=r"trained with global batch 4, this run's is 8 .*keep 4 to resume it"):
        checkpoint.find_resume(tmp_path, {**SAVED, "sp_size": 1, "global_batch": 8})
    marked(tmp_path / "old", 3, SAVED, copy=False)
    here = {"tp_size": 1, "sp_size": 1, "pp_size": 1, "dp_size": 4, "zero_stage": 2}
    with pytest.raises(ValueError, match=r"written at tp 2 sp 1 pp 2 dp 1 ZeRO-1 without a layout-free copy .*"
                                         r"Resume it at tp 2 sp 1 pp 2 dp 1 ZeRO-1"):
        checkpoint.find_resume(tmp_path / "old", here)
    assert checkpoint.find_resume(tmp_path / "old", {**SAVED, "sp_size": 1}) == "step3"


def test_resume_accumulation_keeps_the_saved_global_batch(tmp_path):
    """A rerun at half the dp size accumulates twice as many micro-batches (train.py sets it); a global batch
    accumulation cannot reach (or the same one at the same dp) is left to find_resume. The same global batch
    at another dp (an elastic run back on every node) is named, so that the log says accumulation went back."""
    marked(tmp_path, 3, {**SAVED, "global_batch": 8})
    assert checkpoint.resume_accumulation(tmp_path, 4, per_accumulation=2) == (4, 8)
    assert checkpoint.resume_accumulation(tmp_path, 8, per_accumulation=4) is None
    assert checkpoint.resume_accumulation(tmp_path, 8, per_accumulation=4, dp_size=1) is None
    assert checkpoint.resume_accumulation(tmp_path, 8, per_accumulation=4, dp_size=2) == (2, 8)
    assert checkpoint.resume_accumulation(tmp_path, 3, per_accumulation=3) is None
    assert checkpoint.resume_accumulation(tmp_path / "none", 4, per_accumulation=2) is None
