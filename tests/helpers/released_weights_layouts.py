"""The helpers and fixtures of tests/distributed/test_released_weights_layouts.py that other test modules use too:
`_inputs`, `diffusers_forward` (a test module imports no other test module)."""

import torch
from diffusers.models.embeddings import get_3d_rotary_pos_embed
from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

from tests.helpers.released_weights import B, FRAMES, HEAD_DIM, SIZE  # noqa: F401  (fixture)


def diffusers_forward(model, pos, latents, timesteps, text) -> torch.Tensor:
    """diffusers' prediction as [B, C, T, H, W]; the rotary tables as CogVideoXPipeline builds them."""
    rotary = None
    if pos == "rope3d":
        grid, cfg = SIZE // 2, model.config
        crop = get_resize_crop_region_for_grid((grid, grid), cfg.sample_width // 2, cfg.sample_height // 2)
        rotary = get_3d_rotary_pos_embed(HEAD_DIM, crop, (grid, grid), FRAMES)
    with torch.no_grad():
        out = model(latents.transpose(1, 2), text, timesteps, image_rotary_emb=rotary).sample
    return out.transpose(1, 2)


def _inputs():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(B, 4, FRAMES, SIZE, SIZE, generator=g), torch.tensor([3.0, 811.0]),
            torch.randn(B, 8, 32, generator=g))
