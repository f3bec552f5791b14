"""The user's commands on a LoRA run whose checkpoints leave the base in its release (ckpt.lora_base: release, the
default with model.init_from; parallel/checkpoints/lora_base.py), on the sharded CogVideoX release of
tests/helpers/released_weights.py: train.py 2 steps with a checkpoint, train.py again to step 4 (resumed over the
release), `parallel.export --format diffusers --merge-lora` (the base read from the release: the merged transformer
predicts as diffusers with peft's adapters folded in, which tests/distributed/test_lora.py checks; here its base
tensors equal the release's where no adapter sits), `parallel.sample` of the checkpoint (model.init_from unset: the
base read from the recorded release) equal to that of the merged export, and with the release moved away `--format diffusers-lora` still
exports the adapters (model.init_from unset: no base read) while train.py without model.init_from, reading the
recorded path, refuses the resume by name (exit 1, no traceback), and resumes once model.init_from names the release
where it now is."""
import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.commands import run_command
from tests.helpers.released_weights import overrides, released_model

POS = "sincos"


def _args(release, out, *more):
    sets = [*overrides(POS, release), "model.lora.rank=4", "train.warmup_steps=0", f"train.output_dir={out}",
            "ckpt.every=2", *more]
    return ["--config", "debug", "--deepspeed_config", "ds_configs/zero0_fp32.json",
            *[a for s in sets for a in ("--set", s)]]


def test_a_lora_run_resumes_exports_and_refuses_over_its_release(tmp_path):
    release, out = tmp_path / "release", tmp_path / "run"
    model = released_model(POS)
    model.save_pretrained(release, max_shard_size="20KB")
    p = run_command(["train.py", *_args(release, out, "train.max_steps=2")])
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    marker = json.loads((out / "checkpoints" / "step2" / "complete.json").read_text())
    assert marker["lora_base"]["init_from"] == str(release) and len(marker["lora_base"]["files"]) > 1

    p = run_command(["train.py", *_args(release, out, "train.max_steps=4")])
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert f"resumed from {out}/checkpoints/step2 at step 2" in p.stdout

    merged = tmp_path / "merged"
    p = run_command(["-m", "parallel.export", *_args(release, out), "--format", "diffusers", "--merge-lora",
                     "--out", str(merged)])
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    exported = {k: v for f in merged.glob("*.safetensors") for k, v in load_file(f).items()}
    ours = model.state_dict()
    untouched = [k for k in exported if "attn1" not in k]           # the adapters sit on the attention's layers
    assert untouched and all(torch.equal(exported[k], ours[k].float()) for k in untouched)
    assert not all(torch.equal(exported[k], ours[k].float()) for k in exported), "the adapters were not merged"

    # parallel.sample of the checkpoint (model.init_from unset: the base from the recorded release) = of the export
    save_file({"embeds": torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(7))}, str(tmp_path / "p.st"))
    sample = ["--prompt-embeds", str(tmp_path / "p.st"), "--steps", "2", "--seed", "5", "--guidance", "1"]
    for name, weights in (("ckpt", "null"), ("merged", merged)):
        p = run_command(["-m", "parallel.sample", *_args(release, out, f"model.init_from={weights}"), *sample,
                         "--out", str(tmp_path / f"{name}.safetensors")])
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    torch.testing.assert_close(load_file(tmp_path / "ckpt.safetensors")["latents"],
                               load_file(tmp_path / "merged.safetensors")["latents"])

    moved = tmp_path / "moved"
    shutil.move(release, moved)
    p = run_command(["-m", "parallel.export", *_args(release, out, "model.init_from=null"), "--format", "diffusers-lora",
                     "--out", str(tmp_path / "adapters")])
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert (tmp_path / "adapters" / "pytorch_lora_weights.safetensors").is_file()
    p = run_command(["train.py", *_args(release, out, "train.max_steps=6", "model.init_from=null")])
    assert p.returncode == 1 and "Traceback" not in p.stderr, (p.stdout + p.stderr)[-3000:]
    assert "holds a LoRA run's adapters and their optimizer states, not its frozen base" in p.stderr
    assert f"{release}/" in p.stderr and "does not exist" in p.stderr and "Set model.init_from to that release" in \
        p.stderr, p.stderr[-3000:]
    # followed, the advice works: the release where it is now
    p = run_command(["train.py", *_args(moved, out, "train.max_steps=6")])
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert f"resumed from {out}/checkpoints/step4 at step 4" in p.stdout
