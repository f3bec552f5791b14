"""The helpers and fixtures of tests/unit/test_hunyuanvideo15_sampling.py that other test modules use too:
`_caption`, `_rows`, `i2v_latents`, `i2v_pipeline` (a test module imports no other test module)."""

import torch
from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                       HunyuanVideo15ImageToVideoPipeline)

from tests.helpers.hunyuanvideo15 import C, FRAMES, GLYPH, IMAGE, QWEN  # noqa: F401


def _caption(g, qwen: int, glyph: int):
    """(Qwen states [1, 8, QWEN], mask, byT5 states [1, 4, GLYPH], mask): padding rows zero, as the toolkit reads
    padding (a row of zeros) and as the transformer zeroes it."""
    states, states_2 = torch.randn(1, 8, QWEN, generator=g), torch.randn(1, 4, GLYPH, generator=g)
    states[:, qwen:], states_2[:, glyph:] = 0, 0
    return states, (torch.arange(8) < qwen).long()[None], states_2, (torch.arange(4) < glyph).long()[None]


def _rows(qwen, glyph, image=None) -> torch.Tensor:
    """The toolkit's text input: 4 image rows (zero: text-to-video) in their first IMAGE channels, 4 byT5 rows in
    their first GLYPH channels, 8 Qwen rows."""
    rows = torch.zeros(1, 16, QWEN)
    if image is not None:
        rows[:, :4, :IMAGE] = image
    rows[:, 4:8, :GLYPH] = glyph
    rows[:, 8:] = qwen
    return rows


def i2v_pipeline(transformer, guidance: float, image_encoder=None, feature_extractor=None):
    """HunyuanVideo15ImageToVideoPipeline around `transformer` with a tiny random VAE (from seed 0) and no text
    encoders (the captions are given as states), at the resolution class of a 64 x 96 picture."""
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo15(latent_channels=C, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
                                      spatial_compression_ratio=16, temporal_compression_ratio=4).eval()
    pipe = HunyuanVideo15ImageToVideoPipeline(
        text_encoder=None, tokenizer=None, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=None, tokenizer_2=None,
        guider=ClassifierFreeGuidance(guidance_scale=guidance), image_encoder=image_encoder,
        feature_extractor=feature_extractor)
    pipe.target_size = 80                  # its resolution class for a 64 x 96 picture: 64 x 96 (4 x 6 latents)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def i2v_latents(pipe, picture, caption, negative, noise, steps: int) -> torch.Tensor:
    """The pipeline's latents for `picture` from `noise`; caption and negative: (qwen, mask, glyph, mask)."""
    (text, mask, text_2, mask_2), (neg, neg_mask, neg_2, neg_mask_2) = caption, negative
    with torch.no_grad():
        return pipe(image=picture, prompt_embeds=text, prompt_embeds_mask=mask, prompt_embeds_2=text_2,
                    prompt_embeds_mask_2=mask_2, negative_prompt_embeds=neg, negative_prompt_embeds_mask=neg_mask,
                    negative_prompt_embeds_2=neg_2, negative_prompt_embeds_mask_2=neg_mask_2, latents=noise.clone(),
                    num_frames=(FRAMES - 1) * 4 + 1, num_inference_steps=steps, output_type="latent").frames
