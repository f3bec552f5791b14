"""A row-parallel adapter's input dropout (parallel/distributed/layers.py ShardDropout), one process playing the tp
ranks: from the same generator state each rank's output is its columns of one process's dropout of the full input,
bit for bit, for a fused input of two parts ([attention, MLP] of a parallel block) too. In spawned ranks, through
training: tests/distributed/test_lora_dropout.py."""
import types

import pytest
import torch
import torch.nn.functional as F

from parallel.distributed.layers import ShardDropout

P = 0.3


def _columns(t: torch.Tensor, parts: list[int], tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s columns of each part of the full `t` (parts' full widths n * tp, concatenated)."""
    pieces = t.split([n * tp for n in parts], -1)
    return torch.cat([piece[..., rank * n:(rank + 1) * n] for piece, n in zip(pieces, parts)], -1)


@pytest.mark.parametrize("parts, tp", [([8], 2), ([3, 5], 2), ([2, 3], 4)])
def test_each_rank_keeps_its_columns_of_the_full_mask(parts, tp):
    x = torch.randn(2, 7, sum(parts) * tp, generator=torch.Generator().manual_seed(0))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        want = F.dropout(x, P)                                   # tp 1: nn.Dropout on the full input
        for rank in range(tp):
            torch.manual_seed(5)                                 # every tp rank's generator in the same state
            ctx = types.SimpleNamespace(tp_size=tp, tp_rank=rank)
            got = ShardDropout(P, parts, ctx)(_columns(x, parts, tp, rank))
            assert torch.equal(got, _columns(want, parts, tp, rank)), rank


def test_tp_1_is_dropout_and_eval_is_the_identity():
    x = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        want = F.dropout(x, P)
        torch.manual_seed(2)
        assert torch.equal(ShardDropout(P, [10], types.SimpleNamespace(tp_size=1, tp_rank=0))(x), want)
    shard = x[:, 5:]
    assert torch.equal(ShardDropout(P, [5], types.SimpleNamespace(tp_size=2, tp_rank=1)).eval()(shard), shard)
