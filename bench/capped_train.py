"""`python -m bench.capped_train [--cap SIZE] --stats FILE TRAIN_ARGS...`: train.py as a user types it, in this
process, with the device's allocator capped first, no checkpoint at the end, and what bench/capped.py measures
around the steps written to FILE.

The cap (parallel/distributed/accelerator.py cap_memory: set_per_process_memory_fraction(SIZE / total)) must be in
place before train.py's first allocation on the device, so the process that trains sets it: this launcher, which
then runs train.py's own main (runpy, run_name other than __main__: its `run` would exit). A cap is a measuring
device, not a training setting, so train.py has no flag for it: a user who plans for a smaller card sets
train.device_memory, which the plan and train.py's refusal already read, and a real 24 GiB card caps itself.

train.py's Trainer is replaced, for this process only, by a subclass that changes nothing in a step:
  save       returns True without writing: the end-of-run checkpoint of a 14B LoRA run holds the 28.8 GB frozen
             base (DeepSpeed writes every parameter), a minute of the bench's five and half the device's disk
  start      timed: seconds from this launcher's start to the first step (model build, DeepSpeed, the plan)
  timed_step the host's resident bytes after each step (pinned swapped blocks and offloaded checkpoint inputs)
FILE (JSON): capped (cap_memory's answer), cap and device_total (bytes), init_s, host_rss_steps (the largest RSS
after a step), host_peak_rss (the process's peak, the model build's fp32 weights included), host_planned (the
plan's host bytes: what train.py's host check counted), device_peak_reserved (None on CPU), status.
"""
from __future__ import annotations

import argparse
import json
import resource
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STARTED = time.perf_counter()


def measuring(base: type, stats: dict) -> type:
    """`base` (train.py's Trainer) with save skipped and start / each step measured into `stats`."""
    import psutil

    class MeasuredTrainer(base):
        def start(self) -> None:
            super().start()
            stats["init_s"] = time.perf_counter() - STARTED
            stats["host_planned"] = max(sum(s.host.values()) for s in self.plan.stages)

        def timed_step(self, step: int):
            out = super().timed_step(step)
            stats["host_rss_steps"] = max(stats.get("host_rss_steps", 0), psutil.Process().memory_info().rss)
            return out

        def save(self, done: int) -> bool:
            return True

    return MeasuredTrainer


def main(argv=None) -> int:
    from parallel.distributed import accelerator
    from parallel.distributed.topology import read_launch_env
    from parallel.experiment.units import parse_size
    import parallel.train.trainer as trainer

    ap = argparse.ArgumentParser(prog="python -m bench.capped_train", description=__doc__.splitlines()[0],
                                 allow_abbrev=False)
    ap.add_argument("--cap", default=None, help="the allocator's limit (24GiB); default none")
    ap.add_argument("--stats", type=Path, required=True, help="the JSON file written at the end")
    args, train_args = ap.parse_known_args(argv)
    cap = parse_size(args.cap, unit_required=True) if args.cap else None
    local_rank = read_launch_env().local_rank
    capped = accelerator.cap_memory(cap, local_rank) if cap else False
    print(f"memory cap: {'%.2f GiB' % (cap / 2**30) if cap else 'none'}, "
          f"{'applied' if capped else 'not applied'} on {accelerator.name()}", flush=True)
    stats = {"capped": capped, "cap": cap, "device_total": accelerator.total_memory(local_rank)}
    trainer.Trainer = measuring(trainer.Trainer, stats)
    train = runpy.run_path(str(ROOT / "train.py"), run_name="bench_capped_train")
    stats["status"] = train["main"](train_args) or 0
    stats["host_peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024    # KiB on Linux
    stats["device_peak_reserved"] = accelerator.peak_reserved()
    args.stats.write_text(json.dumps(stats, indent=1) + "\n")
    return stats["status"]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
