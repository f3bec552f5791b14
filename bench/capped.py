"""`python -m bench.capped` (`bash scripts/gpu-check.sh --capped`): Wan 14B LoRA capped at 24 GiB vs plan and uncapped.

Wan 2.1 14B LoRA on one GPU capped at 24 GiB, against its memory plan and against the same LoRA uncapped.

Issue 40's device check of docs/training.md's "14B LoRA on one 24 GiB GPU": wan2.1-t2v-14b with rank-32 adapters at
81 x 480 x 832 (32,760 tokens), ds_configs/zero1_bf16.json (bf16, block recompute), synthetic data, one process; two
train.py runs of --steps steps (default 3), each through bench/capped_train.py (the cap set inside train.py's
process, no checkpoint written):

  capped    the layout `parallel.plan --search --device-memory 24GiB` finds: train.offload_activations=true,
            train.block_swap=33, train.device_memory=24GiB, and the allocator capped at 24 GiB
            (parallel/distributed/accelerator.py cap_memory: set_per_process_memory_fraction(24 GiB / total))
  uncapped  the same LoRA without offload or swap (59.1 GiB planned: it fits the device's own 80 GB or more),
            for the step time the offload and the swap cost

Rows, for each run: the step time (median of the steps after the first), the plan's device peak against the
allocator's (memory_check.json, which train.py writes at step 2; the reserved peak beside it: what the cap counts),
the model states against the plan, the host's resident memory after the steps against the plan's host bytes
(pinned swapped blocks and offloaded checkpoint inputs), the seconds to the first step; then capped / uncapped.

Time on one H100/H200 (an estimate, printed at the start): each run builds the 14.4B-parameter model on the host
(fp32, initialised serially by torch; the capped run also pins 34 GiB: 1-2 minutes), then 3 steps of about 18.5 s planned (the search's step time,
h100-80gb profile at 40% of peak): about 5 minutes for both. The capped run goes first; its rows are printed, and
copied under $OUT, as soon as it ends. --frames fewer than 81 shortens each step (not the build).

It prints one table and writes it, with the card and the date, into bench/report.md's "14B LoRA capped at 24 GiB"
section (--no-report: print only); with --out DIR (default $OUT, a lent device's output folder) the table
(capped.md), the results as JSON, each run's log and memory_check.json and bench/report.md are copied there (7
files); back here, `bash scripts/gpu-check.sh --capped --write-report capped.md` puts that table into
bench/report.md. --tiny runs the same two
commands on configs/debug-wan.yaml (LoRA rank 4, block_swap=3): on CPU, where cap_memory returns False and
there is no device peak, the test suite runs it (tests/cli/test_capped.py). Exit 1 if a run failed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from bench import device_run

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- capped:begin -->", "<!-- capped:end -->"
HEADING = "## 14B LoRA capped at 24 GiB\n\n`bash scripts/gpu-check.sh --capped` on a lent GPU (bench/capped.py says " \
          "what each row is)."
# the estimate printed at the start (module docstring): seconds to build the release model, the planned step
BUILD_S, PLANNED_STEP_S = 90, 18.5


@dataclass(frozen=True)
class Case:
    """One model's two runs: the keys both take, and the capped run's offload keys (the search's layout)."""
    config: str
    keys: tuple[str, ...]
    offload: tuple[str, ...]


RELEASE = Case("wan2.1-t2v-14b", ("parallel.sp_size=1", "model.lora.rank=32", "data.height=480", "data.width=832"),
               ("train.offload_activations=true", "train.block_swap=33"))
TINY = Case("debug-wan", ("model.lora.rank=4", "train.grad_accum_steps=1"),
            ("train.offload_activations=true", "train.block_swap=3"))
RUNS = ("capped", "uncapped")


def command(case: Case, run: str, out: Path, steps: int, cap: str, frames: int | None) -> list[str]:
    """The train.py command of one run, through bench/capped_train.py (the cap, the measurements, no checkpoint)."""
    keys = [*case.keys, *([f"data.num_frames={frames}"] if frames else []), f"train.output_dir={out}",
            f"train.max_steps={steps}", "val.every=0", "ckpt.every=0"]
    launcher = ["-m", "bench.capped_train", "--stats", str(out / "stats.json")]
    if run == "capped":
        keys += [*case.offload, f"train.device_memory={cap}"]
        launcher += ["--cap", cap]
    return [sys.executable, *launcher, "--config", case.config, "--deepspeed-config", "zero1_bf16",
            *[a for k in keys for a in ("--set", k)]]


def measure(out: Path) -> dict:
    """What one finished run wrote: metrics.jsonl's step times, memory_check.json's stage, the launcher's stats."""
    times = [m["step_time_s"] for m in device_run.metrics(out)]
    check = json.loads((out / "memory_check.json").read_text())
    return {"step_times": times, "step_s": device_run.median(times[1:] or times),     # step 1 warms up
            "memory": check["stages"][0], **json.loads((out / "stats.json").read_text())}


def run_rows(run: str, r: dict) -> list[tuple[str, str, str, str]]:
    """The table's rows of one run's measurements (`measure`)."""
    from parallel.experiment.units import format_size as size
    rows = [(f"{run} step time", f"{r['step_s']:.3f} s", f"median of steps 2-{len(r['step_times'])}", "ok")]
    if run == "capped":
        rows.append(("capped allocator", f"{size(r['cap'])} of {size(r['device_total'])}", "accelerator.cap_memory",
                     "capped" if r["capped"] else "not capped (no device allocator)"))
    peak, reserved = r["memory"].get("device_peak"), r["device_peak_reserved"]
    if peak:
        p, m = peak["predicted"], peak["measured"]
        within = f", {'within' if reserved <= r['cap'] else 'OVER'} the cap" if r["capped"] else ""
        rows.append((f"{run} device peak", f"{size(m)} allocated, {size(reserved)} reserved", f"plan {size(p)}",
                     f"plan / measured {p / m:.3f}{within}"))
    states = r["memory"]["model_states"]
    rows.append((f"{run} model states", f"{states['measured']:,} B", f"plan {states['predicted']:,} B",
                 f"{states['measured'] / states['predicted']:.4f}"))
    host, planned = r["host_rss_steps"], r["host_planned"]
    peak_rss = max(host, r["host_peak_rss"])       # ru_maxrss is sampled by the kernel: it can trail the last RSS
    ratio = "the device's memory too, on CPU" if reserved is None else \
        (f"measured / plan {host / planned:.2f}" if planned else "")
    rows.append((f"{run} host memory", f"{size(host)} resident after the steps (process peak {size(peak_rss)})",
                 f"plan {size(planned)} on the host" if planned else "plan: nothing on the host", ratio))
    rows.append((f"{run} start", f"{r['init_s']:.0f} s to the first step", "build, DeepSpeed, the plan", ""))
    return rows


def compare_row(capped: dict, uncapped: dict) -> tuple[str, str, str, str]:
    a, b = capped["step_s"], uncapped["step_s"]
    return ("capped / uncapped step time", f"{a / b:.3f}x", f"{a:.3f} s / {b:.3f} s", "ok")


def export(out: Path | None, work: Path, text: str, report: Path | None) -> None:
    """The table, results and logs under `out` (--out, default $OUT: a lent device's output folder), when set."""
    if out is None:
        return
    files = [(work / "capped.json", "capped.json")]
    files += [(work / f"{run}.log", f"{run}.log") for run in RUNS]
    files += [(work / run / "memory_check.json", f"{run}-memory_check.json") for run in RUNS]
    files += [(report, "report.md")] if report else []
    device_run.keep(out, "capped.md", text, copies=files)


def main(argv=None, runner=None) -> int:
    """`runner(cmd, log) -> (exit code, output, seconds)`: device_run.run (a subprocess, no budget) unless given
    (a test forks the commands from its preloaded server)."""
    from bench.device_run import Budget, peak, run, table, unfinished_row, write_report

    ap = argparse.ArgumentParser(prog="bash scripts/gpu-check.sh --capped", description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="configs/debug-wan.yaml (runs on CPU): the script's own check")
    ap.add_argument("--steps", type=int, default=3, help="steps a run (the memory check is at step 2; default 3)")
    ap.add_argument("--frames", type=int, default=None, help="data.num_frames (default the recipe's 81)")
    ap.add_argument("--cap", default="24GiB", help="the capped run's device memory (default 24GiB)")
    device_run.add_run_args(ap, "capped", ROOT / "bench" / "out" / "capped", budget=False)
    args = ap.parse_args(argv)
    if args.write_report:
        write_report(args.write_report.read_text(), ROOT / "bench" / "report.md", BEGIN, END, HEADING)
        print(f"bench/report.md: the 14B LoRA capped section is {args.write_report}'s table")
        return 0
    runner = runner or (lambda cmd, log: run(cmd, log, Budget(float("inf"), 0.0), "capped"))
    case = TINY if args.tiny else RELEASE
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    if not args.tiny:
        total = 2 * (BUILD_S + args.steps * PLANNED_STEP_S)
        print(f"estimate on one H100/H200: 2 runs x (about {BUILD_S} s to build 14.4B parameters on the host + "
              f"{args.steps} steps x {PLANNED_STEP_S} s planned) = about {total / 60:.1f} minutes", flush=True)
    card, _ = peak()
    date = datetime.date.today().isoformat()
    typed = "bash scripts/gpu-check.sh --capped" + (" --tiny" if args.tiny else "")
    report = None if args.no_report else ROOT / "bench" / "report.md"
    rows, results, failed = [], {}, False
    for name in RUNS:
        out = args.work / name
        code, output, seconds = runner(command(case, name, out, args.steps, args.cap, args.frames),
                                       args.work / f"{name}.log")
        if code == 0:
            results[name] = measure(out)
            new = run_rows(name, results[name])
        else:
            failed = True
            new = [unfinished_row(f"{name} run", code, output, seconds)]
        if len(results) == 2:
            new.append(compare_row(results["capped"], results["uncapped"]))
        print("\n".join(" | ".join(r) for r in new), flush=True)
        rows += new
        (args.work / "capped.json").write_text(json.dumps({"rows": rows, "results": results}, indent=1) + "\n")
        text = table(rows, card, date, typed)
        if report:
            write_report(text, report, BEGIN, END, HEADING)
        export(args.out, args.work, text, report)
    print("\n" + text)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
