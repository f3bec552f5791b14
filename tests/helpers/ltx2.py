"""The helpers and fixtures of tests/unit/test_ltx2.py that tests/distributed/test_ltx2_layouts.py uses too: the tiny
random releases (`DIFFUSERS_TINY`, `VARIANTS`, `release`, `released`), `inputs`, `overrides`, `diffusers_forward`
(a test module imports no other test module)."""
import pytest
import torch
from diffusers import LTX2VideoTransformer3DModel

from tests.released_utils import random_release, save_release

B, FRAMES, HEIGHT, WIDTH, AUDIO = 2, 2, 4, 6, 9        # 48 video tokens, 9 audio tokens (debug-ltx2's data)
DIFFUSERS_TINY = dict(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8,
                      cross_attention_dim=32, audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2,
                      audio_attention_head_dim=8, audio_cross_attention_dim=16, num_layers=2, caption_channels=16)
LTX23 = dict(gated_attn=True, audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True)
# variant -> (diffusers arguments beyond DIFFUSERS_TINY, toolkit overrides, call arguments)
VARIANTS = {
    "ltx2": ({}, [], {}),
    "ltx2.3": (LTX23, [f"model.{k}=true" for k in LTX23], {}),
    "split": ({"rope_type": "split"}, ["model.rope_type=split", "model.cross_timestep=false"],
              {"use_cross_timestep": False}),
}


def overrides(folder, variant: str = "ltx2") -> list[str]:
    return [*VARIANTS[variant][1], f"model.init_from={folder}"]


def release(variant: str = "ltx2") -> LTX2VideoTransformer3DModel:
    return random_release(LTX2VideoTransformer3DModel, **DIFFUSERS_TINY, **VARIANTS[variant][0])


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """variant -> (folder, diffusers model): sharded save_pretrained folders with their index."""
    return {v: save_release(tmp_path_factory.mktemp(v.replace(".", "_")), release(v), "40KB") for v in VARIANTS}


def inputs(grid: tuple[int, int, int] = (FRAMES, HEIGHT, WIDTH), audio: int = AUDIO):
    """(latents, t, text, audio, audio text, audio t): the two streams at different timesteps; debug-ltx2's
    shapes, or latents of another (t, h, w) grid with `audio` audio tokens."""
    g = torch.Generator().manual_seed(7)
    return (torch.randn(B, 8, *grid, generator=g), torch.tensor([3.0, 811.0]),
            torch.randn(B, 8, 16, generator=g), torch.randn(B, audio, 8, generator=g),
            torch.randn(B, 8, 16, generator=g), torch.tensor([500.0, 40.0]))


def diffusers_forward(model, variant: str = "ltx2", x=None):
    """diffusers' (video [B, C, T, H, W], audio [B, A, Ca]) on `x` (default `inputs()`), called as the pipelines
    call it."""
    from models.ltx2.released import DIFFUSERS
    with torch.no_grad():
        return DIFFUSERS.reference_call(model, inputs() if x is None else x, dict(VARIANTS[variant][2]))
