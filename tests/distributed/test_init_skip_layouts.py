"""build_trainer with model.init_from skips the tensor-parallel layers' random init (parallel/distributed/layers.py
skip_init) in 2 gloo ranks: the engine it returns holds, on every rank, the tensors the random init then the read gave,
bit for bit, and trains to the same losses and weights bit for bit.

Each case is built twice in the same ranks, from the same seed_all as train.py's start_engine: once with the skipped
tensors poisoned (skip_init's NaN fill, build_trainer's own skip_init wrapped), once with the init run (the code before
the skip); then 2 steps each. Cases: tp 2 with LoRA (adapters from their own generator, dropout drawing from the global
RNG after the build), an fp8 base (quantised from the read weights) and block swap (the read weights pinned in host
memory); pp 2 of Wan with activation checkpointing, full fine-tuning. One process, every family:
tests/unit/test_init_skip.py.
"""
from __future__ import annotations

import pytest
import torch

from parallel.distributed.topology import ParallelContext
from parallel.experiment.config import load_config
from parallel.model.build import build_model
from tests.dist_utils import run_ranks
from tests.released_utils import write_release
from tests.train_utils import experiment_overrides, fp32_config

STEPS = 2
CASES = {      # name -> (preset, tp, pp, overrides, activation checkpointing)
    "debug-tp2-lora-fp8-swap": ("debug", 2, 1, ["model.lora.rank=4", "model.lora.dropout=0.1",
                                                "model.lora.base_dtype=float8_e4m3fn", "train.block_swap=1"], False),
    "wan-pp2": ("debug-wan", 1, 2, [], True),
}


def _tensors(module) -> dict:
    return {**{n: p.detach().clone() for n, p in module.named_parameters()},
            **{f"buffer {n}": b.detach().clone() for n, b in module.named_buffers()}}


def _run(cfg, ctx, ds, skip) -> dict:
    """build_trainer under `skip` (what it takes for skip_init), then STEPS steps: the tensors after the build and
    after training, and the losses."""
    import parallel.train.engine as engine
    from parallel.distributed.seed import seed_all
    from parallel.train.run import training_batches

    entered = []

    def counted():
        entered.append(True)
        return skip()
    original, engine.skip_init = engine.skip_init, counted
    try:
        seed_all(cfg.train.seed)
        trainer = engine.build_trainer(cfg, ds, ctx)
    finally:
        engine.skip_init = original
    assert entered == [True]            # model.init_from: built inside skip_init
    built = _tensors(trainer.engine.module)
    batches = training_batches(cfg, ctx)
    losses = [trainer.train_step(batches).loss for _ in range(STEPS)]
    return {"built": built, "trained": _tensors(trainer.engine.module), "losses": losses}


def _rank(rank, world_size, folders):
    import contextlib
    import functools
    import math

    import deepspeed

    from parallel.distributed import accelerator
    from parallel.distributed.layers import skip_init
    from parallel.distributed.topology import ParallelDims

    deepspeed.init_distributed(dist_backend=accelerator.backend())
    out = {}
    for name, (preset, tp, pp, extra, checkpointing) in CASES.items():
        dp = world_size // (tp * pp)
        cfg = load_config(preset, [*experiment_overrides(tp, pp, dp, extra), f"model.init_from={folders[name]}"])
        ctx = ParallelContext.build(ParallelDims(tp_size=tp, pp_size=pp, dp_size=dp))
        ds = fp32_config(stage=0, checkpointing=checkpointing)
        out[name] = {"skipped": _run(cfg, ctx, ds, functools.partial(skip_init, fill=math.nan)),
                     "initialised": _run(cfg, ctx, ds, contextlib.nullcontext)}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folders = {}
    for name, (preset, _, _, extra, _) in CASES.items():
        source = load_config(preset, [*extra, "train.seed=11"])       # another seed: no read tensor equals its init
        folders[name] = str(write_release(build_model(source, {}, ParallelContext.single()), source,
                                          tmp_path_factory.mktemp(name)))
    return run_ranks(_rank, 2, folders)


@pytest.mark.parametrize("case", CASES)
def test_skipped_init_builds_and_trains_as_the_initialised_one(results, case):
    for rank, out in enumerate(results):
        got, want = out[case]["skipped"], out[case]["initialised"]
        for when in ("built", "trained"):
            assert got[when].keys() == want[when].keys()
            for name, t in got[when].items():
                same = t.dtype == want[when][name].dtype and torch.equal(t, want[when][name])
                assert bool(t.float().isfinite().all()) and same, f"rank {rank} {when}: {name}"
        assert got["losses"] == want["losses"], f"rank {rank}"


