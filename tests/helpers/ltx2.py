"""The helpers and fixtures of the LTX-2 tests (tests/unit/test_ltx2*.py, tests/distributed/test_ltx2_layouts.py): the
tiny random releases (`DIFFUSERS_TINY`, `VARIANTS`, `release`, `released`), `inputs`, `overrides`, `diffusers_forward`,
`pipeline` (LTX2Pipeline around a release), `release_scheduler` (a test module imports no other test module)."""
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


def pipeline(transformer):
    """diffusers' LTX2Pipeline around `transformer` with tiny random connectors (Gemma features of 2 x 16 -> the
    16-wide caption states of both streams, every row unmasked) and VAEs whose normalisation is the identity (zero
    means, unit deviations: latents in and out as the toolkit holds them; 2 audio channels x 4 latent mel bins = 8
    packed audio channels), and the release's scheduler (scheduler_config.json: dynamic exponential shift, shift
    terminal 0.1). No text encoder: prompts come as Gemma features."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2Pipeline
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    torch.manual_seed(0)
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=2, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=4, video_connector_num_layers=1, video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=4, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split")
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False)
    audio_vae = AutoencoderKLLTX2Audio(base_channels=8, ch_mult=(1,), num_res_blocks=1, resolution=32, latent_channels=2,
                                       mel_bins=16)
    return LTX2Pipeline(scheduler=release_scheduler(), vae=vae, audio_vae=audio_vae, text_encoder=None, tokenizer=None,
                        connectors=connectors, transformer=transformer, vocoder=None)


def release_scheduler():
    """FlowMatchEulerDiscreteScheduler as the LTX-2 release's scheduler_config.json configures it."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    return FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                           base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1,
                                           time_shift_type="exponential")
