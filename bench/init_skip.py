"""What the tensor-parallel layers' random init costs a model.init_from start, which overwrites it: build_model with
the init (as before) against inside skip_init (parallel/distributed/layers.py; what build_trainer and sampling_model
now do for model.init_from), as ratios.

    python -m bench.init_skip                                    # configs/wan2.1-t2v-1.3b.yaml at tp 1 and 2
    python -m bench.init_skip --config cogvideox-2b --tp 1,2,4 --release CogVideoX-2b/transformer

Each build runs in a fresh process (spawn), the two ways alternating over --repeat runs; tp > 1 builds tp rank 0's
share with a planning context (ParallelContext.single(tp_size=...): no process group), as each rank of the run builds
its own. Reported per tp: the median build seconds and the peak resident host memory (ru_maxrss) after the build, each
way, and skip / init. With --release (a diffusers folder for the config, read at tp 1 only: the reader needs process
groups above it), also the seconds of load_released, build + read (total_s) and the peak after the read: skipped
weights are torch.empty, whose pages the read touches first (their page faults move into the read), so the total and
the peak after the read are the ones to compare. Nothing is asserted: a shared machine's figures.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WAYS = ("init", "skip")


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20       # Linux: KiB


def _timed_build(config: str, tp: int, way: str, release, out) -> None:
    """One process: build (and read `release` into) the model one way; (seconds, peak GiB) of each phase."""
    import contextlib

    import torch

    from parallel.distributed.layers import skip_init
    from parallel.distributed.topology import ParallelContext
    from parallel.experiment.config import load_config
    from parallel.model.build import build_model

    torch.set_num_threads(1)
    cfg = load_config(config, [f"parallel.tp_size={tp}"])
    ctx = ParallelContext.single(tp_size=tp)
    row = {"start_gib": _peak_gib()}
    tic = time.perf_counter()
    with skip_init() if way == "skip" else contextlib.nullcontext():
        model = build_model(cfg, {}, ctx)
    row.update(build_s=time.perf_counter() - tic, build_gib=_peak_gib(),
               params=sum(p.numel() for p in model.parameters()))
    if release:
        from parallel.weights.diffusers import load_released
        tic = time.perf_counter()
        load_released(model, ctx, cfg.model, release)
        row.update(load_s=time.perf_counter() - tic, load_gib=_peak_gib())
        row["total_s"] = row["build_s"] + row["load_s"]
    out.put(row)


def measure(config: str, tp: int, repeat: int, release=None) -> dict:
    runs = {way: [] for way in WAYS}
    spawn = mp.get_context("spawn")
    for turn in range(repeat):
        for way in WAYS[turn % 2:] + WAYS[:turn % 2]:
            out = spawn.Queue()
            p = spawn.Process(target=_timed_build, args=(config, tp, way, release if tp == 1 else None, out))
            p.start()
            runs[way].append(out.get())
            p.join()
    med = {way: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for way, rows in runs.items()}
    row = {"config": config, "tp": tp, "params_per_rank": int(med["init"]["params"]), "repeat": repeat}
    for key in ("build_s", "build_gib", "load_s", "load_gib", "total_s"):
        if key in med["init"]:
            row.update({f"{key}_init": round(med["init"][key], 3), f"{key}_skip": round(med["skip"][key], 3),
                        f"ratio_{key}": round(med["skip"][key] / med["init"][key], 3)})
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.init_skip", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="wan2.1-t2v-1.3b", help="a preset or YAML (configs/)")
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--release", default=None, help="a diffusers folder of the config: also time reading it (tp 1)")
    args = ap.parse_args(argv)
    for tp in (int(t) for t in args.tp.split(",")):
        print(json.dumps(measure(args.config, tp, args.repeat, args.release)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
