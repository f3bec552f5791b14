"""The helpers and fixtures of tests/cli/test_family_matrix.py that other test modules use too: `experiment_args`,
`in_process`, `launch`, `run_module`, `sample_args` (a test module imports no other test module)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import torch
from safetensors.torch import save_file

from parallel.experiment.config import load_config
from tests.helpers.launchers import finish, run_env, start
from tests.dist_utils import free_port


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")
STEPS = 2


def ds_config(tmp_path, stage: int) -> str:
    path = tmp_path / f"zero{stage}_fp32.json"
    if not path.exists():
        ds = json.load(open(os.path.join(ROOT, "ds_configs/zero0_fp32.json")))
        ds["zero_optimization"] = {"stage": stage}
        path.write_text(json.dumps(ds))
    return str(path)


def experiment_args(preset, tmp_path, name, layout) -> list[str]:
    _, overrides, stage = layout
    args = ["--config", preset, "--deepspeed_config", ds_config(tmp_path, stage),
            "--set", "train.grad_accum_steps=2", "--set", f"train.max_steps={STEPS}", "--set", "train.warmup_steps=0",
            "--set", f"train.output_dir={tmp_path / name}"]
    for o in overrides:
        args += ["--set", o]
    return args


def launch(tmp_path, name, layout, *command, log_name):
    """`deepspeed --num_gpus N <command>` (N = 1: plain `python <command>`); its log, asserting exit 0."""
    n = layout[0]
    log = tmp_path / f"{name}.{log_name}.log"
    if n == 1:
        cmd = [sys.executable, *command]
    else:
        cmd = [DEEPSPEED, "--num_gpus", str(n), "--master_port", str(free_port()), *command]
    code, = finish([start(cmd, log, run_env())], str(tmp_path / name), timeout=300)
    text = log.read_text()
    assert code == 0, f"{' '.join(cmd)}\n{text[-4000:]}"
    return text


def run_module(tmp_path, name, layout, mod, *args, log_name):
    """`python -m mod` for one process, `deepspeed --module mod` for more (the same argv after it)."""
    if layout[0] == 1:
        return launch(tmp_path, name, layout, "-m", mod, *args, log_name=log_name)
    return launch(tmp_path, name, layout, "--module", mod, *args, log_name=log_name)


def in_process(main, argv) -> tuple[int, str]:
    """A command's main(argv) as `python -m` runs it: exit code and stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def sample_args(tmp_path, preset, name) -> list[str]:
    cfg = load_config(preset)
    embeds = tmp_path / "prompt.safetensors"
    if not embeds.exists():
        g = torch.Generator().manual_seed(7)
        m = cfg.model
        save_file({"embeds": torch.randn(2, m.max_text_len, m.text_embed_dim, generator=g)}, str(embeds))
        save_file({"embeds": torch.zeros(1, m.max_text_len, m.text_embed_dim)}, str(tmp_path / "negative.safetensors"))
    return ["--prompt-embeds", str(embeds), "--negative-embeds", str(tmp_path / "negative.safetensors"),
            "--steps", "3", "--guidance", "3", "--seed", "5", "--out", str(tmp_path / name / "sample.safetensors")]
