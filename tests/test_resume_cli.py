"""train.py under the deepspeed launcher: interrupted + resumed equals uninterrupted; export of any layout."""
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT = ["--set", "parallel.tp_size=2", "--set", "train.warmup_steps=0", "--set", "train.decay_steps=6"]


def launch(module_or_script, out, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [deepspeed, "--num_gpus", "2", "--master_port", str(29500 + os.getpid() % 1000), *module_or_script,
           "--config", "debug", "--deepspeed_config", str(out / "ds.json"), *LAYOUT,
           "--set", f"train.output_dir={out}", *args]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_resume_and_export(tmp_path):
    ds = json.load(open(os.path.join(ROOT, "ds_configs/zero0_fp32.json")))
    ds["optimizer"]["type"] = "FusedEmaAdam"
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for d in (whole, parts):
        d.mkdir()
        (d / "ds.json").write_text(json.dumps(ds))
    launch(["train.py"], whole, "--set", "train.max_steps=6")
    launch(["train.py"], parts, "--set", "train.max_steps=4", "--set", "ckpt.every=2")
    assert sorted(os.listdir(parts / "checkpoints")) == ["latest", "step2", "step4"]
    p = launch(["train.py"], parts, "--set", "train.max_steps=6")
    assert "resumed from" in p.stdout and "at step 4" in p.stdout
    assert [r["loss"] for r in metrics(parts)] == [r["loss"] for r in metrics(whole)]
    assert [r["step"] for r in metrics(parts)] == [1, 2, 3, 4, 5, 6]

    launch(["--module", "parallel.export"], whole, "--out", str(whole / "export"))
    launch(["--module", "parallel.export"], parts, "--out", str(parts / "export"))
    for name in ("model", "ema"):
        a, b = load_file(whole / "export" / f"{name}.safetensors"), load_file(parts / "export" / f"{name}.safetensors")
        assert a.keys() == b.keys() and "blocks.3.attn.to_qkv.weight" in a
        assert a["blocks.3.attn.to_qkv.weight"].shape == (3 * 64, 64)            # tp shards gathered
        for k in a:
            assert torch.equal(a[k], b[k]), f"{name} {k}"
    model, ema = load_file(whole / "export" / "model.safetensors"), load_file(whole / "export" / "ema.safetensors")
    assert not torch.equal(model["blocks.0.ff_in.weight"], ema["blocks.0.ff_in.weight"])
