"""`python -m bench.gpu_check` (scripts/gpu-check.sh): the user's path on one GPU, at release token counts.

For each preset (default cogvideox-2b and wan2.1-t2v-1.3b, synthetic data of the preset's shape, ZeRO-1 bf16,
one process), through the commands a user types:

  train    `python train.py` 4 steps with a checkpoint at the end: each step's time and MFU (model FLOPs of
           bench's step_flops over the device's datasheet bf16 peak), the plan's device peak against the
           allocator's (memory_check.json, written by train.py's own memory check)
  resume   2 steps, then the same command to 4 (it resumes step 2): steps 3-4 against the uninterrupted run's
           (bf16 at release size: within bf16 noise, the largest difference printed; fp32 below: bitwise)
  sample   `python -m parallel.sample` 2 steps from the checkpoint
  export   `python -m parallel.export --format diffusers`, then `python -m parallel.verify` of that folder:
           diffusers' own model loaded from it against the toolkit's forward (fp32, max relative difference)
Then `debug` in fp32 (a small video): 4 steps against 2 + resumed 2, bitwise; and ring attention's flash
kernels against SDPA in bf16 and fp16 (tests/unit/test_ring_kernels.py).

The quick checks run first (ring kernels, then the fp32 debug preset through every command), then the release
presets, so a run cut short has checked the most. A lent device gives a session 15 minutes and one command 10:
--budget (seconds, default 540) bounds the whole run. A command is given what is left of it and stopped there
("TIMED OUT"); one that the budget no longer holds is not started ("NOT RUN (budget)"), and each command's
seconds are printed as it ends, for planning the next run.

Each row is printed as it is measured. The table is written, with the card and the date, into bench/report.md's
"GPU check" section (--no-report: print only) and, with --out DIR (default $OUT, the device tool's folder that
comes back), as DIR/gpu-check.md with the commands' logs in DIR/gpu-check-logs.tar.gz. Back here,
`bash scripts/gpu-check.sh --write-report gpu-check.md` puts a returned table into bench/report.md.
--tiny runs the same commands on the debug presets (CPU works: the test suite runs it so the script itself is
known to work where no GPU is lent). Exit 1 if any command failed, 2 if none failed but the budget (or the disk:
a resume is not started without room for a second checkpoint) left some unchecked.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import sys
from pathlib import Path

from bench import device_run
from bench.device_run import Budget, median, metrics, peak, table

ROOT = Path(__file__).resolve().parent.parent
RELEASE = ["cogvideox-2b", "wan2.1-t2v-1.3b"]
TINY = ["debug", "debug-wan"]
BEGIN, END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"


BUDGET = Budget(float("inf"), 0.0)      # main() sets the run's


def run(cmd: list[str], log: Path) -> tuple[int | None, str, float]:
    """device_run.run under this run's BUDGET: (exit code, output, seconds), the output kept in `log`."""
    return device_run.run(cmd, log, BUDGET, "gpu-check")


def step_flops(preset: str) -> float:
    from bench.__main__ import step_flops as flops
    from parallel.experiment.config import load_config
    return flops(load_config(preset))


class Check:
    """One preset's commands and what they measured: `rows` of (what, measured, compared with, verdict)."""

    def __init__(self, preset: str, work: Path, ds: str, embeds: Path, label: str | None = None):
        self.preset, self.work, self.ds, self.embeds = preset, work / preset, ds, embeds
        self.label = label or preset          # the rows' first word
        self.rows: list[tuple[str, str, str, str]] = []
        self.failed = False
        self.unchecked = False      # a check not run for want of disk (the budget's shortfall is BUDGET.short)

    def add(self, *row: str) -> None:
        """A row of the table, printed at once (a run cut short has said what it measured)."""
        self.rows.append(row)
        print(" | ".join(row), flush=True)

    def experiment(self, out: Path, *extra: str) -> list[str]:
        """One schedule for every run (decay over 4 steps); a checkpoint at the end only, without the layout-free
        copy (tested on CPU; it doubles the bytes: cogvideox-2b's checkpoint is 28 GB without it, the device's
        disk 64 GiB), one kept."""
        return ["--config", self.preset, "--deepspeed-config", self.ds, "--set", f"train.output_dir={out}",
                "--set", "val.every=0", "--set", "train.warmup_steps=0", "--set", "train.decay_steps=4",
                "--set", "ckpt.every=0",
                "--set", "ckpt.layout_free=false", "--set", "ckpt.keep=1", *extra]

    def command(self, name: str, cmd: list[str]) -> str | None:
        code, output, seconds = run(cmd, self.work / f"{name.replace(' ', '-')}.log")
        row = device_run.unfinished_row(f"{self.label} {name}", code, output, seconds)
        if row is None:
            return output
        self.failed |= code is not None            # stopped by the budget: unchecked, not failed
        self.add(*row)
        return None

    def train(self, flops: float, peak_flops: float | None) -> bool:
        whole = self.work / "whole"
        train = [sys.executable, "train.py", *self.experiment(whole, "--set", "train.max_steps=4")]
        if self.command("train", train) is None:
            return False
        steps = metrics(whole)
        times = [m["step_time_s"] for m in steps[1:]] or [steps[0]["step_time_s"]]     # step 1 warms up
        step = median(times)
        mfu = f"{flops / step / peak_flops:.1%} MFU" if peak_flops else "no peak known"
        self.add(f"{self.label} train step", f"{step:.3f} s", mfu, "ok")
        check = json.loads((whole / "memory_check.json").read_text())
        for stage in check["stages"]:
            peak_row = stage.get("device_peak")
            if peak_row:
                p, m = peak_row["predicted"], peak_row["measured"]
                self.add(f"{self.label} device peak", f"{m / 2**30:.2f} GiB measured",
                         f"plan {p / 2**30:.2f} GiB", f"plan / measured {p / m:.3f}")
            for key in ("model_states", "activations_per_micro_batch"):
                p, m = stage[key]["predicted"], stage[key]["measured"]
                self.add(f"{self.label} {key.replace('_', ' ')}", f"{m:,} B", f"plan {p:,} B",
                         f"{m / p:.4f}")
        return True

    def resume(self, bitwise: bool) -> None:
        """2 steps (a checkpoint at the end), then the same command to step 4: it resumes step 2 (ckpt.keep=1
        deletes it once step 4 is published: at most two checkpoints on the disk at once)."""
        whole, parts = self.work / "whole", self.work / "resumed"
        if self.command("first half", [sys.executable, "train.py",
                                       *self.experiment(parts, "--set", "train.max_steps=2")]) is None:
            return
        if not self.disk_holds_another(parts / "checkpoints"):
            shutil.rmtree(parts / "checkpoints", ignore_errors=True)
            return
        output = self.command("resume", [sys.executable, "train.py",
                                         *self.experiment(parts, "--set", "train.max_steps=4")])
        shutil.rmtree(parts / "checkpoints", ignore_errors=True)
        if output is None:
            return
        want = [m["loss"] for m in metrics(whole)][2:]
        got = [m["loss"] for m in metrics(parts)][2:]
        diff = max(abs(a - b) for a, b in zip(got, want)) if len(got) == len(want) == 2 else float("nan")
        resumed = "resumed from" in output and "at step 2" in output
        verdict = ("bitwise" if got == want else "NOT bitwise") if bitwise else f"max abs diff {diff:.2e}"
        if not resumed or diff != diff or (bitwise and got != want):
            self.failed = True
            verdict += " FAILED"
        self.add(f"{self.label} resume 2 -> 4", " ".join(f"{x:.6f}" for x in got),
                 "uninterrupted " + " ".join(f"{x:.6f}" for x in want), verdict)

    def disk_holds_another(self, checkpoints: Path) -> bool:
        """Whether the disk has room for one more checkpoint the size of those in `checkpoints` (and 1 GiB): the
        resume publishes step 4 before it deletes step 2 (a release-size checkpoint is tens of GB; a lent
        device's disk 64 GiB). A row NOT RUN (disk) where it has not: unchecked, not failed."""
        need = sum(f.stat().st_size for f in checkpoints.rglob("*") if f.is_file())
        free = shutil.disk_usage(checkpoints).free
        if free >= need + 2**30:
            return True
        self.unchecked = True
        self.add(f"{self.label} resume 2 -> 4", f"{free / 2**30:.1f} GiB free on the disk",
                 f"the resume writes another {need / 2**30:.1f} GiB checkpoint beside step 2's", "NOT RUN (disk)")
        return False

    def sample_export_verify(self) -> None:
        whole = self.work / "whole"
        sample = [sys.executable, "-m", "parallel.sample", *self.experiment(whole), "--prompt-embeds", str(self.embeds),
                  "--steps", "2", "--seed", "5", "--out", str(self.work / "sample.safetensors")]
        if self.command("sample", sample) is not None:
            from safetensors.torch import load_file
            latents = load_file(str(self.work / "sample.safetensors"))["latents"]
            finite = bool(latents.isfinite().all())
            self.failed |= not finite
            self.add(f"{self.label} sample 2 steps", f"latents {list(latents.shape)}",
                     "finite" if finite else "NOT finite", "ok" if finite else "FAILED")
        export = self.work / "diffusers"
        if self.command("export", [sys.executable, "-m", "parallel.export", *self.experiment(whole),
                                   "--format", "diffusers", "--out", str(export)]) is None:
            return
        output = self.command("verify", [sys.executable, "-m", "parallel.verify", "--config", self.preset,
                                         "--set", f"model.init_from={export}", "--tolerance", "1e-2"])
        if output is not None:
            found = re.search(r"max relative difference ([0-9.eE+-]+)", output)
            self.add(f"{self.label} export -> diffusers", found.group(0) if found else "?",
                              "diffusers' model from the export, fp32", "ok")
        shutil.rmtree(export, ignore_errors=True)
        shutil.rmtree(whole / "checkpoints", ignore_errors=True)       # the disk for the resume's two


def embeds_for(presets: list[str], work: Path) -> dict[str, Path]:
    import torch
    from safetensors.torch import save_file

    from parallel.experiment.config import load_config
    files = {}
    for preset in presets:
        m = load_config(preset).model
        files[preset] = work / f"{preset}-prompt.safetensors"
        g = torch.Generator().manual_seed(7)
        save_file({"embeds": torch.randn(1, m.max_text_len, m.text_embed_dim, generator=g)}, str(files[preset]))
    return files


def ring_rows(work: Path) -> list[tuple[str, str, str, str]]:
    code, output, _ = run([sys.executable, "-m", "pytest", "-q", "-rs", "tests/unit/test_ring_kernels.py", "-k",
                           "16_bit"], work / "ring.log")
    summary = output.strip().splitlines()[-1] if output.strip() else "?"
    verdict = "NOT RUN (budget)" if output == "NOT RUN (budget)" else "TIMED OUT (budget)" if code is None else \
        "ok" if code == 0 and "skipped" not in summary else "NOT RUN (no CUDA)" if code == 0 else "FAILED"
    row = ("ring attention flash fwd/bwd vs SDPA (bf16, fp16)", summary, "tests/unit/test_ring_kernels.py", verdict)
    print(" | ".join(row), flush=True)
    return [row]


HEADING = "## GPU check\n\n`bash scripts/gpu-check.sh` on a lent GPU (bench/gpu_check.py says what each row is)."


def write_report(text: str, report: Path) -> None:
    """`text` as bench/report.md's "GPU check" section (device_run.write_report between BEGIN and END)."""
    device_run.write_report(text, report, BEGIN, END, HEADING)


def keep(out: Path, text: str, work: Path) -> None:
    """The table and the commands' logs in `out` (the device tool brings back a few files from $OUT)."""
    logs = [(f, str(f.relative_to(work))) for f in sorted(work.rglob("*"))
            if f.suffix in (".log", ".jsonl") or f.name == "memory_check.json"]
    device_run.keep(out, "gpu-check.md", text, tarball="gpu-check-logs.tar.gz", packed=logs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bash scripts/gpu-check.sh", description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the debug presets (runs on CPU): the script's own check")
    ap.add_argument("--presets", default=None, help=f"comma-separated; default {','.join(RELEASE)} "
                                                    f"({','.join(TINY)} with --tiny)")
    device_run.add_run_args(ap, "gpu-check", ROOT / "bench" / "out" / "gpu-check")
    args = ap.parse_args(argv)
    if args.write_report:
        write_report(args.write_report.read_text(), ROOT / "bench" / "report.md")
        print(f"bench/report.md: the GPU check section is {args.write_report}'s table")
        return 0
    global BUDGET
    BUDGET = Budget(args.budget, floor=20.0)
    presets = args.presets.split(",") if args.presets else (TINY if args.tiny else RELEASE)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    card, peak_flops = peak()
    embeds = embeds_for([*presets, "debug"], args.work)
    # the quick checks first: a run the budget cuts short has checked the kernels and bitwise resume
    rows = ring_rows(args.work)
    small = Check("debug", args.work / "fp32", "zero0_fp32", embeds["debug"], label="fp32 debug")
    small.work.mkdir(parents=True)
    if small.train(step_flops("debug"), peak_flops):
        small.resume(bitwise=True)
    rows += [r for r in small.rows if "resume" in r[0] or r[3].startswith(("FAILED", "TIMED OUT", "NOT RUN"))]
    failed, unchecked = small.failed or rows[0][3] == "FAILED", small.unchecked
    for preset in presets:
        (args.work / preset).mkdir()
        check = Check(preset, args.work, "zero1_bf16", embeds[preset])
        if check.train(step_flops(preset), peak_flops):
            check.sample_export_verify()
            check.resume(bitwise=False)
        rows += check.rows
        failed |= check.failed
        unchecked |= check.unchecked
    date = datetime.date.today().isoformat()
    text = table(rows, card, date, "bash scripts/gpu-check.sh" + (" --tiny" if args.tiny else ""))
    print("\n" + text, flush=True)
    if not args.no_report:
        write_report(text, ROOT / "bench" / "report.md")
    if args.out is not None:
        keep(args.out, text, args.work)
    return 1 if failed else 2 if BUDGET.short or unchecked else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
