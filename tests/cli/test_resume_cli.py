"""train.py under the deepspeed launcher: stopped by SIGTERM + resumed equals uninterrupted (losses,
weights and EMA in the final checkpoint), a damaged newest checkpoint is named and the previous one resumed (the
same resume: four launches, one of them the export command), and the export command."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.resume_cli import ROOT, STEPS, clean_env, command, metrics

pytestmark = pytest.mark.cluster       # tests/conftest.py: the real launchers, signals and hosts


def launch(*cmd_args):
    p = subprocess.run(command(*cmd_args), cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p


def interrupted(out, ranks, layout):
    """Start the run, and when it has logged two steps send SIGTERM to every rank (as slurm does)."""
    p = subprocess.Popen(command(["train.py"], out, ranks, layout, "--set", f"train.max_steps={STEPS}"),
                         cwd=ROOT, env=clean_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not ((out / "metrics.jsonl").exists() and len(metrics(out)) >= 2):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[0][-4000:]
        time.sleep(0.05)
    for child in psutil.Process(p.pid).children(recursive=True):
        if any(a.startswith("--local_rank") for a in child.cmdline()):      # the ranks, not the launcher
            child.send_signal(signal.SIGTERM)
    output, _ = p.communicate(timeout=300)
    assert p.returncode == 0, output[-4000:]
    return output


def checkpoint_tensors(folder):
    """Every tensor of every file of a DeepSpeed checkpoint folder: model states, optimizer with EMA."""
    found = {}

    def walk(obj, path):
        if isinstance(obj, torch.Tensor):
            found[path] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}.{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]")

    for f in sorted(folder.glob("*.pt")):
        walk(torch.load(f, map_location="cpu", weights_only=False), f.name)
    return found


# dp 2 x ZeRO-2. tp 2 x dp 2 stopped and resumed under a real launcher is tests/cli/test_netns_hosts.py::test_lost_node's
# rerun (its losses bit for bit); resume at another layout is tests/distributed/test_relayout.py.
RANKS, STAGE, LAYOUT = 2, 2, ["--set", "parallel.tp_size=1"]


def test_sigterm_and_resume_equal_one_uninterrupted_run(tmp_path, capsys):
    ranks, stage, layout = RANKS, STAGE, LAYOUT
    ds = json.load(open(os.path.join(ROOT, "ds_configs/zero0_fp32.json")))
    ds["optimizer"]["type"] = "FusedEmaAdam"
    ds["zero_optimization"] = {"stage": stage}
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for d in (whole, parts):
        d.mkdir()
        (d / "ds.json").write_text(json.dumps(ds))
    launch(["train.py"], whole, ranks, layout, "--set", f"train.max_steps={STEPS}")
    output = interrupted(parts, ranks, layout)
    stopped = len(metrics(parts))
    assert f"stopped by signal after step {stopped};" in output and 2 <= stopped < STEPS
    # A damaged newer checkpoint beside the one the signal wrote (the uninterrupted run's last, a file cut short):
    # named, skipped, and the one before it resumes; the save of that step sets it aside.
    damaged = parts / "checkpoints" / f"step{STEPS}"
    shutil.copytree(whole / "checkpoints" / f"step{STEPS}", damaged)
    victim = next(damaged.glob("*optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    p = launch(["train.py"], parts, ranks, layout, "--set", f"train.max_steps={STEPS}")
    assert f"checkpoint {damaged} is damaged ({victim.name} has" in p.stderr
    assert f"resumed from {parts}/checkpoints/step{stopped} at step {stopped}" in p.stdout
    assert [r["step"] for r in metrics(parts)] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in metrics(parts)] == [r["loss"] for r in metrics(whole)]
    final = [checkpoint_tensors(d / "checkpoints" / f"step{STEPS}") for d in (whole, parts)]
    assert final[0].keys() == final[1].keys() and any("ema" in k for k in final[0])
    for k in final[0]:
        assert torch.equal(final[0][k], final[1][k]), k

    # Export: full fp32 weights and EMA (tp shards are gathered by the same full_state, tests/distributed/test_ema_layouts.py).
    # From another output_dir it is refused, naming ckpt.dir (was a traceback); the advice followed exports.
    from parallel.export import main as export_main
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(parts / "ds.json", elsewhere / "ds.json")
    argv = command(["x"], elsewhere, ranks, layout, "--out", str(parts / "export"))[6:]      # after "x"
    assert export_main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"python -m parallel.export refused (1 problem):\n  - no complete checkpoint in "
                          f"{elsewhere}/checkpoints (ckpt.dir") \
        and "--set ckpt.dir=DIR" in err
    launch(["--module", "parallel.export"], elsewhere, ranks, layout, "--out", str(parts / "export"),
           "--set", f"ckpt.dir={parts / 'checkpoints'}")
    model, ema = (load_file(parts / "export" / f"{n}.safetensors") for n in ("model", "ema"))
    assert model.keys() == ema.keys() and model["blocks.3.attn.to_qkv.weight"].shape == (3 * 64, 64)
    assert not torch.equal(model["blocks.0.ff_in.weight"], ema["blocks.0.ff_in.weight"])
    # What DeepSpeed users run first: the zero_to_fp32.py DeepSpeed copies beside the checkpoints gives the
    # export's model tensors, under the same names, at this layout (pp 1, tp 1, ZeRO-2; docs/training.md#export
    # says where it does not work)
    subprocess.run([sys.executable, str(parts / "checkpoints" / "zero_to_fp32.py"), str(parts / "checkpoints"),
                    str(tmp_path / "zero_to_fp32"), "-t", f"step{STEPS}", "--safe_serialization"],
                   check=True, capture_output=True, cwd=ROOT)
    theirs = load_file(tmp_path / "zero_to_fp32" / "model.safetensors")
    assert theirs.keys() == model.keys() and all(torch.equal(theirs[k], model[k]) for k in model)
