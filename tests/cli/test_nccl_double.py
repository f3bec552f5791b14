"""Every command's collectives carried by the process group the toolkit creates on CUDA, on this CPU machine.

NCCL (and HCCL) carry no CPU tensor; host-side agreement (checkpoint verdicts, CRC lists, the anomaly flag, the
layout-free copy's key lists, pickled objects) passes CPU tensors. On the first H200 run every checkpoint save
failed with "No backend type associated with device type cpu", which gloo-only CI could not see. Here the
commands run with tests/cli/nccl_double/ first on PYTHONPATH: each rank's process group is created as
`accelerator.backend_for("cuda")` says, with NCCL replaced by a double registered for CUDA tensors only
(see its docstring). With the backend "nccl" alone (the code before the fix) the first CPU collective fails as on
the GPU and this test fails at its first command; with "cpu:gloo,cuda:nccl" every command passes.

One 2-rank sequence through the user's commands (the deepspeed launcher), each rank under the double:
- train.py at tp 2 with EMA (fp32, ZeRO-2), validation, sample videos, the anomaly guard, the TP replica check and two
  checkpoints (save, CRC agreement, disk-space agreement, the layout-free copy);
- train.py again at dp 2: the checkpoint resumed at another layout (verified CRCs, relayout), one more step;
- parallel.export --format diffusers from it, then parallel.verify of that folder at tp 2 (diffusers' own
  prediction against the toolkit's: exit 0 below 1e-4), and parallel.sample from the checkpoint at dp 2,
  equal to one process sampling the exported folder.
"""
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file

from tests.dist_utils import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOUBLE = os.path.join(ROOT, "tests", "cli", "nccl_double")
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")


def run(tmp_path, name, *args, ranks=2):
    log = tmp_path / "double.log"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", VDP_NCCL_DOUBLE_LOG=str(log),
               PYTHONPATH=os.pathsep.join([DOUBLE, ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    launcher = [DEEPSPEED, "--num_gpus", str(ranks), "--master_port", str(free_port())] if ranks > 1 else \
        [sys.executable]
    p = subprocess.run([*launcher, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = p.stdout + p.stderr
    (tmp_path / f"{name}.log").write_text(output)
    assert p.returncode == 0, f"{name} under the NCCL double:\n{output[-5000:]}"
    return output


def test_every_command_under_the_process_group_of_cuda(tmp_path):
    out = tmp_path / "run"
    ds = json.load(open(os.path.join(ROOT, "ds_configs", "zero0_fp32.json")))      # fp32: samples compare exactly
    ds["optimizer"]["type"], ds["zero_optimization"] = "FusedEmaAdam", {"stage": 2}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    experiment = ["--config", "debug", "--deepspeed-config", str(tmp_path / "ds.json"), "--set", f"train.output_dir={out}",
                  "--set", "train.warmup_steps=0", "--set", "train.micro_batch_size=1",
                  "--set", "train.grad_accum_steps=2"]
    train = ["train.py", *experiment, "--set", "ckpt.every=2", "--set", "val.every=2", "--set", "val.num_samples=2",
             "--set", "val.num_prompts=1", "--set", "val.sample_steps=2", "--set", "val.use_ema=true",
             "--set", "train.anomaly.action=skip", "--set", "train.check_replicas_every=1"]
    log = run(tmp_path, "train-tp2", *train, "--set", "parallel.tp_size=2", "--set", "train.max_steps=3")
    assert "validation loss" in log
    log = run(tmp_path, "train-dp2", *train, "--set", "parallel.tp_size=1", "--set", "train.max_steps=4")
    assert f"resumed from {out}/checkpoints/step3 at step 3" in log, log[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if line.startswith("{") and '"loss"' in line]
    assert steps == [1, 2, 3, 4]

    # Every rank of every command above created its group through the double, as on CUDA.
    created = (tmp_path / "double.log").read_text().split("\n")[:-1]
    assert len(created) == 4 and {line.split()[1] for line in created} == {"cpu:gloo,cuda:vdp_nccl_double"}

    dp2 = [*experiment, "--set", "parallel.tp_size=1"]
    export = tmp_path / "diffusers"
    log = run(tmp_path, "export", "--module", "parallel.export", *dp2, "--format", "diffusers", "--out", str(export))
    log = run(tmp_path, "verify", "--module", "parallel.verify", "--config", "debug", "--set", "parallel.tp_size=2",
              "--set", f"model.init_from={export}")
    assert "max relative difference" in log

    g = torch.Generator().manual_seed(7)
    save_file({"embeds": torch.randn(1, 8, 32, generator=g)}, str(tmp_path / "prompt.safetensors"))
    sample = ["--prompt-embeds", str(tmp_path / "prompt.safetensors"), "--steps", "2", "--seed", "5"]
    run(tmp_path, "sample", "--module", "parallel.sample", *dp2, *sample, "--out", str(tmp_path / "ckpt.safetensors"))
    run(tmp_path, "sample-export", "-m", "parallel.sample", *experiment, "--set", f"model.init_from={export}", *sample, "--out", str(tmp_path / "export.safetensors"), ranks=1)
    torch.testing.assert_close(load_file(str(tmp_path / "ckpt.safetensors"))["latents"],
                               load_file(str(tmp_path / "export.safetensors"))["latents"])
