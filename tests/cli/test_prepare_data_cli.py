"""`python -m parallel.prepare_data` as users run it: two ranks split the videos (forked with torchrun's
environment by tests/helpers/commands.py; the real launchers are tested in test_launchers.py /
test_netns_hosts.py), and every training module imports without the [data] extra, in a fresh process (split from
tests/unit/test_prepare_data.py, which runs the same preparation in-process and provides the fixtures)."""
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.helpers.commands import run_command
from tests.helpers.prepare_data import SETS, lines, prepared, vae_dir, videos  # noqa: F401  (fixtures)
from tests.helpers.text_encoder import t5_dir  # noqa: F401  (fixture: tiny T5, d_model 32, 8 words)

ROOT = Path(__file__).resolve().parents[2]


def test_two_ranks_cover_every_video_once(videos, vae_dir, t5_dir, prepared, tmp_path): 
    root, _ = videos
    out = tmp_path / "out"
    p = run_command(["-m", "parallel.prepare_data", "--config", "debug", *[a for s in SETS for a in ("--set", s)],
                     "--videos", str(root), "--captions", str(root / "captions.csv"), "--vae", str(vae_dir),
                     "--t5", str(t5_dir), "--out", str(out)], ranks=2, env_extra={"OMP_NUM_THREADS": "1"},
                    timeout=180)
    assert p.returncode == 0, p.stderr[-4000:]
    # Rank 0 takes captions lines 1 and 3 (a0, bad), rank 1 lines 2 and 4 (a1, sub/b): rank 0 skips bad.mp4.
    assert "rank 0 of 2: 1 prepared, 1 skipped, 0 done before, of 2" in p.stdout
    assert "rank 1 of 2: 2 prepared, 0 skipped, 0 done before, of 2" in p.stdout
    assert "skipping" in p.stderr and "bad.mp4" in p.stderr
    # The merged files equal the one-process run's, and so does every tensor (posterior noise from the video).
    for name in ("manifest.jsonl", "skipped.jsonl"):
        assert (out / name).read_text() == (prepared / name).read_text()
    for m in lines(out / "manifest.jsonl"):
        for key in ("latent", "text"):
            torch.testing.assert_close(load_file(out / m[key])[key], load_file(prepared / m[key])[key])


def test_training_imports_neither_diffusers_nor_av():
    """The [data] extra is optional: every training module imports with diffusers and av unavailable."""
    code = ("import sys; sys.modules.update(diffusers=None, av=None)\n"
            "import train, parallel.train.run, parallel.validation.validate, parallel.validation.media, parallel.prepare_data.prepare, models.vae\n"
            "from parallel.validation.media import load_decoder; load_decoder(None)")
    # A fresh interpreter, not run_command: the forked server has imported diffusers and the training modules
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_images_and_videos_train_in_their_buckets(vae_dir, t5_dir, tmp_path):
    """Two pictures and two videos prepared into 1x32x32 and 9x32x32, then train.py on the folder at dp 2: the
    steps that the bucket schedule gives the 1-frame bucket train on its latents [4, 1, 16, 16]."""
    import json

    import numpy as np
    from PIL import Image

    from parallel.train.buckets import BucketSchedule
    from tests.helpers.prepare_data import squares, write_video

    root, out, run = tmp_path / "in", tmp_path / "out", tmp_path / "run"
    root.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray(rng.integers(0, 256, (32, 40, 3), dtype=np.uint8)).save(root / f"p{i}.png")
        write_video(root / f"v{i}.mkv", squares(11, 32, 32, i), "ffv1")
        (root / f"p{i}.txt").write_text("a picture")
        (root / f"v{i}.txt").write_text("a video")
    sets = [a for s in SETS for a in ("--set", s)]
    p = run_command(["-m", "parallel.prepare_data", "--config", "debug", *sets, "--videos", str(root), "--vae",
                     str(vae_dir), "--t5", str(t5_dir), "--out", str(out), "--buckets", "1x32x32,9x32x32"])
    assert p.returncode == 0, p.stderr[-4000:]
    shapes = [tuple(m["shape"]) for m in lines(out / "manifest.jsonl")]
    assert shapes == [(1, 32, 32)] * 2 + [(9, 32, 32)] * 2
    assert load_file(out / "latents/p0.png.safetensors")["latent"].shape == (4, 1, 16, 16)

    steps = 4
    train = ["--set", "data.kind=directory", "--set", f"data.path={out}", "--set", f"train.max_steps={steps}",
             "--set", "train.micro_batch_size=1", "--set", "train.grad_accum_steps=1", "--set", "parallel.pp_size=1",
             "--set", f"train.output_dir={run}"]
    p = run_command(["train.py", "--config", "debug", "--deepspeed_config", "ds_configs/zero0_fp32.json", *sets,
                     *train], ranks=2, timeout=180)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    schedule = BucketSchedule(shapes, len(shapes), 1234, global_batch=2)
    picked = [schedule.keys[schedule.bucket(s)] for s in range(steps)]
    assert (1, 32, 32) in picked and (9, 32, 32) in picked, picked
    # Each step's tokens a sample are its bucket's: 1 x 8 x 8 patches (+ 8 text tokens) for a picture, 5 x 8 x 8 (+ 8)
    per_sample = [round(r["tokens_per_s"] / r["samples_per_s"]) for r in rows]
    assert per_sample == [{(1, 32, 32): 72, (9, 32, 32): 328}[b] for b in picked]
