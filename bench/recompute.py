"""Selective recomputation and activation compression (parallel/model/recompute.py), measured against the planner.

    python -m bench --only recompute [--steps 20]      # or: python bench/recompute.py

Options: each `train.recompute` granularity (block, attention core, MLP, every 2nd block) and each
`train.activation_compression` dtype (bf16, fp8), against no recomputation, one DeepSpeed engine each
(ZeRO-0 fp32, the mid-size debug model of bench/overhead.py), alternating in blocks of 5 steps. For each:
median step time, the bytes saved for backward in one micro-batch's forward (StepProbe, plus what the
compression hooks stored), the planner's prediction of those bytes (parallel.plan.memory) and the share
of the blocks' forward FLOPs its step-time model charges for recomputation.
Compression curve: `configs/debug.yaml` trained for `curve_steps` steps in one process uncompressed, bf16
and fp8, from the same weights and batches: the loss curves and their largest difference.
"""
from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.overhead import MID

OPTIONS = {"none": [], "block": ["train.recompute.granularity=block"],
           "attention": ["train.recompute.granularity=attention"], "mlp": ["train.recompute.granularity=mlp"],
           "every 2nd block": ["train.recompute.granularity=block", "train.recompute.every=2"],
           "bf16 compression": ["train.activation_compression.dtype=bf16"],
           "fp8 compression": ["train.activation_compression.dtype=fp8"]}


def _ds() -> dict:
    ds = json.loads((ROOT / "ds_configs/zero0_fp32.json").read_text())
    ds.pop("activation_checkpointing")          # train.recompute replaces it (the checker refuses both)
    return ds


def _trainer(cfg, ds, ctx, stored: dict, recording: dict):
    """build_trainer on a model whose compression hooks report what they store into `stored` while
    recording["on"]."""
    from parallel.model.build import build_model
    from parallel.distributed.seed import seed_all
    from parallel.model.recompute import apply_recompute
    from parallel.train.engine import build_trainer

    seed_all(cfg.train.seed)
    bare = cfg.model_copy(update={"train": cfg.train.model_copy(update={"recompute": None,
                                                                         "activation_compression": None})})
    model = build_model(bare, ds, ctx)

    def on_pack(t, p):                          # t kept alive so that no other storage reuses its address
        if recording.get("on") and not isinstance(p, torch.Tensor):
            stored.setdefault(t.untyped_storage()._cdata, (t, p[0].untyped_storage().nbytes() + 4 * (p[1] is not None)))
    apply_recompute(model, cfg, on_pack)
    return build_trainer(cfg, ds, ctx, model=model)


def options(steps: int) -> dict:
    from parallel.experiment.config import load_config
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.plan.memory import EngineSettings, plan_memory
    from parallel.train.probe import StepProbe
    from parallel.plan.search import recompute_fraction
    from parallel.plan.trace import ActivationTracer
    from parallel.train.data import DiffusionBatches
    from parallel.train.run import build_dataset
    from models.diffusion import Objective
    from parallel.experiment.units import TiB

    ds, ctx = _ds(), ParallelContext.build(ParallelDims())
    tracer = ActivationTracer(load_config("debug", MID), torch.float32)
    cfgs = {name: load_config("debug", [*MID, *extra]) for name, extra in OPTIONS.items()}
    stored, recording = {name: {} for name in cfgs}, {name: {} for name in cfgs}
    engines = {name: _trainer(cfg, ds, ctx, stored[name], recording[name]).engine for name, cfg in cfgs.items()}
    cfg = cfgs["none"]
    data = DiffusionBatches(build_dataset(cfg), Objective(cfg.model.objective), seed=0, micro_batch=2,
                            grad_accum=1, dp_rank=0, dp_size=1)
    batches = [next(data) for _ in range(5)]
    times, measured = {k: [] for k in engines}, {}
    for block in range(steps // 5 + 1):
        for name, engine in engines.items():
            for i in range(5):
                inputs, target = batches[i]
                probe = StepProbe(engine) if (block, i) == (0, 1) else None
                recording[name]["on"] = probe is not None
                tic = time.perf_counter()
                with probe if probe else contextlib.nullcontext():
                    loss = engine(inputs, target)
                    engine.backward(loss)
                    engine.step()
                if block:
                    times[name].append(time.perf_counter() - tic)
                if probe:
                    measured[name] = probe.result.activations[0] + sum(n for _, n in stored[name].values())
                    stored[name].clear()
    eng = EngineSettings.from_ds(ds, cfg.model.num_layers)
    rows = {}
    for name, c in cfgs.items():
        predicted = plan_memory(c, ds, 1, TiB, tracer).stages[0].lines["activations"]
        rows[name] = {"median_step_s": statistics.median(times[name]), "saved_bytes": measured[name],
                      "predicted_bytes": predicted, "recompute_fraction": recompute_fraction(c, eng, tracer)}
    return {"overrides": MID, "steps_each": len(times["none"]), "rows": rows}


def curves(curve_steps: int) -> dict:
    """configs/debug.yaml for `curve_steps` steps uncompressed, bf16 and fp8: per-step losses."""
    from parallel.experiment.config import load_config
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.run import training_batches

    ds, ctx, losses = _ds(), ParallelContext.build(ParallelDims()), {}
    for name, extra in (("none", []), ("bf16", ["train.activation_compression.dtype=bf16"]),
                        ("fp8", ["train.activation_compression.dtype=fp8"])):
        cfg = load_config("debug", [f"train.max_steps={curve_steps}", *extra])
        trainer = _trainer(cfg, ds, ctx, {}, {})
        batches = training_batches(cfg, ctx)
        losses[name] = [trainer.train_step(batches).loss for _ in range(curve_steps)]
    diff = {k: [abs(a - b) for a, b in zip(v, losses["none"])] for k, v in losses.items() if k != "none"}
    tail = max(1, curve_steps // 10)
    return {"steps": curve_steps, "losses": losses,
            "max_abs_diff": {k: max(v) for k, v in diff.items()},
            "final_loss": {k: statistics.mean(v[-tail:]) for k, v in losses.items()}}


def measure(steps: int = 20, curve_steps: int = 200) -> dict:
    import deepspeed

    from parallel.distributed.topology import read_launch_env
    from parallel.train.run import export_launch_env

    export_launch_env(read_launch_env())
    from parallel.distributed import accelerator
    deepspeed.init_distributed(dist_backend=accelerator.backend())
    return {"options": options(steps), "compression_curve": curves(curve_steps)}


def plot(r: dict, out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = r["compression_curve"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    colors = {"none": "black", "bf16": "tab:blue", "fp8": "tab:orange"}
    for name, losses in c["losses"].items():
        top.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1, color=colors[name])
    for name in ("bf16", "fp8"):
        bottom.plot(range(1, c["steps"] + 1), [a - b for a, b in zip(c["losses"][name], c["losses"]["none"])],
                    label=f"{name} - none", linewidth=1, color=colors[name])
    top.set(ylabel="training loss", title=f"activation compression, configs/debug.yaml, {c['steps']} steps")
    bottom.set(xlabel="step", ylabel="loss difference")
    top.legend()
    bottom.legend()
    fig.tight_layout()
    fig.savefig(out / "compression.png", dpi=100)
    plt.close(fig)
    return ["compression.png"]


def markdown(r: dict) -> list[str]:
    o, c = r["options"], r["compression_curve"]
    none = o["rows"]["none"]
    lines = ["", "## Selective recomputation and activation compression (bench/recompute.py)", "",
             f"`debug` with {' '.join(o['overrides'])}; fp32 ZeRO-0, one process, medians of {o['steps_each']} "
             f"steps; saved bytes of one micro-batch's forward (StepProbe + what compression stores) against "
             f"the planner's activation line; recompute: the share of the blocks' forward FLOPs the planner's "
             f"step-time model charges.", "",
             "| option | step time | vs none | saved bytes | vs none | planner predicts | predicted / measured "
             "| recompute |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in o["rows"].items():
        lines.append(f"| {name} | {row['median_step_s'] * 1e3:.1f} ms | {row['median_step_s'] / none['median_step_s']:.3f} "
                     f"| {row['saved_bytes']:,} B | {row['saved_bytes'] / none['saved_bytes']:.3f} | "
                     f"{row['predicted_bytes']:,} B | {row['predicted_bytes'] / row['saved_bytes']:.4f} | "
                     f"{row['recompute_fraction']:.3f} |")
    lines += ["", f"Compression over {c['steps']} steps of configs/debug.yaml (same weights and batches): largest "
              f"per-step loss difference to the uncompressed run "
              + ", ".join(f"{k} {v:.2e}" for k, v in c["max_abs_diff"].items())
              + "; mean loss of the last tenth: " + ", ".join(f"{k} {v:.5f}" for k, v in c["final_loss"].items())
              + ".", "", "![compression.png](compression.png)", ""]
    return lines


if __name__ == "__main__":
    result = measure()
    print("\n".join(markdown(result)))
