"""The helpers and fixtures of tests/unit/test_prepare_data.py that other test modules use too: `CAPTIONS`, `SETS`,
`lines`, `prepared`, `run`, `squares`, `vae_dir`, `videos`, `write_video` (a test module imports no other test
module)."""
import json
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLCogVideoX

from parallel.prepare_data.prepare import main


# debug at 9 x 32 x 32 with the tiny VAE's factors (spatial 2, temporal 2): latents [4, 5, 16, 16].
SETS = ["data.num_frames=9", "data.height=32", "data.width=32", "model.vae_scale_spatial=2",
        "model.vae_scale_temporal=2"]
CAPTIONS = {"a0.mkv": "a red square moving left", "a1.mkv": "a square moving", "bad.mp4": "a red square",
            "sub/b.mp4": "red square moving left"}


def squares(t: int, h: int, w: int, seed: int) -> np.ndarray:
    """uint8 [t, h, w, 3]: a coloured square moving right over a textured background."""
    rng = np.random.default_rng(seed)
    frames = np.repeat(rng.integers(0, 120, (1, h, w, 3), dtype=np.uint8), t, axis=0)
    for i in range(t):
        frames[i, h // 4:h // 4 + 8, 2 + 3 * i:10 + 3 * i] = rng.integers(150, 256, 3, dtype=np.uint8)
    return frames


def write_video(path: Path, frames: np.ndarray, codec: str) -> None:
    """ffv1 (lossless RGB, .mkv) or H.264 (.mp4), 8 fps."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=8)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "bgr0" if codec == "ffv1" else "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    (root / "sub").mkdir()
    frames = {"a0.mkv": squares(11, 32, 48, 0), "a1.mkv": squares(9, 32, 48, 1), "sub/b.mp4": squares(13, 40, 60, 2)}
    for name, f in frames.items():
        write_video(root / name, f, "ffv1" if name.endswith(".mkv") else "libx264")
    (root / "bad.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)      # not decodable
    (root / "captions.csv").write_text("video,caption\n" + "".join(f"{v},{c}\n" for v, c in CAPTIONS.items()))
    return root, frames


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vae")
    torch.manual_seed(0)
    AutoencoderKLCogVideoX(down_block_types=("CogVideoXDownBlock3D",) * 2, up_block_types=("CogVideoXUpBlock3D",) * 2,
                           block_out_channels=(8, 16), latent_channels=4, layers_per_block=1, norm_num_groups=4,
                           temporal_compression_ratio=4, sample_height=32, sample_width=32).save_pretrained(path)
    return path


def run(videos, vae, out, *extra, sets=SETS) -> int:
    return main(["--config", "debug", *[a for s in sets for a in ("--set", s)], "--videos", str(videos),
                 "--captions", str(videos / "captions.csv"), "--vae", str(vae), "--out", str(out), *extra])


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def prepared(videos, vae_dir, t5_dir, tmp_path_factory): 
    out = tmp_path_factory.mktemp("prepared")
    assert run(videos[0], vae_dir, out, "--t5", str(t5_dir)) == 0
    return out
