"""bench/capped.py (`bash scripts/gpu-check.sh --capped`) itself, in its --tiny mode on CPU: both train.py runs finish
through its launcher with the cap refused (cap_memory is False on CPU: no device allocator), no checkpoint written,
and each row of its table carries what the runs wrote (memory_check.json, metrics.jsonl, the launcher's stats).
The device rows come from a lent GPU (bench/report.md, "14B LoRA capped at 24 GiB")."""
import json
import statistics
import time

from bench import capped
from tests.helpers.commands import run_command


def forked(cmd, log):
    """bench/gpu_check.py's `run`, the command forked from the tests' server (tests/helpers/commands.py)."""
    tic = time.perf_counter()
    p = run_command(cmd[1:], timeout=600)
    log.write_text(p.stdout + p.stderr)
    return p.returncode, p.stdout + p.stderr, time.perf_counter() - tic


def test_capped_bench_reports_what_its_runs_measured(tmp_path, monkeypatch, capsys):
    work, out = tmp_path / "work", tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    assert capped.main(["--tiny", "--no-report", "--work", str(work)], runner=forked) == 0
    printed = capsys.readouterr().out
    table = printed[printed.index("| what | measured |"):]
    rows = {r[0]: r[1:] for r in (line.strip("| ").split(" | ") for line in table.splitlines()[2:] if line)}
    stats, steps = {}, {}
    for run in capped.RUNS:
        check = json.loads((work / run / "memory_check.json").read_text())["stages"][0]["model_states"]
        assert rows[f"{run} model states"] == [f"{check['measured']:,} B", f"plan {check['predicted']:,} B",
                                               f"{check['measured'] / check['predicted']:.4f}"]
        times = [json.loads(line)["step_time_s"] for line in (work / run / "metrics.jsonl").read_text().splitlines()]
        assert len(times) == 3
        steps[run] = statistics.median(times[1:])
        assert rows[f"{run} step time"] == [f"{steps[run]:.3f} s", "median of steps 2-3", "ok"]
        stats[run] = json.loads((work / run / "stats.json").read_text())
        assert stats[run]["capped"] is False and stats[run]["status"] == 0
        assert stats[run]["device_peak_reserved"] is None and f"{run} device peak" not in rows     # none on CPU
        assert not (work / run / "checkpoints").exists()
    assert stats["capped"]["cap"] == 24 * 2**30 and stats["uncapped"]["cap"] is None
    assert rows["capped allocator"][2] == "not capped (no device allocator)"
    assert "memory cap: 24.00 GiB, not applied on cpu" in (work / "capped.log").read_text()
    # the capped run has the search's layout (offloaded checkpoint inputs, 3 swapped blocks in host memory): its plan
    # keeps bytes on the host, the uncapped one none
    assert stats["capped"]["host_planned"] > 0 and stats["uncapped"]["host_planned"] == 0
    a, b = steps["capped"], steps["uncapped"]
    assert rows["capped / uncapped step time"] == [f"{a / b:.3f}x", f"{a:.3f} s / {b:.3f} s", "ok"]
    assert json.loads((work / "capped.json").read_text())["results"]["capped"]["step_s"] == a
    assert sorted(p.name for p in out.iterdir()) == ["capped-memory_check.json", "capped.json", "capped.log",
                                                     "capped.md", "uncapped-memory_check.json", "uncapped.log"]
    assert (out / "capped.md").read_text().endswith(table.rstrip("\n") + "\n")


def test_a_returned_table_goes_into_its_own_section(tmp_path, monkeypatch, capsys):
    """--write-report: what a device run left in $OUT (capped.md) replaces the section between capped's markers of
    bench/report.md here, and nothing else of the report."""
    (tmp_path / "bench").mkdir()
    report = tmp_path / "bench" / "report.md"
    report.write_text(f"# Report\n\n{capped.BEGIN}\nNot run yet.\n{capped.END}\n\n## After\n")
    returned = tmp_path / "capped.md"
    returned.write_text("H200, 2026-12-02: `bash scripts/gpu-check.sh --capped`\n\n| what |\n")
    monkeypatch.setattr(capped, "ROOT", tmp_path)
    assert capped.main(["--write-report", str(returned)]) == 0
    assert report.read_text() == f"# Report\n\n{capped.BEGIN}\n{returned.read_text()}{capped.END}\n\n## After\n"


def test_a_run_that_did_not_finish_is_a_row_of_its_own(tmp_path, capsys):
    """A failed run and a stopped one read as gpu_check's and gpu_speed's do (device_run.unfinished_row): the exit,
    the seconds and the last lines, FAILED; stopped, TIMED OUT (budget). The exit status says it."""
    ends = iter([(3, "Traceback\nRuntimeError: CUDA out of memory", 41.0), (None, "step 2", 600.0)])
    assert capped.main(["--tiny", "--no-report", "--work", str(tmp_path / "work"),
                        "--out", str(tmp_path / "out")], runner=lambda cmd, log: next(ends)) == 1
    rows = [r.strip("| ").split(" | ") for r in capsys.readouterr().out.splitlines() if r.startswith("| ") and " run |" in r]
    assert rows == [["capped run", "exit 3 after 41 s", "Traceback RuntimeError: CUDA out of memory", "FAILED"],
                    ["uncapped run", "stopped after 600 s", "step 2", "TIMED OUT (budget)"]]
