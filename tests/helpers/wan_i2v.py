"""The helpers and fixtures of tests/unit/test_wan_i2v.py that other test modules use too: `IMAGE`, `IMAGE_DIM`,
`TEXT`, `diffusers_forward`, `inputs`, `overrides`, `released_i2v`, `released_model` (a test module imports no other
test module)."""
import pytest
import torch
from diffusers import WanTransformer3DModel

from tests.released_utils import random_release, save_release


B, FRAMES, HEIGHT, WIDTH = 2, 3, 8, 12            # latents [2, 12, 3, 8, 12] -> 3 x 4 x 6 = 72 video tokens
TEXT, IMAGE, IMAGE_DIM = 512, 5, 24               # diffusers reads the last 512 cross-attention tokens as text
DIFFUSERS_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=12,
                      out_channels=4, text_dim=32, freq_dim=32, ffn_dim=96, num_layers=2, image_dim=IMAGE_DIM,
                      added_kv_proj_dim=64)


def overrides(folder) -> list[str]:
    """debug-wan-i2v at 2 blocks and a non-square grid."""
    return ["model.num_layers=2", f"data.width={WIDTH * 8}", f"model.init_from={folder}"]


def released_model() -> WanTransformer3DModel:
    return random_release(WanTransformer3DModel, **DIFFUSERS_TINY)


@pytest.fixture(scope="module")
def released_i2v(tmp_path_factory):
    """(folder, diffusers model): a sharded save_pretrained folder with its index."""
    return save_release(tmp_path_factory.mktemp("wan_i2v"), released_model(), "200KB")


def inputs():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(B, 12, FRAMES, HEIGHT, WIDTH, generator=g), torch.tensor([3.0, 811.0]),
            torch.randn(B, TEXT, 32, generator=g), torch.randn(B, IMAGE, IMAGE_DIM, generator=g))


def diffusers_forward(model, latents, timesteps, text, image) -> torch.Tensor:
    with torch.no_grad():
        return model(hidden_states=latents, timestep=timesteps, encoder_hidden_states=text,
                     encoder_hidden_states_image=image).sample
