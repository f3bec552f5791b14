"""Sequence-parallel rank arithmetic in one process: the padded split (parallel/distributed/sequence.py)."""
from types import SimpleNamespace

import pytest
import torch

from parallel.distributed.sequence import SequenceAttention, local_range, padded_length, split_sequence


def ctx(sp_size, sp_rank=0):
    return SimpleNamespace(sp_size=sp_size, sp_rank=sp_rank, sp_group=None)


@pytest.mark.parametrize("total, sp, padded", [(56, 2, 56), (58, 3, 60), (58, 4, 60), (50, 4, 52), (53266, 4, 53268)])
def test_ranks_split_the_padded_sequence_evenly(total, sp, padded):
    assert padded_length(total, sp) == padded
    ranges = [local_range(total, ctx(sp, r)) for r in range(sp)]
    assert ranges == [(r * padded // sp, (r + 1) * padded // sp) for r in range(sp)]


def test_split_pads_with_zero_rows_at_the_end_and_passes_no_gradient_to_them():
    x = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3).requires_grad_()
    parts = [split_sequence(x, ctx(4, r)) for r in range(4)]              # 5 tokens -> 8: 2 a rank
    assert [p.shape[1] for p in parts] == [2, 2, 2, 2]
    torch.testing.assert_close(torch.cat(parts, dim=1)[:, :5], x)
    assert parts[2][:, 1:].abs().sum() == 0 and parts[3].abs().sum() == 0
    sum(p.sum() for p in parts).backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))


def test_attention_sees_only_the_real_tokens_and_pads_its_output():
    """Without a group (the planner's shapes): attend gets the S real tokens of S_pad, padded rows give zeros."""
    seen = []

    def attend(q, k, v):
        seen.append(q.shape)
        return v * 2
    attention = SequenceAttention(attend, ctx(4), tokens=5)
    q = torch.randn(1, 2, 8, 3)                                        # one rank's 2 of 8 rows, 8 heads
    out = attention(q, q, q)
    assert seen == [(1, 5, 2, 3)] and out.shape == q.shape
    full = out.reshape(1, 8, 2, 3)
    torch.testing.assert_close(full[:, :5], q.reshape(1, 8, 2, 3)[:, :5] * 2)
    assert full[:, 5:].abs().sum() == 0
