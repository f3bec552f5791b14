"""Run a few training steps of a tiny preset (`debug`, `debug-stdit`) in spawned gloo ranks and collect
comparable numbers."""
from __future__ import annotations

import copy
import json
from typing import NamedTuple, Optional

import torch

from parallel.experiment.config import load_config
from tests.adam_bound import add_step_slack
from tests.dist_utils import spawn_all

ZERO0_FP32 = json.load(open("ds_configs/zero0_fp32.json"))
GLOBAL_BATCH = 4


def fp32_config(stage: int = 0, checkpointing: bool = True, optimizer: str = "AdamW",
                eps: Optional[float] = None) -> dict:
    """ds_configs/zero0_fp32.json at ZeRO `stage`; `eps`: Adam's, where the layouts' gradient round-off would move
    weights near eps past fp32 tolerance (1e-6: tests/helpers/sequence_parallel.py's sp_config says why)."""
    ds = copy.deepcopy(ZERO0_FP32)
    ds["zero_optimization"] = {"stage": stage}
    ds["optimizer"]["type"] = optimizer
    if eps is not None:
        ds["optimizer"]["params"]["eps"] = eps
    if not checkpointing:
        ds.pop("activation_checkpointing")
    return ds


def experiment_overrides(tp: int, pp: int, dp: int, extra=(), sp: int = 1) -> list[str]:
    """A fixed global batch of 4 (micro-batch x 2 micro-steps x dp), so every layout sees the same data."""
    mb = GLOBAL_BATCH // (2 * dp)
    return [f"parallel.tp_size={tp}", f"parallel.pp_size={pp}", f"parallel.sp_size={sp}", f"train.micro_batch_size={mb}",
            "train.grad_accum_steps=2", "train.warmup_steps=0", *extra]


def experiment(tp: int, pp: int, dp: int, extra=(), sp: int = 1, preset: str = "debug"):
    """`preset` with experiment_overrides: every layout sees the same data."""
    return load_config(preset, experiment_overrides(tp, pp, dp, extra, sp))


def _train_rank(rank, world_size, tp, pp, dp, ds, steps, extra, sp, preset, probe_step, save_to: Optional[str] = None):
    """Train `steps` steps; the losses, the full weights (and EMA) this rank holds, any replica drift, and
    (probe_step > 0) what that step held, measured by parallel.train.probe.StepProbe. save_to: a checkpoint of
    the last step written there as train.py writes one (what parallel.export, sample and verify read)."""
    import contextlib

    import deepspeed

    from parallel.train.probe import StepProbe
    from parallel.weights.ema import full_ema, has_ema
    from parallel.train.engine import build_trainer
    from parallel.weights.gather import full_state
    from parallel.distributed.replicas import replica_mismatches
    from parallel.train.run import training_batches
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims

    from parallel.experiment.splits import ring_size
    cfg = experiment(tp, pp, dp, extra, sp, preset)
    ctx = ParallelContext.build(ParallelDims(tp_size=tp, sp_size=sp, pp_size=pp, dp_size=dp, ring_size=ring_size(cfg)))
    seed_all(cfg.train.seed)
    trainer = build_trainer(cfg, ds, ctx)
    batches = training_batches(cfg, ctx)
    losses, probe, slack = [], None, {}
    for step in range(1, steps + 1):
        lr = trainer.engine.get_lr()[0]
        with StepProbe(trainer.engine) if step == probe_step else contextlib.nullcontext() as measuring:
            losses.append(trainer.train_step(batches).loss)
        probe = measuring.result if measuring else probe
        if world_size == 1:                           # a reference: what Adam may make of round-off
            add_step_slack(slack, trainer, ctx, cfg.model.num_layers, lr)
    if save_to:
        from parallel.checkpoints import checkpoint
        layout = {**ctx.dims.as_dict(), "zero_stage": ds.get("zero_optimization", {}).get("stage", 0),
                  "global_batch": GLOBAL_BATCH}                       # Trainer's ckpt_layout
        checkpoint.save(trainer, save_to, steps, 1, layout, checkpoint.model_signature(cfg.model))
    module = trainer.engine.module
    if ds.get("zero_optimization", {}).get("stage", 0) == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            state = full_state(module, ctx, cfg.model.num_layers)
    else:
        state = full_state(module, ctx, cfg.model.num_layers)
    ema = full_state(module, ctx, cfg.model.num_layers, full_ema(trainer.optimizer, trainer.engine.optimizer)) \
        if has_ema(trainer.optimizer) else {}
    return {"losses": losses, "state": state, "ema": ema, "replica_mismatches": replica_mismatches(module, ctx),
            "probe": probe, "slack": slack}


class Run(NamedTuple):
    """One `train` run: the layout, the DeepSpeed dict, and what `_train_rank` takes besides."""
    tp: int
    pp: int
    dp: int
    ds: dict
    steps: int = 3
    extra: tuple = ()
    sp: int = 1
    preset: str = "debug"
    probe_step: int = 0

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.sp


def train_all(runs: dict, calls: Optional[dict] = None) -> dict:
    """`train` of every Run in `runs` (name -> Run), and any more `calls` (name -> (world size, rank function,
    args): tests.dist_utils.spawn_all's), in one spawn per world size: its ranks train the runs in turn, each in its
    own process groups and engine. name -> train's result for a run, the ranks' results for a call."""
    assert not set(runs) & set(calls or {}), set(runs) & set(calls)
    spawned = spawn_all({**{name: (run.world_size, _train_rank, run._replace(extra=tuple(run.extra)))
                            for name, run in runs.items()}, **(calls or {})})
    return {name: _merged(results) if name in runs else results for name, results in spawned.items()}


def train(tp: int, pp: int, dp: int, ds: dict, steps: int = 3, extra=(), sp: int = 1, preset: str = "debug",
          probe_step: int = 0):
    """Per-step losses (rank 0's), the merged full fp32 weights (and EMA) of all ranks, any replica drift, and
    each rank's StepMeasurement of step `probe_step` (1-based; none when 0)."""
    return train_all({"run": Run(tp, pp, dp, ds, steps, extra, sp, preset, probe_step)})["run"]


def _merged(results: list[dict]) -> dict:
    """One run of `_train_rank` from its ranks' results: merge_ranks', with the EMA, the slack and the probes."""
    ema: dict[str, torch.Tensor] = {}
    for r in results:
        ema.update(r["ema"])
    return {**merge_ranks(results), "ema": ema, "slack": results[0]["slack"], "probes": [r["probe"] for r in results]}


def merge_ranks(rows: list[dict]) -> dict:
    """One run from the ranks' `_train_rank` results, as `assert_matches` takes it: rank 0's losses, every rank's,
    the full weights all ranks hold together and the replica drift any rank saw."""
    state: dict[str, torch.Tensor] = {}
    for r in rows:
        state.update(r["state"])
    return {"losses": rows[0]["losses"], "all_losses": [r["losses"] for r in rows], "state": state,
            "replica_mismatches": sorted({n for r in rows for n in r["replica_mismatches"]})}


def assert_weights_match(state: dict, reference: dict, label: str = "") -> None:
    """`state`'s weights against the one-process `reference`'s: per element within fp32 tolerance (assert_close's
    1e-5 + 1.3e-6 |w|) plus the reference's `slack` (a one-process run of `_train_rank` records it), the most
    Adam can make of the gradients' fp32 round-off over the steps (tests/adam_bound.py): far under 1e-5 for
    all but the elements whose gradient cancels to near zero. Without a recorded slack: fp32 tolerance."""
    slack = reference.get("slack") or {}
    assert state.keys() == reference["state"].keys()
    for name, want in reference["state"].items():
        got = state[name]
        assert got.shape == want.shape and got.dtype == want.dtype, (label, name, got.shape, want.shape)
        bound = 1e-5 + 1.3e-6 * want.abs() + slack.get(name, 0)
        off = (got - want).abs() > bound
        if off.any() or not torch.isfinite(got).all():
            i = int(((got - want).abs() - bound).flatten().argmax())
            raise AssertionError(f"{label}{name}: {int(off.sum())} / {off.numel()} elements off; the worst, flat "
                                 f"index {i}: {got.flatten()[i].item():.8e} vs {want.flatten()[i].item():.8e}, "
                                 f"allowed {bound.flatten()[i].item():.3e} (Adam's round-off slack "
                                 f"{(bound.flatten()[i] - 1e-5 - 1.3e-6 * want.flatten()[i].abs()).item():.3e})")


def assert_matches(run: dict, reference: dict) -> None:
    """Per-step losses on every rank, final weights and replica drift of `run` against the one-process
    `reference`: the losses at fp32 tolerance (compared as fp32, not float64's), the weights at fp32 tolerance
    plus Adam's bound on what the gradients' round-off makes of near-zero gradients (assert_weights_match)."""
    assert len(set(reference["losses"])) == len(reference["losses"]), "the reference does not train"
    expected = torch.tensor(reference["losses"], dtype=torch.float32)
    for rank_losses in run["all_losses"]:
        torch.testing.assert_close(torch.tensor(rank_losses, dtype=torch.float32), expected)
    assert_weights_match(run["state"], reference)
    assert run["replica_mismatches"] == []
