"""bench/gpu_speed.py (`bash scripts/gpu-check.sh --speed`) itself, in its --tiny mode on CPU: every command it runs on a
lent GPU (step_phases eager and compiled, the peer rows with compiled blocks) finishes on the debug presets, each row of
its table carries what its command wrote (result.json), and what it leaves under --out is that table, those results,
the trace and the logs. A spent budget runs nothing and says so. The device figures come from a lent GPU
(bench/report.md, "GPU speed")."""
import json
import tarfile

import pytest

from bench import gpu_speed
from tests.helpers.commands import run_command


def forked(cmd, timeout):
    """device_run.subprocess_run, the command forked from the tests' server (tests/helpers/commands.py)."""
    return run_command(cmd[1:], timeout=timeout)


def table_rows(printed: str) -> tuple[str, dict]:
    table = printed[printed.index("| what | measured |"):]
    table = table[:table.index("\n\n")] + "\n" if "\n\n" in table else table
    return table, {r[0]: r[1:] for r in (line.strip("| ").split(" | ") for line in table.splitlines()[2:] if line)}


@pytest.mark.slow        # a --tiny run of every command: minutes of CPU (the budget tests below stay quick)
def test_gpu_speed_rows_carry_what_its_commands_measured(tmp_path, capsys):
    work, out = tmp_path / "work", tmp_path / "out"
    # fp8 (bench/fp8.py's own test times it) left out for the suite's time; the failing test below sees it started
    only = "phases,peer-cogvideox,compiled,peer-wan"
    assert gpu_speed.main(["--tiny", "--only", only, "--no-report", "--work", str(work), "--out", str(out)],
                          execute=forked) == 0
    table, rows = table_rows(capsys.readouterr().out)
    phases = json.loads((work / "phases" / "result.json").read_text())
    assert rows["phases debug whole step"][0] == f"{phases['step_s']:.3f} s"
    assert rows["phases debug whole step"][1].startswith("MFU: no device peak on CPU")
    for name, s in phases["phases_s"].items():
        assert rows[f"phases debug phase {name}"][:2] == [f"{s:.4f} s", f"{s / phases['step_s']:.1%} of the step"]
    assert rows["phases debug blocks (hooked pass)"][0] == f"{phases['blocks_s']:.4f} s"
    trace = work / "phases" / "trace" / "step.json.gz"
    assert rows["phases debug trace (one step)"][0] == f"step.json.gz {trace.stat().st_size / 2**20:.1f} MiB"
    assert (out / "phases-step.json.gz").read_bytes() == trace.read_bytes()
    compiled = json.loads((work / "compiled" / "result.json").read_text())
    assert "train.compile=true" in compiled["overrides"] and len(compiled["warmup_s"]) == 2
    assert rows["compiled (aot_eager) step"][:2] == [
        f"{compiled['step_s']:.3f} s",
        f"eager {phases['step_s']:.3f} s: compiled / eager {compiled['step_s'] / phases['step_s']:.3f}"]
    excess = sum(w - compiled["step_s"] for w in compiled["warmup_s"])
    assert rows["compiled (aot_eager) compile time"][0] == f"{excess:.1f} s"
    for name, family, tokens in (("peer-cogvideox", "cogvideox", 416), ("peer-wan", "wan", 400)):
        r = json.loads((work / name / "result.json").read_text())
        row, c = r["row"], r["compiled"]
        label = f"{name} {family} mid (256 hidden, {tokens:,} tokens)"
        assert rows[f"{label} train step, toolkit / diffusers"][0] == \
            f"{row['train_toolkit_s'] * 1e3:.1f} / {row['train_diffusers_s'] * 1e3:.1f} ms"
        assert row["max_abs_diff"] < 1e-4 and c["max_abs_diff_vs_eager"] < 1e-4      # same weights, same inputs
        assert rows[f"{label} saved for backward, toolkit / diffusers"][1] == f"ratio {row['saved_ratio']:.3f}"
        assert rows[f"{label} compiled blocks (aot_eager) train step"][0] == f"{c['train_compiled_s'] * 1e3:.1f} ms"
        assert f"compile {c['compile_s']:.1f} s" in rows[f"{label} compiled blocks (aot_eager) train step"][1]
        assert c["blocks_compiled"] == 4 and c["graph_breaks"] == 0    # rotary included (test_rope_compile.py)
        assert json.loads((out / f"{name}.json").read_text()) == r
    written = (out / "gpu-speed.md").read_text()
    assert written.endswith(table) and written.splitlines()[0].endswith(f"`bash scripts/gpu-check.sh --speed --tiny "
                                                                        f"--only {only}`")
    with tarfile.open(out / "gpu-speed-logs.tar.gz") as tar:
        assert {"phases.log", "peer-cogvideox.log", "compiled.log", "peer-wan.log"} <= set(tar.getnames())


def test_hardware_flops_count_the_recomputed_forward():
    """The 5B's step with every block recomputed does its blocks' forward twice: just under 4/3 of the model FLOPs
    (the patch embedding, text projection and final layer are not recomputed)."""
    factor = gpu_speed.recompute_factor("cogvideox-5b")
    assert 1.33 < factor < 4 / 3


def test_a_spent_budget_runs_nothing_and_says_so(tmp_path, capsys):
    assert gpu_speed.main(["--tiny", "--no-report", "--budget", "0", "--work", str(tmp_path)], execute=forked) == 2
    _, rows = table_rows(capsys.readouterr().out)
    for name in ("phases", "peer-cogvideox", "compiled", "peer-wan"):
        assert rows[name] == ["-", "-", "NOT RUN (budget)"]


def test_a_failed_command_ends_only_its_rows(tmp_path, capsys):
    """Each command fails (an out-of-memory, say): every later one still runs, each row says which failed and how."""
    import subprocess
    ran = []

    def failing(cmd, timeout):
        ran.append(cmd[2])
        return subprocess.CompletedProcess(cmd, 1, "", "torch.OutOfMemoryError: CUDA out of memory | tried 9 GiB")
    out = tmp_path / "out"
    assert gpu_speed.main(["--tiny", "--no-report", "--work", str(tmp_path / "work"), "--out", str(out)],
                          execute=failing) == 1
    _, rows = table_rows(capsys.readouterr().out)
    assert ran == ["bench.step_phases", "bench.peer_release", "bench.step_phases", "bench.peer_release", "bench.fp8"]
    for name in ("phases", "peer-cogvideox", "compiled", "peer-wan", "fp8"):
        assert rows[name][1:] == ["torch.OutOfMemoryError: CUDA out of memory / tried 9 GiB", "FAILED"]
    assert (out / "gpu-speed.md").exists()
