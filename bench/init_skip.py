"""What the tensor-parallel layers' random init costs a start that overwrites it: build_model with the init (as
before) against inside skip_init (parallel/distributed/layers.py; what build_trainer does for model.init_from and
for a resume, sampling_model for model.init_from), as ratios.

    python -m bench.init_skip                                    # configs/wan2.1-t2v-1.3b.yaml at tp 1 and 2
    python -m bench.init_skip --config cogvideox-2b --tp 1,2,4 --release CogVideoX-2b/transformer
    python -m bench.init_skip --resume --tp 1                    # build + a checkpoint's module states loaded

Each build runs in a fresh process (spawn), the two ways alternating over --repeat runs; tp > 1 builds tp rank 0's
share with a planning context (ParallelContext.single(tp_size=...): no process group), as each rank of the run builds
its own. Reported per tp: the median build seconds and the peak resident host memory (ru_maxrss) after the build, each
way, and skip / init. With --release (a diffusers folder for the config, read at tp 1 only: the reader needs process
groups above it), also the seconds of load_released, build + read (total_s) and the peak after the read: skipped
weights are torch.empty, whose pages the read touches first (their page faults move into the read), so the total and
the peak after the read are the ones to compare. With --resume, the read is a checkpoint's instead, as a resume
(train.py, parallel.export, parallel.sample) loads DeepSpeed's module states at the same layout: this tp rank's
states of a bf16 run ({"module": state dict}, its floating tensors in bf16, written once per tp into a temporary
folder before the timed runs) read with torch.load(weights_only=True) and load_state_dict (strict), the part of
engine.load_checkpoint that touches the weights; deepspeed.initialize and the optimizer's states cost the same either
way and are left out. Nothing is asserted: a shared machine's figures.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WAYS = ("init", "skip")


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20       # Linux: KiB


def _write_states(config: str, tp: int, path: str) -> None:
    """One process: tp rank 0's module states as a bf16 run's checkpoint holds them (DeepSpeed's
    mp_rank_00_model_states.pt), the values skip_init's zero fill (the load's cost does not depend on them)."""
    import torch

    from parallel.distributed.layers import skip_init
    from parallel.distributed.topology import ParallelContext
    from parallel.experiment.config import load_config
    from parallel.model.build import build_model

    cfg = load_config(config, [f"parallel.tp_size={tp}"])
    with skip_init(fill=0.0):
        model = build_model(cfg, {}, ParallelContext.single(tp_size=tp))
    states = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    torch.save({"module": states}, path)


def _read(model, cfg, ctx, release, states) -> None:
    """The read that overwrites the build: the release (load_released), or the checkpoint's module states."""
    if release:
        from parallel.weights.diffusers import load_released
        load_released(model, ctx, cfg.model, release)
    else:
        import torch
        model.load_state_dict(torch.load(states, map_location="cpu", weights_only=True)["module"])


def _timed_build(config: str, tp: int, way: str, release, out, states=None) -> None:
    """One process: build (and read `release` or the module states `states` into) the model one way; (seconds, peak
    GiB) of each phase."""
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
    if release or states:
        tic = time.perf_counter()
        _read(model, cfg, ctx, release, states)
        row.update(load_s=time.perf_counter() - tic, load_gib=_peak_gib())
        row["total_s"] = row["build_s"] + row["load_s"]
    out.put(row)


def _run(spawn, target, args) -> None:
    p = spawn.Process(target=target, args=args)
    p.start()
    p.join()


def measure(config: str, tp: int, repeat: int, release=None, resume: bool = False) -> dict:
    runs = {way: [] for way in WAYS}
    spawn = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="init_skip_") if resume else contextlib.nullcontext() as folder:
        states = str(Path(folder) / "mp_rank_00_model_states.pt") if resume else None
        if resume:
            _run(spawn, _write_states, (config, tp, states))
        for turn in range(repeat):
            for way in WAYS[turn % 2:] + WAYS[:turn % 2]:
                out = spawn.Queue()
                p = spawn.Process(target=_timed_build,
                                  args=(config, tp, way, release if tp == 1 else None, out, states))
                p.start()
                runs[way].append(out.get())
                p.join()
    med = {way: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for way, rows in runs.items()}
    row = {"config": config, "tp": tp, "params_per_rank": int(med["init"]["params"]), "repeat": repeat,
           **({"read": "checkpoint module states (bf16)"} if resume else {})}
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
    read = ap.add_mutually_exclusive_group()
    read.add_argument("--release", default=None, help="a diffusers folder of the config: also time reading it (tp 1)")
    read.add_argument("--resume", action="store_true",
                      help="also time loading a checkpoint's module states, as a resume does (each tp)")
    args = ap.parse_args(argv)
    for tp in (int(t) for t in args.tp.split(",")):
        print(json.dumps(measure(args.config, tp, args.repeat, args.release, args.resume)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
