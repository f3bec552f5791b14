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
