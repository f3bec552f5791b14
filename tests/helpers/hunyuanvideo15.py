"""The helpers and fixtures of tests/unit/test_hunyuanvideo15.py that other test modules use too: `C`, `FRAMES`,
`GLYPH`, `HEIGHT`, `IMAGE`, `QWEN`, `WIDTH`, `diffusers_forward`, `inputs`, `overrides`, `released`,
`released_model` (a test module imports no other test module)."""

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel

from models.hunyuanvideo15.released import DIFFUSERS
from parallel.experiment.config import load_config
from tests.released_utils import random_release, save_release


B, C, FRAMES, HEIGHT, WIDTH = 2, 4, 3, 4, 6           # latents [2, 9, 3, 4, 6] -> 72 video tokens (patch 1)
QWEN, GLYPH, IMAGE = 32, 16, 24                        # state widths; rows: 4 image, 4 byT5, 8 Qwen
DIFFUSERS_TINY = dict(in_channels=2 * C + 1, out_channels=C, num_attention_heads=4, attention_head_dim=16,
                      num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1,
                      text_embed_dim=QWEN, text_embed_2_dim=GLYPH, image_embed_dim=IMAGE, rope_axes_dim=(4, 6, 6),
                      target_size=640, task_type="t2v")


def overrides(folder) -> list[str]:
    return [f"model.init_from={folder}"]


def released_model() -> HunyuanVideo15Transformer3DModel:
    return random_release(HunyuanVideo15Transformer3DModel, **DIFFUSERS_TINY)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(folder, diffusers model): a sharded save_pretrained folder with its index."""
    return save_release(tmp_path_factory.mktemp("hunyuan15"), released_model(), "2MB")


def inputs(i2v: bool = False):
    """(latents [B, 2C+1, ...], timesteps, text rows [image; byT5; Qwen]). Text-to-video: zero condition channels and
    image rows, as HunyuanVideo15Pipeline; image-to-video: all set. The second caption has 5 real Qwen rows (3
    padding) and 2 real byT5 rows, the first no byT5 row at all (no quoted text): masked, as the pipelines' masks."""
    g = torch.Generator().manual_seed(7 + i2v)
    text = torch.zeros(B, 16, QWEN)
    text[:, :4, :IMAGE] = torch.randn(B, 4, IMAGE, generator=g) if i2v else 0
    text[1, 4:6, :GLYPH] = torch.randn(2, GLYPH, generator=g)
    text[:, 8:] = torch.randn(B, 8, QWEN, generator=g)
    text[1, 13:] = 0
    latents = torch.randn(B, 2 * C + 1, FRAMES, HEIGHT, WIDTH, generator=g)
    if not i2v:
        latents[:, C:] = 0
    return latents, torch.tensor([3.0, 811.0]), text


def diffusers_forward(model, x) -> torch.Tensor:
    with torch.no_grad():
        return DIFFUSERS.bind(load_config("debug-hunyuan15").model).reference_call(model, x, {})
