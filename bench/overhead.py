"""Step time of the toolkit's DiT at tp=pp=1 against the same network written with plain nn.Linear,
and tokens/s of the training layouts, measured side by side in one run.

    python bench/overhead.py [--steps 30] [--layouts] [--out bench/out/overhead.json]

Overhead: both models start from the same weights, train in one process under the same DeepSpeed
engine (ZeRO-0, fp32), and alternate in blocks of steps so machine noise hits both alike; the ratio of
median step times is reported (goal <= 1.05). Layouts: `train.py` under `deepspeed --num_gpus N` for
each (tp, pp, dp) in fp32 (ZeRO-0; CPUs without bf16 units run bf16 far slower); median step time and
tokens/s from its metrics.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from parallel.distributed.layers import ColumnParallelLinear, RowParallelLinear

MID = ["model.name=mid", "model.hidden_size=256", "model.num_heads=8", "model.head_dim=32",
       "model.time_embed_dim=128", "model.text_embed_dim=128", "model.max_text_len=16",
       "data.height=128", "data.width=128", "train.micro_batch_size=2", "train.grad_accum_steps=1"]
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1)]


def to_plain_linear(module: nn.Module) -> nn.Module:
    """Replace every tensor-parallel layer (tp = 1) by an nn.Linear holding the same weights."""
    for name, child in module.named_children():
        if isinstance(child, (ColumnParallelLinear, RowParallelLinear)):
            plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
            with torch.no_grad():
                plain.weight.copy_(child.weight)
                if child.bias is not None:
                    plain.bias.copy_(child.bias)
            setattr(module, name, plain)
        else:
            to_plain_linear(child)
    return module


def build_engines(cfg, variants: dict) -> dict:
    """One DeepSpeed engine per variant {name: (ds, plain_linear)}, all from the same initial weights,
    set up by train.py's build_trainer (plain_linear: on the model with its layers made nn.Linear), in one
    process whose torch.distributed is initialised (the context is DeepSpeed's mpu: it needs groups)."""
    from parallel.model.build import build_model
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.engine import build_trainer

    ctx, engines = ParallelContext.build(ParallelDims()), {}
    for name, (ds, plain) in variants.items():
        seed_all(cfg.train.seed)
        model = to_plain_linear(build_model(cfg, ds, ctx)) if plain else None
        engines[name] = build_trainer(cfg, ds, ctx, model=model).engine
    return engines


def measure_overhead(steps: int) -> dict:
    import deepspeed

    from parallel.train.data import DiffusionBatches
    from models.diffusion import Objective
    from parallel.experiment.config import load_config
    from parallel.train.run import build_dataset, export_launch_env
    from parallel.distributed.topology import read_launch_env

    export_launch_env(read_launch_env())
    from parallel.distributed import accelerator
    deepspeed.init_distributed(dist_backend=accelerator.backend())
    cfg = load_config("debug", MID)
    ds = json.loads((ROOT / "ds_configs/zero0_fp32.json").read_text())
    ds.pop("activation_checkpointing")
    engines = build_engines(cfg, {"toolkit": (ds, False), "nn.Linear": (ds, True)})
    data = DiffusionBatches(build_dataset(cfg), Objective("v_prediction"), seed=0, micro_batch=2, grad_accum=1,
                            dp_rank=0, dp_size=1)
    batches = [next(data) for _ in range(4)]
    times = {k: [] for k in engines}
    for block in range(steps // 5 + 1):
        for kind, engine in engines.items():
            for i in range(5):
                inputs, target = batches[i % len(batches)]
                start = time.perf_counter()
                loss = engine(inputs, target)
                engine.backward(loss)
                engine.step()
                if block:          # the first block warms up both
                    times[kind].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"preset": "debug + mid overrides", "overrides": MID, "steps_each": len(times["toolkit"]),
            "median_step_s": med, "ratio_toolkit_over_nn_linear": med["toolkit"] / med["nn.Linear"]}


def measure_layouts(steps: int) -> list[dict]:
    rows = []
    for tp, pp, dp in LAYOUTS:
        with tempfile.TemporaryDirectory() as out:
            cmd = ["deepspeed", "--num_gpus", str(tp * pp * dp), str(ROOT / "train.py"), "--config", "debug",
                   "--deepspeed_config", str(ROOT / "ds_configs/zero0_fp32.json"), *sum((["--set", s] for s in MID), []),
                   "--set", f"parallel.tp_size={tp}", "--set", f"parallel.pp_size={pp}",
                   "--set", f"train.max_steps={steps}", "--set", f"train.output_dir={out}"]
            subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=dict(os.environ))
            records = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()][3:]
        med = statistics.median(r["step_time_s"] for r in records)
        rows.append({"tp": tp, "pp": pp, "dp": dp, "median_step_s": med,
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layouts", action="store_true", help="also time train.py for each layout")
    ap.add_argument("--out", default=str(ROOT / "bench/out/overhead.json"))
    args = ap.parse_args()
    result = {"overhead": measure_overhead(args.steps)}
    if args.layouts:
        result["layouts"] = measure_layouts(args.steps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    o = result["overhead"]
    print(f"step time, toolkit / nn.Linear at tp=pp=1: {o['median_step_s']['toolkit'] * 1e3:.1f} ms / "
          f"{o['median_step_s']['nn.Linear'] * 1e3:.1f} ms = {o['ratio_toolkit_over_nn_linear']:.3f}")
    for r in result.get("layouts", []):
        print(f"tp={r['tp']} pp={r['pp']} dp={r['dp']}: {r['median_step_s'] * 1e3:.0f} ms/step, "
              f"{r['tokens_per_s']:.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
