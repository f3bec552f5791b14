"""The fp8 frozen base (model.lora.base_dtype: float8_e4m3fn) against the bf16 base, in loss.

    python -m bench.lora_fp8 [--steps 200]          # from the repository root

configs/debug.yaml with rank-8 adapters on q, k, v and the attention output, trained twice for `steps` steps in
one process under ds_configs/zero1_bf16.json (the base in bf16, or in fp8 with a scale a tensor and computed
in bf16), from the same weights, adapters and batches. Prints both loss curves' mean absolute per-step
difference and the final losses (the mean of the last tenth) side by side.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LORA = ["model.lora.rank=8"]
RUNS = {"bf16 base": LORA, "fp8 base": [*LORA, "model.lora.base_dtype=float8_e4m3fn"]}


def _curves(rank: int, world_size: int, steps: int) -> dict:
    from parallel.experiment.config import load_config
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches

    ds = json.loads((ROOT / "ds_configs/zero1_bf16.json").read_text())
    ctx, losses = ParallelContext.build(ParallelDims()), {}
    for name, extra in RUNS.items():
        cfg = load_config("debug", [f"train.max_steps={steps}", *extra])
        seed_all(cfg.train.seed)
        trainer = build_trainer(cfg, ds, ctx)
        batches = training_batches(cfg, ctx)
        losses[name] = [trainer.train_step(batches).loss for _ in range(steps)]
    return losses


def measure(steps: int = 200) -> dict:
    from bench.ranks import run_ranks
    losses = run_ranks(_curves, 1, steps)[0]
    bf16, fp8 = losses["bf16 base"], losses["fp8 base"]
    tail = max(1, steps // 10)
    return {"steps": steps, "losses": losses, "mean_abs_diff": statistics.mean(abs(a - b) for a, b in zip(bf16, fp8)),
            "final_loss": {k: statistics.mean(v[-tail:]) for k, v in losses.items()}}


def report(r: dict) -> str:
    f = r["final_loss"]
    return (f"configs/debug.yaml, rank-8 LoRA, ZeRO-1 bf16, {r['steps']} steps, one process:\n"
            f"  mean |loss(fp8 base) - loss(bf16 base)| per step: {r['mean_abs_diff']:.2e}\n"
            f"  final loss (mean of the last {max(1, r['steps'] // 10)} steps): bf16 base {f['bf16 base']:.5f}   "
            f"fp8 base {f['fp8 base']:.5f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.lora_fp8", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    print(report(measure(ap.parse_args().steps)))
