"""model.init_from builds the model without the tensor-parallel layers' random init (parallel/distributed/layers.py
skip_init), then reads the release: the model it ends with must be the one the random init then the read gave, bit
for bit, in every family (and with LoRA's adapters, which draw from their own generator and keep their init).

The skipped tensors are poisoned with NaN through skip_init's `fill` (the entry point's own skip_init wrapped), so a
tensor that nothing overwrote survives as NaN and fails. Skipping draws nothing from the global RNG: building leaves
torch's and Python's generators as it found them, with or without the skip (each stage is built in its own forked
stream), so what training draws afterwards (data, noise, timesteps, dropout) is the same. At tp 2 and pp 2 through
build_trainer (LoRA with an fp8 base and block swap, and the training losses):
tests/distributed/test_init_skip_layouts.py.
"""
import contextlib
import functools
import math
import random
import types

import pytest
import torch

from parallel.distributed.layers import ColumnParallelLinear, RowParallelLinear, skip_init
from parallel.distributed.topology import ParallelContext
from parallel.experiment.config import load_config
from parallel.model.build import build_model
from parallel.weights.diffusers import load_released
from tests.released_utils import write_release

# preset -> overrides: every family with a released format, an image-to-video variant of two, two experts in
# subfolders (Wan 2.2 A14B), and LoRA's adapters (kept from their own generator, not read)
CASES = {
    "cogvideox": ("debug", []),
    "cogvideox-lora": ("debug", ["model.lora.rank=4", "model.lora.dropout=0.1"]),
    "wan": ("debug-wan", []),
    "wan-i2v": ("debug-wan-i2v", []),
    "wan22-experts": ("debug-wan22", []),
    "wan22-ti2v": ("debug-wan22-ti2v", []),
    "hunyuanvideo": ("debug-hunyuan", []),
    "hunyuanvideo15": ("debug-hunyuan15", []),
    "ltx2": ("debug-ltx2", []),
}
POISONED = functools.partial(skip_init, fill=math.nan)


def tensors(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **{f"buffer {n}": b for n, b in model.named_buffers()}}


def assert_same_model(got, want) -> None:
    """Every parameter and buffer finite and equal bit for bit (NaN != NaN: a poisoned survivor fails)."""
    got, want = tensors(got), tensors(want)
    assert got.keys() == want.keys()
    for name, t in got.items():
        assert t.dtype == want[name].dtype and bool(torch.isfinite(t.float()).all()), name
        assert torch.equal(t, want[name]), name


def released_pair(preset, overrides, tmp_path):
    """(cfg with model.init_from, the model random init then the read gives): the release written from a model of
    another seed, so no read tensor equals its init by chance."""
    source = load_config(preset, [*overrides, "train.seed=11"])
    folder = write_release(build_model(source, {}, ParallelContext.single()), source, tmp_path / "release")
    cfg = load_config(preset, [*overrides, f"model.init_from={folder}"])
    want = build_model(cfg, {}, ParallelContext.single())
    load_released(want, ParallelContext.single(), cfg.model, folder)
    return cfg, want


def poisoned_count(cfg) -> tuple[int, int]:
    """(NaN tensors, tensor-parallel weights and biases) of the model built under the poisoned skip, before any
    read: every skipped tensor is NaN, so the comparisons below can fail."""
    with POISONED():
        model = build_model(cfg, {}, ParallelContext.single())
    tp = [t for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
          for t in (m.weight, m.bias) if t is not None]
    return sum(bool(t.isnan().all()) for t in tensors(model).values()), len(tp)


@pytest.mark.parametrize("case", CASES)
def test_sampling_model_without_the_init_equals_init_then_read(case, tmp_path, monkeypatch):
    from parallel.train import sampling

    preset, overrides = CASES[case]
    cfg, want = released_pair(preset, overrides, tmp_path)
    nan, tp = poisoned_count(cfg)
    assert nan == tp > 0
    monkeypatch.setattr(sampling, "skip_init", POISONED)
    with sampling.sampling_model(cfg, {}, types.SimpleNamespace(world_size=1),
                                 types.SimpleNamespace(local_rank=0)) as (forward, _):
        assert_same_model(forward.module, want)
    if cfg.model.lora is not None:          # adapters: A drawn from (train.seed, layer), B zero
        a = [p for n, p in forward.module.named_parameters() if n.endswith("lora_A")]
        assert a and all(p.abs().sum() > 0 for p in a)


def test_opensora_checkpoint_without_the_init_equals_init_then_read(tmp_path, monkeypatch):
    """The single-file format (Open-Sora 2.0's checkpoint, parallel/weights/opensora.py) the same way."""
    from parallel.train import sampling
    from parallel.weights.gather import full_state
    from parallel.weights.opensora import write_opensora
    from tests.helpers.opensora2 import OPENSORA

    source = load_config("debug-hunyuan", [*OPENSORA, "model.cond_embed=true", "train.seed=11"])
    full = full_state(build_model(source, {}, ParallelContext.single()), ParallelContext.single(),
                      source.model.num_layers)
    path = write_opensora(full.items(), source.model, tmp_path / "Open_Sora_v2.safetensors")
    cfg = load_config("debug-hunyuan", [*OPENSORA, "model.cond_embed=true", f"model.init_from={path}"])
    want = build_model(cfg, {}, ParallelContext.single())
    load_released(want, ParallelContext.single(), cfg.model, path)
    monkeypatch.setattr(sampling, "skip_init", POISONED)
    with sampling.sampling_model(cfg, {}, types.SimpleNamespace(world_size=1),
                                 types.SimpleNamespace(local_rank=0)) as (forward, _):
        assert_same_model(forward.module, want)


@pytest.mark.parametrize("preset", ["debug", "debug-wan22", "debug-ltx2"])
def test_building_leaves_the_global_rng_as_it_found_it(preset):
    """With or without the skip: the state after build_model is the state before it (torch's CPU generator and
    Python's), so skipping changes nothing that training draws afterwards."""
    cfg = load_config(preset, ["model.lora.rank=4"] if preset == "debug" else [])
    for skipping in (False, True):
        torch.manual_seed(3)
        random.seed(3)
        before, py = torch.get_rng_state(), random.getstate()
        with skip_init() if skipping else contextlib.nullcontext():
            build_model(cfg, {}, ParallelContext.single())
        assert torch.equal(torch.get_rng_state(), before) and random.getstate() == py, skipping


def test_skipped_layers_keep_shapes_and_marks_and_the_init_returns_after():
    """Inside skip_init a fused column layer and a fused row layer have the shapes and tensor-parallel marks of
    the initialised ones and draw nothing; after it, layers initialise from the RNG as before (the same weights as
    a layer built where no skip was ever entered)."""
    ctx = ParallelContext.single()
    build = lambda: (ColumnParallelLinear(8, [4, 4, 8], ctx=ctx), RowParallelLinear([6, 10], 4, ctx=ctx))
    torch.manual_seed(0)
    plain = build()
    state = torch.manual_seed(0).get_state()
    with skip_init(fill=7.0):
        skipped = build()
        with skip_init(fill=7.0):
            nested = build()
    assert torch.equal(torch.get_rng_state(), state)      # nothing drawn
    again = build()
    for a, b, c, d in zip(plain, skipped, nested, again):
        for name, p in a.named_parameters():
            q = dict(b.named_parameters())[name]
            assert q.shape == p.shape and (q == 7.0).all() and (dict(c.named_parameters())[name] == 7.0).all()
            assert torch.equal(dict(d.named_parameters())[name], p), name
            marks = ("tensor_model_parallel", "partition_dim", "tp_parts")
            assert [getattr(q, k, None) for k in marks] == [getattr(p, k, None) for k in marks], name
