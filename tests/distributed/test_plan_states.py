"""The memory planner's model-state lines against the bytes DeepSpeed's optimizers hold on each of 2 gloo
ranks (split from tests/unit/test_plan.py, which has the activations, the estimators and the CLI reports)."""
from __future__ import annotations

import json

import pytest
import torch

from parallel.experiment.config import load_config
from parallel.train.probe import storage_key
from parallel.plan.memory import plan_memory
from parallel.plan.trace import ActivationTracer
from tests.dist_utils import run_ranks
from tests.helpers.plan import B, GiB, STATES, saved_bytes


# (name, ds_configs file, (tp, pp, dp), DeepSpeed's optimizer class, config overrides): ZeRO 0-3 at
# dp = 2, EmaAdamW, tensor parallelism (ZeRO-0 fp32), a two-stage pipeline (BF16_Optimizer), and a
# mid-size model (9.7M parameters: matrices above ZeRO-3's persistence threshold, vectors below), and
# sequence parallelism (sp = 2: half the tokens per rank, ZeRO shards over the sp ranks), and 3D RoPE (the
# 4 blocks share one table: the buffers line counts it once), and Wan 2.2 A14B's two experts (also in a two-stage
# pipeline, whose blocks are the experts' pairs: checkpointed as any block), all with 2 ranks. tp = 2 x pp = 2 runs
# under train.py in tests/cli/test_resume_cli.py.
MID = ["model.hidden_size=384", "model.num_heads=6", "model.head_dim=64", "model.time_embed_dim=128",
       "model.text_embed_dim=128"]
CASES = [("zero0", "zero0_fp32", (1, 1, 2), "AdamW", []), ("zero1", "zero1_bf16", (1, 1, 2), "BF16_Optimizer", []),
         ("zero2", "zero2_bf16", (1, 1, 2), "DeepSpeedZeroOptimizer", []),
         ("zero3", "zero3_bf16", (1, 1, 2), "DeepSpeedZeroOptimizer_Stage3", []),
         ("zero3 persistent", "zero3_bf16", (1, 1, 2), "DeepSpeedZeroOptimizer_Stage3", []),
         ("zero2 ema", "zero2_bf16_ema", (1, 1, 2), "DeepSpeedZeroOptimizer", []),
         ("tp2 zero0", "zero0_fp32", (2, 1, 1), "AdamW", []),
         ("pp2 zero1", "zero1_bf16", (1, 2, 1), "BF16_Optimizer", []),
         ("mid zero1", "zero1_bf16", (1, 1, 2), "BF16_Optimizer", MID),
         ("mid zero3", "zero3_bf16", (1, 1, 2), "DeepSpeedZeroOptimizer_Stage3", MID),
         ("sp2 zero1", "zero1_bf16", (1, 1, 1), "BF16_Optimizer", ["parallel.sp_size=2"]),
         ("sp2 zero2", "zero2_bf16", (1, 1, 1), "DeepSpeedZeroOptimizer", ["parallel.sp_size=2"]),
         ("rope zero1", "zero1_bf16", (1, 1, 2), "BF16_Optimizer", ["model.pos_embed=rope3d"]),
         ("wan22 zero2", "zero2_bf16", (1, 1, 2), "DeepSpeedZeroOptimizer", []),
         ("wan22 pp2 zero1", "zero1_bf16", (1, 2, 1), "BF16_Optimizer", [])]
# Wan 2.2 A14B with both experts (each rank holds both; the optimizer's groups are per expert)
PRESETS = {"wan22 zero2": "debug-wan22", "wan22 pp2 zero1": "debug-wan22"}


def ds_case(name: str, file: str) -> dict:
    ds = json.load(open(f"ds_configs/{file}.json"))
    if name == "zero3":     # below the default 1e5 every debug parameter stays whole on every rank
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 1000
    return ds


def _states_rank(rank, world_size):
    import os
    import sys
    # DeepSpeed loads its shared-memory comm op (JIT) at init; with another ninja first on PATH it
    # rebuilds it (30-60 s). scripts/test.sh puts the venv first; do the same when run without it.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    from parallel.train.engine import build_trainer
    from parallel.train.probe import StepProbe
    from parallel.train.run import training_batches
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from tests.train_utils import experiment

    import deepspeed.comm

    # The engine's buffered gradient all-reduce flattens a bucket (a copy when it holds several tensors)
    # and may convert it to the communication dtype (another copy) before deepspeed.comm.all_reduce:
    # record the bytes of those copies for each all-reduce.
    out, contexts, reduced, flat = {}, {}, [], {"tensor": None, "copy": 0}
    all_reduce = deepspeed.comm.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        converted = flat["tensor"] is None or storage_key(tensor) != storage_key(flat["tensor"])
        reduced.append(flat["copy"] + (tensor.numel() * tensor.element_size() if converted else 0))
        flat.update(tensor=None, copy=0)
        return all_reduce(tensor, *args, **kwargs)

    def recording_flatten(flatten):
        def run(tensors):
            result = flatten(tensors)
            copied = len(tensors) > 1 or storage_key(result) != storage_key(tensors[0])
            flat.update(tensor=result, copy=result.numel() * result.element_size() if copied else 0)
            return result
        return run

    deepspeed.comm.all_reduce = recording_all_reduce
    for name, file, (tp, pp, dp), _, extra in CASES:
        cfg = experiment(tp, pp, dp, extra, 1, PRESETS.get(name, "debug"))
        sp = cfg.parallel.sp_size
        if (tp, pp, dp, sp) not in contexts:
            contexts[(tp, pp, dp, sp)] = ParallelContext.build(ParallelDims(tp_size=tp, sp_size=sp, pp_size=pp, dp_size=dp))
        ctx = contexts[(tp, pp, dp, sp)]
        seed_all(cfg.train.seed)
        trainer = build_trainer(cfg, ds_case(name, file), ctx)
        trainer.engine.flatten = recording_flatten(trainer.engine.flatten)
        batches = training_batches(cfg, ctx)
        trainer.train_step(batches)
        reduced.clear()
        with StepProbe(trainer.engine) as probe:    # the second step: Adam moments exist (created lazily)
            trainer.train_step(batches)
        m = probe.result
        out[name] = {"kinds": {"states": m.states, "buckets": m.buckets, "buffers": m.buffers},
                     "activations": m.activations, "optimizer": type(trainer.engine.optimizer).__name__,
                     "stage": ctx.pp_rank, "largest_all_reduce": max(reduced, default=0)}
    # A real tp = 2 block (its collectives run): what its forward saves, for the tp trace below.
    from parallel.model.build import layer_specs
    tp_ctx = contexts[(2, 1, 1, 1)]
    block = layer_specs(experiment(2, 1, 1), tp_ctx)[1].build()
    x = torch.randn(B, 56, 64, requires_grad=True)
    temb = torch.randn(B, 32, requires_grad=True)
    out["tp2 block"], _ = saved_bytes(lambda: block((x, temb))[0], block)
    return out


def test_model_states_match_deepspeed_on_each_rank():
    """Parameters + gradients + Adam moments + master weights (+ EMA shadow) within 1% of the bytes
    DeepSpeed holds at its peak (the optimizer steps of the second step) on each rank, for the worst
    rank of each pipeline stage; ZeRO-3's reduce bucket and the cached position table exactly; the
    activations each micro-batch's forward saved in that real step within 5%."""
    from parallel.plan.memory import EngineSettings
    from tests.train_utils import experiment
    results = run_ranks(_states_rank, 2)
    for name, file, (tp, pp, dp), optimizer, extra in CASES:
        cfg, ds = experiment(tp, pp, dp, extra, 1, PRESETS.get(name, "debug")), ds_case(name, file)
        plan = plan_memory(cfg, ds, dp, 80 * GiB, ActivationTracer(cfg, EngineSettings.from_ds(ds, 1).dtype))
        assert plan.optimizer_path.endswith(optimizer) and [r[name]["optimizer"] for r in results] == [optimizer] * 2
        for stage in plan.stages:
            ranks = [r[name] for r in results if r[name]["stage"] == stage.stage]
            predicted = sum(stage.lines[k] for k in STATES)
            measured = [r["kinds"]["states"] for r in ranks]
            acts = [a for r in ranks for a in r["activations"]]
            per_micro_batch = stage.lines["activations"] // stage.in_flight
            print(f"{name} ({optimizer}) stage {stage.stage}: states predicted {predicted:,} B, measured per rank "
                  f"{measured} ({max(measured) / predicted - 1:+.2%}); activations per micro-batch predicted "
                  f"{per_micro_batch:,} B, measured {sorted(set(acts))} ({max(acts) / per_micro_batch - 1:+.2%})")
            assert max(measured) == pytest.approx(predicted, rel=0.01), name
            assert len(acts) == 2 * len(ranks)
            if "sp2" in name:   # the first block's view of the whole sequence counted (tests/cli/test_family_matrix.py
                # at tp 2 x sp 2: +2.5%); here, bf16 at tp 1, something else is over-counted: an upper bound
                assert 0.94 * per_micro_batch <= max(acts) <= per_micro_batch, name
            else:
                assert max(acts) == pytest.approx(per_micro_batch, rel=0.05), name
            assert [r["kinds"].get("buffers", 0) for r in ranks] == [stage.lines["buffers"]] * len(ranks)
            assert (stage.lines["ema_shadow"] > 0) == ("ema" in name)
            if file == "zero3_bf16":
                assert [r["kinds"]["buckets"] for r in ranks] == [stage.lines["zero_buckets"]] * len(ranks)
            if optimizer in ("AdamW", "BF16_Optimizer"):     # the engine's buffered all-reduce: its copies
                assert [r["largest_all_reduce"] for r in ranks] == [stage.lines["zero_buckets"]] * len(ranks), name
    # The tracer builds and runs at tp = 2 with no group (shapes only): same saved bytes as the real one.
    trace = ActivationTracer(load_config("debug"), torch.float32).trace("block", 2, B)
    assert [r["tp2 block"] for r in results] == [trace.activations + trace.side_saved_bytes] * 2
