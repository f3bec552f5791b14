"""What the device runs share (bench/gpu_check.py, bench/capped.py, bench/gpu_speed.py): a lent device's time.

A lent device gives a session 15 minutes and one command 10, and brings back what the command leaves under $OUT.
So a device run is a list of commands under one `Budget`; `run` starts a command only while the budget holds it,
stops it at the budget's end, keeps its output in a log and prints its seconds; the rows go into one `table`
(the card, the date, the command typed), `write_report` puts the table between a section's markers in
bench/report.md, and `keep` leaves the table, files and logs under $OUT for the device tool to bring back.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Budget:
    """The run's deadline. A command starts only while `floor` seconds are left (a train.py process needs its
    imports, its model and a step before it measures anything) and is stopped when the budget ends."""

    def __init__(self, seconds: float, floor: float):
        self.end, self.floor = time.monotonic() + seconds, floor
        self.short = False          # something was not checked for want of time

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self) -> bool:
        if self.left() < self.floor:
            self.short = True
            return False
        return True


def add_run_args(ap, name: str, work: Path, budget: bool = True) -> None:
    """The options every device script takes (`name`: gpu-check, gpu-speed, ...; its table is `name`.md): --work,
    --budget, --out (default $OUT, the device tool's folder that comes back), --no-report and --write-report."""
    ap.add_argument("--work", type=Path, default=work, help="scratch folder (emptied)")
    if budget:
        ap.add_argument("--budget", type=float, default=540.0, metavar="SECONDS",
                        help="the whole run's time; commands it no longer holds are not run (default 540)")
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                    help=f"also write {name}.md and the commands' logs here (default $OUT, when set)")
    ap.add_argument("--no-report", action="store_true", help="print the table only")
    ap.add_argument("--write-report", type=Path, metavar="TABLE",
                    help=f"put a table a device run wrote (its {name}.md) into bench/report.md, and stop")


def subprocess_run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """A command in a fresh process in the repository root, its output captured (TimeoutExpired at `timeout`)."""
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def run(cmd: list[str], log: Path, budget: Budget, tag: str, execute=subprocess_run) -> tuple[int | None, str, float]:
    """(exit code, output, seconds) of one command, its output kept in `log`; code None: not started (the
    budget no longer holds it, seconds 0.0) or stopped at the budget's end. `execute(cmd, timeout)` runs it
    (a CompletedProcess; subprocess.TimeoutExpired when stopped): a test forks it from a preloaded server."""
    if not budget.allows():
        log.write_text("not run: the time budget (--budget) was spent\n")
        return None, "NOT RUN (budget)", 0.0
    tic = time.perf_counter()
    try:
        p = execute(cmd, max(budget.left(), 1.0))
        code, output = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        budget.short = True
        code = None
        output = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                         for x in (e.stdout, e.stderr)) + "\nTIMED OUT at the end of the time budget (--budget)"
    seconds = time.perf_counter() - tic
    log.write_text(output)
    print(f"[{tag}] {log.stem}: {'exit ' + str(code) if code is not None else output.splitlines()[-1]} "
          f"after {seconds:.0f} s ({budget.left():.0f} s of the budget left)", flush=True)
    return code, output, seconds


def tail_cell(output: str) -> str:
    """A failed command's last lines as one table cell (a '|' would split the markdown row)."""
    return " ".join(output.strip().splitlines()[-3:])[-300:].replace("|", "/")


def unfinished_row(what: str, code: int | None, output: str, seconds: float) -> tuple[str, str, str, str] | None:
    """The table row of a command `run` gave back unfinished (None where it exited 0): not started for the budget,
    stopped at its end, or failed with its last lines."""
    if code == 0:
        return None
    if code is None and seconds == 0.0:
        return what, "-", "-", "NOT RUN (budget)"
    if code is None:
        return what, f"stopped after {seconds:.0f} s", tail_cell(output), "TIMED OUT (budget)"
    return what, f"exit {code} after {seconds:.0f} s", tail_cell(output), "FAILED"


def median(values) -> float:
    """The one median of the device runs' step times (statistics.median: the mean of the middle two)."""
    return statistics.median(values)


def metrics(out: Path) -> list[dict]:
    """train.py's metrics.jsonl in `out`: one dict a step."""
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if '"loss"' in line] if path.exists() else []


def peak() -> tuple[str, float | None]:
    """The device's name and its dense bf16 peak FLOP/s (None where unknown; bench/device.py)."""
    from bench.device import device_and_dtype, peak_flops
    found = peak_flops(*device_and_dtype())
    return found["name"], found["flops"]


def table(rows, card: str, date: str, command: str) -> str:
    lines = [f"{card}, {date}: `{command}`", "", "| what | measured | compared with | verdict |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(r)} |" for r in rows]
    return "\n".join(lines) + "\n"


def write_report(text: str, report: Path, begin: str, end: str, heading: str) -> None:
    """`text` between the markers `begin` and `end` of `report`, replacing what was there; a section of its own
    (`heading`, then the markers) at the end where the markers are missing."""
    section = f"{begin}\n{text}{end}"
    old = report.read_text() if report.exists() else ""
    if begin in old and end in old:
        new = old[:old.index(begin)] + section + old[old.index(end) + len(end):]
    else:
        new = old.rstrip("\n") + "\n\n" + heading + "\n\n" + section + "\n"
    report.write_text(new)


def keep(out: Path, name: str, text: str, copies=(), tarball: str | None = None, packed=()) -> None:
    """The table as out/name, each (source, name) of `copies` that exists copied into `out`, and with `tarball`
    each (source, name inside) of `packed` in out/tarball (gzip): what the device tool brings back from $OUT."""
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(text)
    for src, dest in copies:
        if Path(src).exists():
            shutil.copy(src, out / dest)
    if tarball is not None:
        with tarfile.open(out / tarball, "w:gz") as tar:
            for src, inside in packed:
                tar.add(src, arcname=inside)
