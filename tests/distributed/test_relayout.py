"""Resume on another layout: 3 steps at one (tp, sp, pp, dp, ZeRO) layout, a checkpoint, then 3 more at another,
against the 6 steps of the uninterrupted run at the first layout: the losses, the learning rates, the final
weights and the EMA (FusedEmaAdam) match at fp32 tolerances.

The uninterrupted run is the one that wrote the checkpoint after its step 3 (saving reads the state and
changes nothing, so its steps 4-6 are what an uninterrupted run trains). One 4-rank spawn runs the four
original layouts and the three 4-rank continuations (one into ZeRO-3, whose fresh engine has no optimizer state
to set: parallel/distributed/deepspeed/optimizer.py stepped_params); the (tp 2) continuation, 2 ranks, has a spawn of its own.
"""
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.train_utils import fp32_config

DP4 = ("train.micro_batch_size=1", "train.grad_accum_steps=1")    # global batch 4 with 4 data ranks
SCHEDULE = ("train.warmup_steps=2", "train.max_steps=6")          # the lr moves at every step


def _build(layout, tmp):
    from parallel.experiment.config import load_config
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches

    tp, sp, pp, dp, stage, extra = layout
    mb = 4 // (2 * dp) if dp < 4 else 1
    cfg = load_config("debug", [f"parallel.tp_size={tp}", f"parallel.pp_size={pp}", f"parallel.sp_size={sp}",
                                f"train.micro_batch_size={mb}", "train.grad_accum_steps=2", *SCHEDULE, *extra,
                                f"ckpt.dir={tmp}"])
    ctx = ParallelContext.build(ParallelDims(tp_size=tp, sp_size=sp, pp_size=pp, dp_size=dp))
    seed_all(cfg.train.seed)
    trainer = build_trainer(cfg, fp32_config(stage, checkpointing=False, optimizer="FusedEmaAdam"), ctx)
    return cfg, ctx, trainer, training_batches


def _train(layout, tmp, steps, save_at=None, resume=None):
    """Train at `layout` (steps start..steps), saving after `save_at` or starting from checkpoint `resume`;
    (losses, lrs, full weights, full EMA) of this rank."""
    import deepspeed

    from parallel.checkpoints import checkpoint
    from parallel.weights.ema import full_ema
    from parallel.weights.gather import full_state

    cfg, ctx, trainer, training_batches = _build(layout, tmp)
    start = trainer.load(tmp, resume) if resume else 0
    batches = training_batches(cfg, ctx, start_step=start)
    losses, lrs = [], []
    for step in range(start, steps):
        result = trainer.train_step(batches)
        losses.append(result.loss)
        lrs.append(result.lr)
        if step + 1 == save_at:
            checkpoint.save(trainer, Path(tmp), step + 1, keep=1, layout=trainer.layout())
    module, n = trainer.engine.module, cfg.model.num_layers
    zero3 = trainer.engine.zero_optimization_stage() == 3
    with deepspeed.zero.GatheredParameters(list(module.parameters())) if zero3 else torch.no_grad():
        state = full_state(module, ctx, n)
    ema = full_state(module, ctx, n, full_ema(trainer.optimizer, trainer.engine.optimizer))
    return {"losses": losses, "lrs": lrs, "state": state, "ema": ema, "start": start}


#          (tp, sp, pp, dp, ZeRO, overrides)
CASES = {"tp2-pp2-zero1_to_dp4-zero2": ((2, 1, 2, 1, 1, ()), (1, 1, 1, 4, 2, DP4)),
         "dp4-zero3_to_tp2-sp2-zero1": ((1, 1, 1, 4, 3, DP4), (2, 2, 1, 1, 1, ())),
         "pp2-dp2-zero1_to_tp2-zero0": ((1, 1, 2, 2, 1, ()), (2, 1, 1, 1, 0, ())),
         # into ZeRO-3, whose client optimizer holds its partitions only while stepping them
         "tp2-sp2-zero0_to_dp4-zero3": ((2, 2, 1, 1, 0, ()), (1, 1, 1, 4, 3, DP4))}


def _four_ranks(rank, world_size, root):
    out = {}
    for name, (before, after) in CASES.items():
        tmp = f"{root}/{name}"
        out[name] = {"reference": _train(before, tmp, 6, save_at=3)}
        if after[0] * after[1] * after[2] * after[3] == world_size:
            out[name]["resumed"] = _train(after, tmp, 6, resume="step3")
    return out


def _two_ranks(rank, world_size, root):
    name = "pp2-dp2-zero1_to_tp2-zero0"
    return {name: {"resumed": _train(CASES[name][1], f"{root}/{name}", 6, resume="step3")}}


def _merge(results):
    merged = {}
    for r in results:
        for name, runs in r.items():
            for kind, run in runs.items():
                m = merged.setdefault(name, {}).setdefault(kind, {"all_losses": [], "state": {}, "ema": {}})
                m["all_losses"].append(run["losses"])
                m["lrs"], m["start"] = run["lrs"], run["start"]
                m["state"].update(run["state"])
                m["ema"].update(run["ema"])
    return merged


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("relayout")
    merged = _merge(run_ranks(_four_ranks, 4, str(root), timeout=300))
    for name, runs in _merge(run_ranks(_two_ranks, 2, str(root), timeout=200)).items():
        merged[name].update(runs)
    return merged


@pytest.mark.parametrize("name", list(CASES))
def test_resumed_on_another_layout_continues_the_uninterrupted_run(runs, name):
    reference, resumed = runs[name]["reference"], runs[name]["resumed"]
    assert resumed["start"] == 3
    expected = torch.tensor(reference["all_losses"][0][3:], dtype=torch.float32)
    assert len(set(expected.tolist())) == 3, "the reference does not train"
    for losses in resumed["all_losses"]:
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float32), expected)
    assert resumed["lrs"] == pytest.approx(reference["lrs"][3:], rel=1e-12)
    assert len(set(reference["lrs"][3:])) == 3, "the learning rate does not move"
    assert resumed["state"].keys() == reference["state"].keys() == resumed["ema"].keys()
    for kind in ("state", "ema"):
        for key, value in reference[kind].items():
            torch.testing.assert_close(resumed[kind][key], value, msg=lambda m: f"{kind} {key}: {m}")
