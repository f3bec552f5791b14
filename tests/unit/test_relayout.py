"""The slice arithmetic of the layout-free checkpoint copy (parallel/train/relayout.py), in one process: shards
written at one tp size reassemble into the shards the tensor-parallel layers build at another, fused QKV
parts and row splits included (the layers' own slicing is the oracle)."""
import pytest
import torch

from parallel.dist.layers import ColumnParallelLinear
from parallel.train.relayout import Slicing, assemble

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


def test_missing_shard_is_named():
    pieces = stored(column_shard, 2, 0, PARTS)[:1]               # tp rank 1's file lost
    with pytest.raises(ValueError, match="cover 12 of 24 entries along dim 0"):
        assemble(Slicing(0, tuple(PARTS), 1, 0), (24, 6), pieces)
