"""scripts/gpu-check.sh itself, on the debug preset (its --tiny mode, CPU): the commands it runs on a lent GPU
pass here, and its table carries what they measured: a resume equal to the uninterrupted run (bf16 and fp32
bitwise on this CPU), the export that diffusers loads within 1e-4 of the toolkit, the plan against the
engine's bytes. The GPU rows themselves come from a lent device (bench/report.md, "GPU check")."""
import os
import re
import subprocess

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_check_script_runs_its_commands(tmp_path):
    p = subprocess.run(["bash", "scripts/gpu-check.sh", "--tiny", "--presets", "debug", "--no-report",
                        "--work", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    table = p.stdout[p.stdout.index("| what | measured |"):]
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in table.splitlines()[2:] if line}
    assert rows["debug resume 2 -> 4"][2] == "max abs diff 0.00e+00 |"
    assert rows["fp32 debug resume 2 -> 4"][2] == "bitwise |"
    assert float(re.search(r"difference (\S+)", rows["debug export -> diffusers"][0]).group(1)) < 1e-4
    assert 0.95 < float(rows["debug model states"][2].rstrip(" |")) < 1.05
    ran = "ok |" if torch.cuda.is_available() else "NOT RUN (no CUDA) |"
    assert rows["ring attention flash fwd/bwd vs SDPA (bf16, fp16)"][2] == ran
