"""parallel/checkpoints/rng.py at another layout: a rank takes the generator states of the writer's rank at its
(stage, dp, sp) with tp rank 0, and only where that file's stream is its own (another tp size: restored; another
dp size or pipeline partition, or a file without its stream: not)."""
from types import SimpleNamespace

import torch

from parallel.checkpoints import rng, safetensors_crc


def _ctx(pp_rank=0, dp_rank=0, sp_rank=0, pp=1, dp=1, sp=1, ring=1):
    return SimpleNamespace(pp_rank=pp_rank, dp_rank=dp_rank, sp_rank=sp_rank, pp_size=pp, dp_size=dp, sp_size=sp,
                           ring_size=ring)


def _write(folder, rank, state, stream=None):
    tensors = {"cpu": state} if stream is None else {"cpu": state, "stream": stream}
    path = folder / rng.FOLDER / f"rank{rank:05d}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors_crc.save(tensors, path)


def _states(seeds):
    out = []
    for s in seeds:
        torch.manual_seed(s)
        out.append(torch.get_rng_state())
    return out


def test_another_tp_size_takes_the_writers_tp_rank_0_of_the_same_stage(tmp_path):
    """Written at tp 2 x pp 2 (ranks 0-3: stage 0 tp 0/1, stage 1 tp 0/1), read at tp 1 x pp 2: stage 1 is rank 2's."""
    states = _states(range(4))
    for rank, state in enumerate(states):
        stage = rank // 2
        _write(tmp_path, rank, state, rng.stream_of(_ctx(pp_rank=stage, pp=2), [2, 2]))
    saved = {"tp_size": 2, "sp_size": 1, "pp_size": 2, "dp_size": 1, "zero_stage": 1}
    ctx = _ctx(pp_rank=1, pp=2)
    torch.manual_seed(123)
    assert rng.restore(tmp_path, saved, ctx, rng.stream_of(ctx, [2, 2]))
    assert torch.equal(torch.get_rng_state(), states[2])


def test_another_stream_is_not_restored(tmp_path):
    states = _states(range(2))
    for rank, state in enumerate(states):                       # written at tp 1 x pp 2, blocks [2, 2]
        _write(tmp_path, rank, state, rng.stream_of(_ctx(pp_rank=rank, pp=2), [2, 2]))
    _write(tmp_path / "old", 1, states[1])                       # a file from before streams were recorded
    saved = {"tp_size": 1, "sp_size": 1, "pp_size": 2, "dp_size": 1, "zero_stage": 1}
    for ctx, blocks, folder in ((_ctx(pp_rank=1, pp=2), [3, 1], tmp_path),    # another partition
                                (_ctx(pp_rank=1, pp=2), [2, 2], tmp_path / "old")):
        torch.manual_seed(123)
        before = torch.get_rng_state()
        assert not rng.restore(folder, saved, ctx, rng.stream_of(ctx, blocks))
        assert torch.equal(torch.get_rng_state(), before)
    # another dp size: the coordinates are other replicas' (dp 2 -> dp 1)
    assert not rng.restore(tmp_path, {**saved, "dp_size": 2, "pp_size": 1}, _ctx(), rng.stream_of(_ctx(), [4]))
    assert rng.restore(tmp_path, saved, _ctx(pp_rank=1, pp=2), rng.stream_of(_ctx(pp_rank=1, pp=2), [2, 2]))
    assert torch.equal(torch.get_rng_state(), states[1])
