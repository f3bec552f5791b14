"""LoRA training in every layout equals one process, with the base frozen; the planner counts a LoRA run.

One reference spawn (one process, which also stops after step 2, checkpoints and resumes) and one spawn of 4 gloo ranks that trains, one after the other,
tp 2 x pp 2 (ZeRO-0, fp32) and sp 2 x dp 2 (ZeRO-2, fp32): 3 steps of the `debug` DiT with adapters of rank
4 on q, k, v and the attention output. Checked: the per-step losses on every rank and the final adapters
(and base) equal the one-process run (tests/train_utils.assert_matches); the base tensors are bit for bit
what they were before training; the optimizer state holds adapters only (ZeRO-0: its parameters are the
adapters; ZeRO-2: its moments are the adapters' partition); the planner's parameter + gradient + optimizer
bytes equal what the engine holds in step 2 (parallel.plan.probe), within 1%, on each rank.
"""
from __future__ import annotations

import pytest
import torch

from parallel.plan.memory import EngineSettings, plan_memory
from parallel.plan.trace import ActivationTracer
from tests.dist_utils import run_ranks
from tests.train_utils import assert_matches, experiment, fp32_config
from tests.unit.test_plan import STATES

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]
STEPS = 3
# (name, tp, pp, dp, sp, ZeRO stage)
CASES = [("tp2 x pp2 zero0", 2, 2, 1, 1, 0), ("sp2 x dp2 zero2", 1, 1, 2, 2, 2)]


def _train(cfg, ds, ctx):
    from parallel.dist.seed import seed_all
    from parallel.lora import is_adapter
    from parallel.plan.probe import StepProbe
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches
    from parallel.weights.gather import full_state
    from parallel.dist.replicas import replica_mismatches

    seed_all(cfg.train.seed)
    trainer = build_trainer(cfg, ds, ctx)
    module, n = trainer.engine.module, cfg.model.num_layers
    before = {k: v for k, v in full_state(module, ctx, n).items() if not is_adapter(k)}
    batches, losses, probe = training_batches(cfg, ctx), [], None
    for step in range(1, STEPS + 1):
        if step == 2:
            with StepProbe(trainer.engine) as measuring:
                losses.append(trainer.train_step(batches).loss)
            probe = measuring.result
        else:
            losses.append(trainer.train_step(batches).loss)
    names = {id(p): name for name, p in module.named_parameters()}
    stepped = [names.get(id(p), "<flat partition>") for g in trainer.optimizer.param_groups for p in g["params"]]
    moments = sum(s["exp_avg"].numel() for s in trainer.optimizer.state.values())
    adapters = sum(p.numel() for name, p in module.named_parameters() if is_adapter(name))
    return {"losses": losses, "state": full_state(module, ctx, n), "before": before, "probe": probe.states,
            "stage": ctx.pp_rank, "stepped": stepped, "moments": moments, "adapters": adapters,
            "trainable": sorted(name for name, p in module.named_parameters() if p.requires_grad),
            "replica_mismatches": replica_mismatches(module, ctx)}


def _rank(rank, world_size, cases):
    from parallel.dist.topology import ParallelContext, ParallelDims
    out = {}
    for name, tp, pp, dp, sp, stage in cases:
        cfg = experiment(tp, pp, dp, LORA, sp)
        ctx = ParallelContext.build(ParallelDims(tp_size=tp, sp_size=sp, pp_size=pp, dp_size=dp))
        out[name] = _train(cfg, fp32_config(stage), ctx)
    return out


def _reference_rank(rank, world_size, directory):
    """The one-process run, and the same run stopped after step 2, saved, and resumed into a model built
    from another seed (base and adapters): the checkpoint restores both."""
    from parallel.dist.seed import seed_all
    from parallel.dist.topology import ParallelContext, ParallelDims
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches
    out = _rank(rank, world_size, [("one", 1, 1, 1, 1, 0)])
    cfg, ds = experiment(1, 1, 1, LORA), fp32_config(0)
    ctx = ParallelContext.build(ParallelDims(tp_size=1, pp_size=1, dp_size=1))
    seed_all(cfg.train.seed)
    trainer = build_trainer(cfg, ds, ctx)
    batches = training_batches(cfg, ctx)
    losses = [trainer.train_step(batches).loss for _ in range(2)]
    trainer.save(directory, 2)
    other = experiment(1, 1, 1, LORA + ["train.seed=99"])
    resumed = build_trainer(other, ds, ctx)
    step = resumed.load(directory, "step2")
    losses.append(resumed.train_step(training_batches(cfg, ctx, start_step=step)).loss)
    out["resumed"] = losses
    return out


def _merged(results, name):
    state, before = {}, {}
    for r in results:
        state.update(r[name]["state"])
        before.update(r[name]["before"])
    return {"losses": results[0][name]["losses"], "all_losses": [r[name]["losses"] for r in results],
            "state": state, "before": before, "replica_mismatches": sorted({m for r in results
                                                                           for m in r[name]["replica_mismatches"]})}


def test_lora_layouts_match_one_process_with_a_frozen_base_and_the_planned_states(tmp_path):
    one = run_ranks(_reference_rank, 1, str(tmp_path))
    reference = _merged(one, "one")
    assert one[0]["resumed"] == reference["losses"]        # resumed from a checkpoint: the same steps, bit for bit
    results = run_ranks(_rank, 4, CASES)
    for name, tp, pp, dp, sp, stage in CASES:
        run = _merged(results, name)
        assert_matches(run, reference)
        for key, value in run["before"].items():          # the base, bit for bit
            assert torch.equal(run["state"][key], value), f"{name}: {key} changed"
        assert run["before"].keys() == {k for k in reference["state"] if ".lora_" not in k}
        cfg, ds = experiment(tp, pp, dp, LORA, sp), fp32_config(stage)
        plan = plan_memory(cfg, ds, dp, 80 * 2**30, ActivationTracer(cfg, EngineSettings.from_ds(ds, 1).dtype))
        for r in results:
            got = r[name]
            assert got["trainable"] and all(".lora_" in t for t in got["trainable"]), got["trainable"]
            if stage == 0:                                 # the optimizer steps the module's adapters
                assert sorted(got["stepped"]) == got["trainable"]
                assert got["moments"] == got["adapters"]
            else:                                          # ZeRO-2: this rank's partition of them
                assert got["adapters"] / (dp * sp) <= got["moments"] <= got["adapters"] / (dp * sp) + 8
            predicted = sum(plan.stages[got["stage"]].lines[k] for k in STATES)
            print(f"{name} stage {got['stage']}: predicted {predicted:,} B, measured {got['probe']:,} B")
            assert got["probe"] == pytest.approx(predicted, rel=0.01), name
