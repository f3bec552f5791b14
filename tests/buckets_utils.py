"""A directory dataset of three shapes (buckets) for the bucket tests: random latents, text and a manifest."""
from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from parallel.experiment.shapes import Shape

# Pixel (frames, height, width) -> for the `debug` model (VAE 4 x 8 x 8, patch 2): latent 3x8x8 (48 video
# tokens + 8 text = 56), 2x6x10 (30 + 8 = 38), 1x6x6 (9 + 8 = 17: sp 2 pads it to 18).
SHAPES: list[Shape] = [(9, 64, 64), (5, 48, 80), (1, 48, 48)]
PER_BUCKET = 4


def write_buckets(root, channels: int = 4, text_len: int = 8, text_dim: int = 32, seed: int = 0) -> list[dict]:
    """PER_BUCKET samples of each shape in SHAPES, interleaved in the manifest; returns its lines."""
    g = torch.Generator().manual_seed(seed)
    lines = []
    for i in range(PER_BUCKET * len(SHAPES)):
        f, h, w = SHAPES[i % len(SHAPES)]
        latent = torch.randn(channels, (f - 1) // 4 + 1, h // 8, w // 8, generator=g)
        save_file({"latent": latent}, str(root / f"v{i}.safetensors"))
        save_file({"text": torch.randn(text_len, text_dim, generator=g)}, str(root / f"v{i}_text.safetensors"))
        lines.append({"latent": f"v{i}.safetensors", "text": f"v{i}_text.safetensors", "shape": [f, h, w]})
    (root / "manifest.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return lines
