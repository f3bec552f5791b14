"""Wan 2.2 TI2V-5B as a user runs it, on the tiny preset: `python -m parallel.prepare_data` (its main, the same
argv) on generated videos with a tiny AutoencoderKLWan of the 2.2 kind (patch_size 2, 16 x 16 spatial) and a tiny
UMT5, then `train.py` (as `python` runs it, forked by tests/helpers/commands.py) on the prepared folder for 2 steps
from a tiny released transformer:

  - each clip's stored latent is the VAE's (posterior mode, normalised) of its 9 frames, and the picture latent
    stored beside it the VAE's of the first frame alone (what WanImageToVideoPipeline conditions on);
  - train.py's first loss equals the same batch (training_batches over the prepared folder: the stored picture
    latent in frame 0 at t = 0) through the one-process model loaded from the same release, and through
    diffusers' WanTransformer3DModel with the first frame out of the loss.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

from parallel.experiment.config import load_config
from parallel.prepare_data.frames import frame_indices
from parallel.prepare_data.prepare import main
from tests.helpers.commands import run_command
from tests.helpers.prepare_data import lines, videos  # noqa: F401  (fixture: generated clips)
from tests.helpers.prepare_data_wan import umt5_dir  # noqa: F401  (fixture: tiny UMT5, d_model 32)
from tests.helpers.wan22_ti2v import PRESET, released_ti2v, vae_and_picture  # noqa: F401  (fixtures)

# 9 x 32 x 32 pixels -> latents [8, 3, 2, 2] (16 x 16 spatial, 4 x temporal) -> 3 tokens of 2 x 2 patches
SETS = ["data.height=32", "data.width=32"]


@pytest.fixture(scope="module")
def ti2v_vae_dir(vae_and_picture, tmp_path_factory):
    path = tmp_path_factory.mktemp("wan22_vae")
    vae_and_picture[0].save_pretrained(path)
    return path


def test_prepared_clips_train_as_the_one_process_model(videos, ti2v_vae_dir, umt5_dir, released_ti2v,
                                                        tmp_path):
    from diffusers import AutoencoderKLWan

    from models.wan.ti2v import token_timesteps
    from parallel.model.build import build_model
    from parallel.distributed.topology import ParallelContext
    from parallel.train.run import build_dataset, training_batches
    from parallel.weights.diffusers import load_released

    root, frames = videos
    out = tmp_path / "prepared"
    sets = [a for s in SETS for a in ("--set", s)]
    assert main(["--config", PRESET, *sets, "--videos", str(root), "--captions", str(root / "captions.csv"),
                 "--vae", str(ti2v_vae_dir), "--t5", str(umt5_dir), "--out", str(out), "--posterior", "mode"]) == 0
    manifest = lines(out / "manifest.jsonl")
    assert [m["video"] for m in manifest] == ["a0.mkv", "a1.mkv", "sub/b.mp4"]       # bad.mp4 left out
    vae = AutoencoderKLWan.from_pretrained(ti2v_vae_dir).eval()
    mean = torch.tensor(vae.config.latents_mean).view(-1, 1, 1, 1)
    inv_std = 1 / torch.tensor(vae.config.latents_std).view(-1, 1, 1, 1)
    for m in manifest[:2]:
        # Lossless 32 x 48 clips: 9 frames spread over the video, the middle 32 columns, in [-1, 1].
        clip = frames[m["video"]][frame_indices(len(frames[m["video"]]), 9)][:, :, 8:40]
        x = torch.from_numpy(clip).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
        with torch.no_grad():
            want = (vae.encode(x).latent_dist.mode()[0] - mean) * inv_std
            picture = (vae.encode(x[:, :, :1]).latent_dist.mode()[0] - mean) * inv_std
        stored = load_file(out / m["latent"])
        assert stored["latent"].shape == (8, 3, 2, 2) and picture.shape == (8, 1, 2, 2)
        torch.testing.assert_close(stored["latent"], want)
        torch.testing.assert_close(stored["image"], picture)

    run = tmp_path / "run"
    train = ["--set", "data.kind=directory", "--set", f"data.path={out}", "--set", f"model.init_from={released_ti2v[0]}",
             "--set", "train.max_steps=2", "--set", "train.grad_accum_steps=1", "--set", f"train.output_dir={run}"]
    p = run_command(["train.py", "--config", PRESET, "--deepspeed_config", "ds_configs/zero0_fp32.json", *sets, *train])
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2

    cfg = load_config(PRESET, SETS + [a for a in train if a != "--set"])
    ctx, dataset = ParallelContext.single(), build_dataset(cfg)
    batches = training_batches(cfg, ctx, dataset)
    (x_t, t, text), target = next(batches)
    assert x_t.shape == target.shape == (2, 8, 3, 2, 2) and t.shape == (2, 3, 2, 2)
    # frame 0: the stored picture latents, at t = 0
    pictures = torch.stack([dataset[batches.sample_index(p)][2] for p in (0, 1)])
    assert torch.equal(x_t[:, :, :1], pictures) and (t[:, 0] == 0).all() and (t[:, 1:] > 0).all()
    model = build_model(cfg, {}, ctx)
    load_released(model, ctx, cfg.model, cfg.model.init_from)
    with torch.no_grad():
        loss = model((x_t, t, text), target)
        # diffusers' transformer with its timestep per token [B, S], the first frame out of the loss
        pred = released_ti2v[1](hidden_states=x_t, timestep=token_timesteps(t, cfg.model, (3, 1, 1)),
                                encoder_hidden_states=text).sample
    torch.testing.assert_close(loss, torch.nn.functional.mse_loss(pred[:, :, 1:], target[:, :, 1:]))
    torch.testing.assert_close(torch.tensor(losses[0], dtype=torch.float64), loss.double(), rtol=1e-6, atol=0)
