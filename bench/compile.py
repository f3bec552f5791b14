"""Compiled blocks (`train.compile`, parallel/distributed/compile.py) against eager, one process, fp32, ZeRO-0.

    python -m bench.compile [--steps 20]            # prints the row as JSON

Two trainers from the same weights, one eager and one with every block compiled by inductor; compile
time is the compiled trainer's first step minus an eager step; step times are medians over blocks of 5
steps taken in turn, so the machine's noise falls on both alike. Also reported: dynamo's graph count
(one per block class is the goal) and graph breaks.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _compile_rank(rank, world_size, overrides, steps, backend):
    import json

    from parallel.experiment.config import load_config
    from parallel.distributed.compile import compile_stats
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches

    ds = json.loads((ROOT / "ds_configs/zero0_fp32.json").read_text())
    ds.pop("activation_checkpointing")
    ctx, trainers, batches = ParallelContext.build(ParallelDims()), {}, {}
    for name, extra in (("eager", []), ("compiled", ["train.compile=true", f"train.compile_backend={backend}"])):
        cfg = load_config("debug", [*overrides, *extra])
        seed_all(cfg.train.seed)
        trainers[name] = build_trainer(cfg, ds, ctx)
        batches[name] = training_batches(cfg, ctx)
    times = {name: [] for name in trainers}
    tic = time.perf_counter()
    trainers["eager"].train_step(batches["eager"])
    eager_first = time.perf_counter() - tic
    compile_stats(reset=True)
    tic = time.perf_counter()
    trainers["compiled"].train_step(batches["compiled"])
    first = time.perf_counter() - tic
    stats = compile_stats()
    losses = {name: [] for name in trainers}
    for _ in range(max(1, steps // 5)):
        for name, trainer in trainers.items():
            for _ in range(5):
                tic = time.perf_counter()
                losses[name].append(trainer.train_step(batches[name]).loss)
                times[name].append(time.perf_counter() - tic)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"backend": backend, "steps_each": len(times["eager"]), "median_step_s": med,
            "ratio_compiled_over_eager": med["compiled"] / med["eager"],
            "compile_s": first - med["eager"], "eager_first_step_s": eager_first, "graphs": stats["graphs"],
            "graph_breaks": stats["graph_breaks"],
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"]))}


def measure(overrides: list[str], steps: int, backend: str = "inductor") -> dict:
    """The compile row at the given size (bench: the mid size), in a spawned one-rank process group."""
    from bench.ranks import run_ranks
    return {"overrides": overrides, **run_ranks(_compile_rank, 1, overrides, steps, backend, timeout=1800)[0]}


def markdown_rows(row: dict) -> list[str]:
    med = row["median_step_s"]
    return [f"| step time, compiled blocks ({row['backend']}; {row['graphs']} graph, {row['graph_breaks']} breaks) | "
            f"{med['compiled'] * 1e3:.1f} ms | eager: {med['eager'] * 1e3:.1f} ms | {row['ratio_compiled_over_eager']:.3f} |",
            f"| compile time (first compiled step minus an eager step) | {row['compile_s']:.1f} s | | |"]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from bench.overhead import MID
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 20
    print(json.dumps(measure(MID, steps), indent=1))
