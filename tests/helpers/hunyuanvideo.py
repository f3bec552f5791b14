"""The helpers and fixtures of tests/unit/test_hunyuanvideo.py that other test modules use too: `B`, `FRAMES`,
`HEIGHT`, `LLAMA`, `POOLED`, `TEXT`, `WIDTH`, `diffusers_forward`, `inputs`, `overrides`, `released`,
`released_model` (a test module imports no other test module)."""

import pytest
import torch
from diffusers import HunyuanVideoTransformer3DModel

from models.hunyuanvideo.released import DIFFUSERS
from tests.released_utils import random_release, save_release


B, FRAMES, HEIGHT, WIDTH = 2, 3, 8, 12            # latents [2, 4, 3, 8, 12] -> 3 x 4 x 6 = 72 video tokens
LLAMA, POOLED, TEXT = 32, 8, 8
DIFFUSERS_TINY = dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=2,
                      num_single_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
                      text_embed_dim=LLAMA, pooled_projection_dim=POOLED, rope_axes_dim=(4, 6, 6))


def overrides(folder) -> list[str]:
    """debug-hunyuan on a non-square grid (rows and columns rotate by different channels)."""
    return [f"data.width={WIDTH * 8}", f"model.init_from={folder}"]


def released_model() -> HunyuanVideoTransformer3DModel:
    return random_release(HunyuanVideoTransformer3DModel, **DIFFUSERS_TINY)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(folder, diffusers model): a sharded save_pretrained folder with its index."""
    return save_release(tmp_path_factory.mktemp("hunyuan"), released_model(), "200KB")


def inputs():
    """(latents, timesteps, text rows = [LLaMA state; pooled vector]); the second caption has 5 real rows, its
    last 3 are padding (LLaMA channels zero: masked, as the pipeline's prompt_attention_mask)."""
    g = torch.Generator().manual_seed(7)
    llama, pooled = torch.randn(B, TEXT, LLAMA, generator=g), torch.randn(B, 1, POOLED, generator=g)
    llama[1, 5:] = 0
    return (torch.randn(B, 4, FRAMES, HEIGHT, WIDTH, generator=g), torch.tensor([3.0, 811.0]),
            torch.cat([llama, pooled.expand(-1, TEXT, -1)], dim=-1))


def diffusers_forward(model, latents, timesteps, text) -> torch.Tensor:
    with torch.no_grad():
        return DIFFUSERS.reference_call(model, (latents, timesteps, text), {})
