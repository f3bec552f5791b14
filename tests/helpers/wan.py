"""The helpers and fixtures of tests/unit/test_wan.py that other test modules use too: `DIFFUSERS_TINY`, `HEIGHT`,
`WIDTH`, `diffusers_forward`, `inputs`, `overrides`, `released`, `released_model` (a test module imports no other
test module)."""

import pytest
import torch
from diffusers import WanTransformer3DModel

from tests.released_utils import random_release, save_release


B, FRAMES, HEIGHT, WIDTH = 2, 3, 8, 12            # latents [2, 4, 3, 8, 12] -> 3 x 4 x 6 = 72 video tokens
DIFFUSERS_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4,
                      out_channels=4, text_dim=32, freq_dim=32, ffn_dim=96, num_layers=2)


def overrides(folder) -> list[str]:
    """debug-wan at 2 blocks and a non-square grid (rows and columns rotate by different channels)."""
    return ["model.num_layers=2", f"data.width={WIDTH * 8}", f"model.init_from={folder}"]


def released_model() -> WanTransformer3DModel:
    return random_release(WanTransformer3DModel, **DIFFUSERS_TINY)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(folder, diffusers model): a sharded save_pretrained folder with its index."""
    return save_release(tmp_path_factory.mktemp("wan"), released_model(), "100KB")


def inputs():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(B, 4, FRAMES, HEIGHT, WIDTH, generator=g), torch.tensor([3.0, 811.0]),
            torch.randn(B, 8, 32, generator=g))


def diffusers_forward(model, latents, timesteps, text) -> torch.Tensor:
    with torch.no_grad():
        return model(hidden_states=latents, timestep=timesteps, encoder_hidden_states=text).sample
