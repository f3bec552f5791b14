"""scripts/gpu-check.sh itself, on the debug preset (its --tiny mode, CPU): the commands it runs on a lent GPU
pass here, and its table carries what they measured: a resume equal to the uninterrupted run (bf16 and fp32
bitwise on this CPU), the export that diffusers loads within 1e-4 of the toolkit, the plan against the
engine's bytes. Its time budget stops and skips commands as it says, and what it writes for the device tool
to bring back is the table it printed. The GPU rows themselves come from a lent device (bench/report.md,
"GPU check")."""
import os
import re
import subprocess
import sys
import tarfile
import time

import pytest
import torch

from bench import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def script(*args, timeout=900):
    p = subprocess.run(["bash", "scripts/gpu-check.sh", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    table = p.stdout[p.stdout.index("| what | measured |"):].rstrip("\n") + "\n" if "| what | measured |" in p.stdout \
        else ""
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in table.splitlines()[2:] if line}
    return p, table, rows


@pytest.mark.slow        # a --tiny run of every command: minutes of CPU (the budget tests below stay quick)
def test_gpu_check_script_runs_its_commands(tmp_path):
    p, table, rows = script("--tiny", "--presets", "debug", "--no-report", "--budget", "3000",
                            "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert rows["debug resume 2 -> 4"][2] == "max abs diff 0.00e+00 |"
    assert rows["fp32 debug resume 2 -> 4"][2] == "bitwise |"
    assert float(re.search(r"difference (\S+)", rows["debug export -> diffusers"][0]).group(1)) < 1e-4
    assert 0.95 < float(rows["debug model states"][2].rstrip(" |")) < 1.05
    ran = "ok |" if torch.cuda.is_available() else "NOT RUN (no CUDA) |"
    assert rows["ring attention flash fwd/bwd vs SDPA (bf16, fp16)"][2] == ran
    # what the device tool brings back: the printed table, and every command's log
    written = (tmp_path / "out" / "gpu-check.md").read_text()
    assert written.endswith(table) and written.splitlines()[0].endswith("`bash scripts/gpu-check.sh --tiny`")
    with tarfile.open(tmp_path / "out" / "gpu-check-logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"ring.log", "fp32/debug/train.log", "fp32/debug/resume.log", "debug/train.log", "debug/sample.log",
            "debug/export.log", "debug/verify.log", "debug/whole/memory_check.json"} <= names


def test_a_spent_budget_runs_nothing_and_says_so(tmp_path):
    p, _, rows = script("--tiny", "--presets", "debug", "--no-report", "--budget", "0",
                        "--work", str(tmp_path / "work"), timeout=300)
    assert p.returncode == 2, (p.stdout + p.stderr)[-4000:]        # nothing failed, nothing checked
    assert rows["ring attention flash fwd/bwd vs SDPA (bf16, fp16)"][2] == "NOT RUN (budget) |"
    assert rows["fp32 debug train"][2] == rows["debug train"][2] == "NOT RUN (budget) |"


def test_a_command_is_stopped_at_the_end_of_the_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "BUDGET", gpu_check.Budget(2.0, floor=0.0))
    tic = time.monotonic()
    code, output, seconds = gpu_check.run([sys.executable, "-c", "import time; print('started', flush=True); "
                                           "time.sleep(60)"], tmp_path / "sleep.log")
    assert code is None and time.monotonic() - tic < 30
    assert output.splitlines()[0] == "started" and output.endswith("TIMED OUT at the end of the time budget (--budget)")
    assert gpu_check.BUDGET.short and (tmp_path / "sleep.log").read_text() == output


def test_a_returned_table_replaces_the_report_section(tmp_path):
    report = tmp_path / "report.md"
    report.write_text(f"# Report\n\n{gpu_check.BEGIN}\nNot run yet.\n{gpu_check.END}\n\n## After\n")
    gpu_check.write_report("H200, 2026-12-01: `bash scripts/gpu-check.sh`\n\n| what |\n", report)
    assert report.read_text() == (f"# Report\n\n{gpu_check.BEGIN}\nH200, 2026-12-01: `bash scripts/gpu-check.sh`\n\n"
                                  f"| what |\n{gpu_check.END}\n\n## After\n")


def test_a_resume_without_disk_for_a_second_checkpoint_is_not_run(tmp_path, monkeypatch, capsys):
    """The resume publishes step 4 beside step 2: without room for one more checkpoint of step 2's size (and 1 GiB)
    on the disk its row says so, unchecked, not failed."""
    checkpoints = tmp_path / "resumed" / "checkpoints" / "step2"
    checkpoints.mkdir(parents=True)
    (checkpoints / "model.bin").write_bytes(b"0" * 3000)
    check = gpu_check.Check("debug", tmp_path, "zero1_bf16", tmp_path / "embeds.safetensors")
    usage = lambda free: (lambda path: type("Usage", (), {"free": free})())
    monkeypatch.setattr(gpu_check.shutil, "disk_usage", usage(3000 + 2**30))
    assert check.disk_holds_another(checkpoints.parent) and not check.rows
    monkeypatch.setattr(gpu_check.shutil, "disk_usage", usage(3000 + 2**30 - 1))
    assert not check.disk_holds_another(checkpoints.parent)
    assert check.rows == [("debug resume 2 -> 4", "1.0 GiB free on the disk",
                           "the resume writes another 0.0 GiB checkpoint beside step 2's", "NOT RUN (disk)")]
    assert check.unchecked and not check.failed
