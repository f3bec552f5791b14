"""train.float8 as users run it: train.py with float8 emulated trains on CPU; a run without it never imports torchao
(a fresh interpreter: the tests' command server has imported diffusers, which imports torchao when installed);
`python -m bench.fp8 --tiny` prints and writes its table. Marked slow (each command is seconds to tens of seconds)."""
import json
import subprocess
import sys

import pytest

from tests.helpers.commands import ROOT, run_command

pytestmark = pytest.mark.slow

TRAIN = ["train.py", "--config", "debug", "--deepspeed_config", "ds_configs/zero1_bf16.json",
         "--set", "train.micro_batch_size=2", "--set", "train.grad_accum_steps=1", "--set", "train.memory_check=false"]


def _losses(out) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_train_py_with_float8_emulated_trains_on_cpu(tmp_path):
    out = tmp_path / "run"
    p = run_command([*TRAIN, "--set", "train.float8=tensorwise", "--set", "train.float8_emulate=true",
                     "--set", "train.max_steps=12", "--set", f"train.output_dir={out}"])
    assert p.returncode == 0, p.stderr[-3000:]
    losses = _losses(out)
    assert len(losses) == 12 and sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses


def test_training_without_float8_never_imports_torchao(tmp_path):
    program = ("import atexit, runpy, sys; atexit.register(lambda: print('torchao imported:', 'torchao' in "
               "sys.modules)); sys.argv = ['train.py', *sys.argv[1:]]; runpy.run_path('train.py', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", program, *TRAIN[1:], "--set", "train.max_steps=2",
                        "--set", f"train.output_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "torchao imported: False"
    assert len(_losses(tmp_path / "run")) == 2


def test_bench_fp8_tiny_prints_and_writes_its_table(tmp_path):
    p = run_command(["-m", "bench.fp8", "--tiny", "--steps", "6", "--out", tmp_path])
    assert p.returncode == 0, p.stderr[-3000:]
    table = (tmp_path / "fp8.md").read_text()
    assert table.strip() in p.stdout
    rows = {r.split(" | ")[0].lstrip("| "): r.split(" | ")[1:] for r in table.splitlines() if r.startswith("| ")}
    r = json.loads((tmp_path / "fp8.json").read_text())
    assert len(r["bf16"]["losses"]) == len(r["float8"]["losses"]) == 6 and r["float8"]["float8_layers"] == 16
    assert r["bf16"]["losses"][0] != r["float8"]["losses"][0]
    # the table's figures are the runs' (fp8.json): the largest per-step difference, each pair's
    for suffix in ("", " compiled"):
        worst = max(abs(a - b) for a, b in zip(r["bf16" + suffix]["losses"], r["float8" + suffix]["losses"]))
        assert rows[f"largest per-step loss difference{suffix}"][0] == f"{worst:.2e}"
    # compiled with aot_eager (--tiny): the same kernels, so the same losses as eager, bitwise
    assert r["float8 compiled"]["losses"] == r["float8"]["losses"]
    assert r["bf16 compiled"]["losses"] == r["bf16"]["losses"]
