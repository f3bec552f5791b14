"""`bash scripts/gpu-check.sh --speed`: issue 42's figures (train.py at the speed of its blocks) in one device command.

Each command is a process of its own (one failure or out-of-memory ends only its rows), in this order, the most
asked-for figures first so that a run the budget cuts short has measured them:

  phases       `python -m bench.step_phases --config cogvideox-5b --deepspeed-config zero1_bf16` (every block
               recomputed: on one 139 GiB H200 the 5B at 17,776 tokens fits only so, 134 GiB planned by
               `python -m parallel.plan --config cogvideox-5b --deepspeed-config zero1_bf16 --world-size 1
               --device-memory 139GiB --device-profile h200 --search`): the step, its phases (forward, backward,
               the boundary step, the rest), MFU (model FLOPs) and the hardware FLOPs' utilisation (the recomputed
               forward counted: 4/3 of the blocks' work), the blocks' share (the hooked pass), one step's trace
               (gzip; kept under $OUT when at most TRACE_KEEP bytes)
  peer-cogvideox  `python -m bench.peer_release --preset debug --size release --compile inductor`: 4 blocks of
               CogVideoX-5B at 17,776 tokens, the toolkit eager against diffusers' class on the same weights, and the
               toolkit's blocks compiled (train.compile's compile_layers, inductor) as a third column
  compiled     phases again with `--set train.compile=true`: the compiled / eager step ratio (against phases' step)
               and the compile time (the first two steps' excess over the compiled median)
  peer-wan     the same as peer-cogvideox for Wan 2.1 14B: 2 blocks at 81 x 480 x 832 (32,760 tokens)
  fp8          `python -m bench.fp8` (bench/fp8.py, its own table)

Time on one H100/H200 (an estimate: nothing here has run on a device yet; the sums are printed at the start):
  every process imports torch and DeepSpeed                                                     ~10 s each
  phases          the 5B built on the host (fp32, initialised serially; bench/capped.py estimates 1-2
                  minutes for the 14.4B) ~45 s, DeepSpeed's engine ~15 s, 1 + 3 + 3 steps at train.py's
                  3.59 s (H200) ~25 s, a profiled step and its trace written ~20 s                ~2 minutes
  peer-cogvideox  4 blocks built twice, 2 GB written and read (30 s on this project's 2-core CPU
                  host), timed ~15 s, one block class compiled by inductor on a cold cache (a no-grad
                  and a training graph) 1-2 minutes                                              ~2.5 minutes
  compiled        the 5B again ~1 minute, its compile 2-3 minutes cold (less where peer-cogvideox's
                  graphs are in inductor's cache), 2 + 3 + 3 steps                               ~3.5 minutes
  peer-wan        as peer-cogvideox (Wan's 2 blocks built in 42 s here)                          ~2.5 minutes
  fp8             bench/fp8.py: a 232M-parameter model trained 200 steps four times (bf16, float8, both
                  compiled: two inductor compiles of its block class) from the same weights             ~3 minutes
About 13.5 minutes in all, against one command's 10: the default --budget 540 s (a command starts only with 60 s of
it left) most likely ends after `compiled`, in the order above, and peer-wan and fp8 then read NOT RUN (budget);
`--only peer-wan,fp8 --budget 400` next, while the machine is still warm (or in the next lent session), runs them.

Rows: what, measured, compared with, verdict (bench/gpu_check.py's shape), each printed as measured, each command's
seconds printed as it ends; the table goes with the card and the date into bench/report.md's "GPU speed" section
(--no-report: print only) and, with --out DIR (default $OUT), as DIR/gpu-speed.md with the commands' result.json
files and logs; back here `bash scripts/gpu-check.sh --speed --write-report gpu-speed.md` puts a returned table into
bench/report.md. --tiny runs the same commands on the debug presets on CPU (peer at its mid size, aot_eager for
inductor; tests/cli/test_gpu_speed.py). Exit 1 if a command failed, 2 if none failed but the budget left some unrun.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
from pathlib import Path

from bench import device_run
from bench.device_run import Budget, peak, table

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- gpu-speed:begin -->", "<!-- gpu-speed:end -->"
HEADING = ("## GPU speed: train.py at the speed of its blocks\n\n`bash scripts/gpu-check.sh --speed` on a lent GPU "
           "(bench/gpu_speed.py says what each row is).")
TRACE_KEEP = 8 * 2**20          # a trace larger than this stays on the device (the tool brings back a few files)
NAMES = ("phases", "peer-cogvideox", "compiled", "peer-wan", "fp8")


def commands(tiny: bool, work: Path) -> dict[str, list[str]]:
    """Each name's command."""
    py = sys.executable
    config, backend, size = ("debug", "aot_eager", "mid") if tiny else ("cogvideox-5b", "inductor", "release")
    phases = [py, "-m", "bench.step_phases", "--config", config, "--deepspeed-config", "zero1_bf16", "--steps",
              "1" if tiny else "3"]
    return {
        "phases": [*phases, "--warmup", "1", "--trace", str(work / "phases" / "trace"), "--out", str(work / "phases")],
        "peer-cogvideox": [py, "-m", "bench.peer_release", "--preset", "debug", "--size", size, "--compile",
                           backend, "--blocks", "1" if tiny else "3", "--out", str(work / "peer-cogvideox")],
        "compiled": [*phases, "--warmup", "2", "--set", "train.compile=true", "--set",
                     f"train.compile_backend={backend}", "--out", str(work / "compiled")],
        "peer-wan": [py, "-m", "bench.peer_release", "--preset", "debug-wan", "--size", size, "--compile", backend,
                     "--blocks", "1" if tiny else "3", "--out", str(work / "peer-wan")],
        "fp8": [py, "-m", "bench.fp8", *(["--tiny"] if tiny else []), "--out", str(work / "fp8")],
    }


def recompute_factor(config: str) -> float:
    """Hardware / model FLOPs of a step with every block recomputed: the blocks' forward (a third of their forward +
    backward: 2 N seq for the matrices, 4 L seq^2 hidden for attention) once more, over bench's step_flops."""
    import torch

    from bench.__main__ import step_flops
    from parallel.distributed.pipeline import SequentialDiT
    from parallel.distributed.topology import ParallelContext
    from parallel.experiment.config import load_config
    from parallel.experiment.units import count_parameters
    from parallel.model.build import layer_specs
    from parallel.plan.trace import sequence_length

    cfg = load_config(config)
    specs = layer_specs(cfg, ParallelContext.single())
    with torch.device("meta"):
        model = SequentialDiT(specs)
    blocks = sum(count_parameters(m, matrices_only=True) for m in model.modules() if isinstance(m, specs[1].typename))
    seq, m = sequence_length(cfg), cfg.model
    forward = cfg.train.micro_batch_size * (2 * blocks * seq + 4 * m.num_layers * seq ** 2 * m.hidden_size)
    return 1 + forward / step_flops(cfg)


def utilisation(r: dict, factor: float) -> str:
    if r["device"] == "cpu":
        return "MFU: no device peak on CPU (step_phases divides by a measured fp32 matmul rate)"
    if r["mfu"] is None:
        return f"MFU: no peak known for {r['device']}"
    return (f"MFU {r['mfu']:.1%} (model FLOPs); {r['mfu'] * factor:.1%} of the peak counting the recomputed forward "
            f"(x {factor:.3f})")


def phase_rows(label: str, r: dict, factor: float, trace: Path | None) -> list[tuple[str, ...]]:
    rows = [(f"{label} whole step", f"{r['step_s']:.3f} s", utilisation(r, factor), "ok")]
    rows += [(f"{label} phase {name}", f"{s:.4f} s", f"{s / r['step_s']:.1%} of the step", "")
             for name, s in r["phases_s"].items()]
    rows.append((f"{label} blocks (hooked pass)", f"{r['blocks_s']:.4f} s",
                 f"{r['blocks_s'] / r['hooked_step_s']:.1%} of that pass's {r['hooked_step_s']:.4f} s step", ""))
    if trace is not None:
        size = trace.stat().st_size
        rows.append((f"{label} trace (one step)", f"step.json.gz {size / 2**20:.1f} MiB",
                     f"kept under $OUT up to {TRACE_KEEP / 2**20:.0f} MiB",
                     "kept" if size <= TRACE_KEEP else "not kept (too large)"))
    return rows


def compiled_rows(r: dict, eager: dict | None) -> list[tuple[str, ...]]:
    backend = next(o.split("=")[1] for o in r["overrides"] if o.startswith("train.compile_backend="))
    w = r["warmup_s"]
    rows = [(f"compiled ({backend}) step", f"{r['step_s']:.3f} s",
             f"eager {eager['step_s']:.3f} s: compiled / eager {r['step_s'] / eager['step_s']:.3f}" if eager else
             "no eager step (phases did not run)", "ok"),
            (f"compiled ({backend}) compile time", f"{sum(x - r['step_s'] for x in w):.1f} s",
             f"first {len(w)} steps " + " + ".join(f"{x:.2f}" for x in w) + " s against the compiled median", "")]
    return rows


def peer_rows(name: str, r: dict) -> list[tuple[str, ...]]:
    row, c = r["row"], r.get("compiled")
    label = f"{name} {row['family']} {row['size']} ({row['hidden']} hidden, {row['tokens']:,} tokens)"
    mfu = (f"; MFU {row['mfu_toolkit']:.1%} / {row['mfu_diffusers']:.1%}" if r["device"] != "cpu" and
           row["mfu_toolkit"] is not None else "; MFU: no device peak on CPU" if r["device"] == "cpu" else
           "; MFU: no peak known")
    rows = [(f"{label} train step, toolkit / diffusers",
             f"{row['train_toolkit_s'] * 1e3:.1f} / {row['train_diffusers_s'] * 1e3:.1f} ms",
             f"ratio {row['train_ratio']:.3f}, forward ratio {row['forward_ratio']:.3f}{mfu}",
             f"max abs diff {row['max_abs_diff']:.1e}"),
            (f"{label} saved for backward, toolkit / diffusers",
             f"{row['saved_toolkit_bytes'] / 2**20:.1f} / {row['saved_diffusers_bytes'] / 2**20:.1f} MiB",
             f"ratio {row['saved_ratio']:.3f}", "")]
    if c is not None:
        rows.append((f"{label} compiled blocks ({c['backend']}) train step", f"{c['train_compiled_s'] * 1e3:.1f} ms",
                     f"compiled / eager {c['train_compiled_over_eager']:.3f}, compiled / diffusers "
                     f"{c['train_compiled_over_diffusers']:.3f}; compile {c['compile_s']:.1f} s, {c['graphs']} "
                     f"graphs, {c['graph_breaks']} breaks", f"max abs diff vs eager {c['max_abs_diff_vs_eager']:.1e}"))
    return rows


class Speed:
    """The run: each command under the budget, its rows from what it wrote."""

    def __init__(self, work: Path, budget: Budget, execute):
        self.work, self.budget, self.execute = work, budget, execute
        self.rows: list[tuple[str, ...]] = []
        self.results: dict[str, dict] = {}
        self.extra, self.failed = "", False

    def add(self, rows) -> None:
        for row in rows:
            self.rows.append(row)
            print(" | ".join(row), flush=True)

    def command(self, name: str, cmd: list[str]) -> str | None:
        """Runs it; its output, or None after adding the row that says why there is none."""
        code, output, seconds = device_run.run(cmd, self.work / f"{name}.log", self.budget, "gpu-speed", self.execute)
        row = device_run.unfinished_row(name, code, output, seconds)
        if row is None:
            return output
        self.failed |= code is not None
        self.add([row])
        return None

    def result(self, name: str) -> dict | None:
        path = self.work / name / "result.json"
        if path.exists():
            self.results[name] = json.loads(path.read_text())
        return self.results.get(name)

    def run(self, name: str, cmd: list[str], config: str) -> None:
        output = self.command(name, cmd)
        try:
            self.add(self.rows_of(name, output, config))
        except Exception as e:         # the rows of what ran, never the run: the table and $OUT still come back
            self.failed = True
            self.add([(f"{name} rows", "-", f"{type(e).__name__}: {e}"[:300].replace("|", "/"), "FAILED")])

    def rows_of(self, name: str, output: str | None, config: str) -> list[tuple[str, ...]]:
        """What the command wrote, as rows (none where it wrote nothing: its row says why)."""
        r = self.result(name)
        if name.startswith("peer"):        # written before the compile: a compile stopped leaves the eager rows
            return peer_rows(name, r) if r is not None else []
        if output is None:
            return []
        if name == "fp8":
            self.extra = output[output.find("|"):] if "|" in output else output
            return [("fp8", "bench/fp8.py's table", "below this table", "ok")]
        if r is None:
            raise FileNotFoundError(f"{name} exited 0 without {self.work / name / 'result.json'}")
        if name == "phases":
            trace = self.work / "phases" / "trace" / "step.json.gz"
            return phase_rows(f"phases {config}", r, recompute_factor(config), trace if trace.exists() else None)
        return compiled_rows(r, self.results.get("phases"))


def keep(out: Path, text: str, work: Path) -> None:
    """The table, the commands' result.json, the trace where small, and the logs (gzip) in `out`."""
    copies = [(work / name / "result.json", f"{name}.json") for name in NAMES]
    copies += [(work / "fp8" / "fp8.json", "fp8.json"), (work / "fp8" / "fp8.md", "fp8.md")]     # bench/fp8.py's own
    trace = work / "phases" / "trace" / "step.json.gz"
    if trace.exists() and trace.stat().st_size <= TRACE_KEEP:
        copies.append((trace, "phases-step.json.gz"))
    logs = [(f, str(f.relative_to(work))) for f in sorted(work.rglob("*.log"))]
    device_run.keep(out, "gpu-speed.md", text, copies, tarball="gpu-speed-logs.tar.gz", packed=logs)


def main(argv=None, execute=device_run.subprocess_run) -> int:
    """`execute(cmd, timeout)`: how a command runs (device_run.subprocess_run; a test forks it from its server)."""
    ap = argparse.ArgumentParser(prog="bash scripts/gpu-check.sh --speed", description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the debug presets (runs on CPU): the script's own check")
    ap.add_argument("--only", default=None, help=f"comma-separated, of {','.join(NAMES)} (default all, in that order)")
    device_run.add_run_args(ap, "gpu-speed", ROOT / "bench" / "out" / "gpu-speed")
    args = ap.parse_args(argv)
    unknown = set(args.only.split(",")) - set(NAMES) if args.only else set()
    if unknown:
        ap.error(f"--only {','.join(sorted(unknown))}: not a command here; the commands: {','.join(NAMES)}")
    report = ROOT / "bench" / "report.md"
    if args.write_report:
        device_run.write_report(args.write_report.read_text(), report, BEGIN, END, HEADING)
        print(f"bench/report.md: the GPU speed section is {args.write_report}'s table")
        return 0
    budget = Budget(args.budget, floor=5.0 if args.tiny else 60.0)
    if not args.tiny:
        print("estimate on one H100/H200 (bench/gpu_speed.py): phases ~2, peer-cogvideox ~2.5, compiled ~3.5, "
              f"peer-wan ~2.5, fp8 ~3 minutes (~13.5 in all); the budget is {args.budget:.0f} s", flush=True)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    card, _ = peak()
    found = commands(args.tiny, args.work)
    speed = Speed(args.work, budget, execute)
    typed = "bash scripts/gpu-check.sh --speed" + (" --tiny" if args.tiny else "") + \
            (f" --only {args.only}" if args.only else "")
    for name in args.only.split(",") if args.only else NAMES:
        speed.run(name, found[name], "debug" if args.tiny else "cogvideox-5b")
        text = table(speed.rows, card, datetime.date.today().isoformat(), typed) + \
            (f"\nbench/fp8.py:\n\n{speed.extra.rstrip()}\n" if speed.extra else "")
        if not args.no_report:
            device_run.write_report(text, report, BEGIN, END, HEADING)
        if args.out is not None:       # after each command: a run stopped from outside has left what it measured
            keep(args.out, text, args.work)
    print("\n" + text, flush=True)
    return 1 if speed.failed else 2 if budget.short else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
