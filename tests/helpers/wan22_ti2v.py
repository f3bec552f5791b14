"""The helpers and fixtures of tests/unit/test_wan22_ti2v.py that other test modules use too: `PRESET`,
`diffusers_forward`, `inputs`, `overrides`, `released_ti2v`, `vae_and_picture` (a test module imports no other test
module)."""
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers import WanTransformer3DModel
from PIL import Image

from tests.released_utils import random_release, save_release


PRESET = "debug-wan22-ti2v"
B, C, FRAMES, HEIGHT, WIDTH = 2, 8, 3, 8, 12      # latents [2, 8, 3, 8, 12] -> 3 x 4 x 6 = 72 video tokens
TOKENS = FRAMES * HEIGHT * WIDTH // 4
DIFFUSERS_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=C,
                      out_channels=C, text_dim=32, freq_dim=32, ffn_dim=96, num_layers=2)
PIXELS = (9, 64, 96)                                 # sampling: latents [8, 3, 4, 6]


def overrides(folder) -> list[str]:
    """debug-wan22-ti2v on a non-square 8 x 12 latent (Wan 2.2 VAE: 16 x 16 pixels a latent position)."""
    return [f"data.height={HEIGHT * 16}", f"data.width={WIDTH * 16}", f"model.init_from={folder}"]


@pytest.fixture(scope="module")
def released_ti2v(tmp_path_factory):
    return save_release(tmp_path_factory.mktemp("wan22_ti2v"), random_release(WanTransformer3DModel, **DIFFUSERS_TINY),
                        "100KB")


def inputs():
    """(latents, a timestep per token [B, S] as diffusers takes it, text)."""
    g = torch.Generator().manual_seed(7)
    return (torch.randn(B, C, FRAMES, HEIGHT, WIDTH, generator=g),
            torch.randint(0, 1000, (B, TOKENS), generator=g).float(), torch.randn(B, 8, 32, generator=g))


def diffusers_forward(model, latents, timesteps, text) -> torch.Tensor:
    with torch.no_grad():
        return model(hidden_states=latents, timestep=timesteps, encoder_hidden_states=text).sample


@pytest.fixture(scope="module")
def vae_and_picture():
    """A tiny AutoencoderKLWan of the 2.2 kind (residual blocks, patch_size 2) and a 64 x 96 picture."""
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=C, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], is_residual=True, patch_size=2,
                           scale_factor_spatial=16, in_channels=12, out_channels=12,
                           latents_mean=[0.1 * i - 0.3 for i in range(C)],
                           latents_std=[1.0 + 0.1 * i for i in range(C)]).eval()
    picture = Image.fromarray(np.random.default_rng(3).integers(0, 256, (*PIXELS[1:], 3), dtype=np.uint8))
    return vae, picture
