"""HunyuanVideo 1.5 samples as HunyuanVideo15Pipeline (text-to-video): its latents (output_type="latent") from a tiny
random transformer (tests/unit/test_hunyuanvideo15.py's `released` folder) equal the toolkit's sampler (`flow_linear`,
the family's default and the presets' val.sampler) on the toolkit's model read from the same folder: the pipeline's
sigmas linspace(1, 0, steps + 1)[:-1] shifted by FlowMatchEulerDiscreteScheduler(shift=5.0), zero condition latents,
mask and image states, ClassifierFreeGuidance with a negative prompt, Qwen and byT5 states with padding rows.
"""
import types

import torch
from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline

from models.diffusion import Objective
from models.hunyuanvideo15 import SPEC
from models.sampling import check_sampler, sample
from parallel.config import load_config
from tests.unit.test_hunyuanvideo15 import C, FRAMES, GLYPH, HEIGHT, QWEN, WIDTH, overrides, released  # noqa: F401

PRESETS = ("hunyuanvideo1.5-t2v-480p", "hunyuanvideo1.5-t2v-720p", "hunyuanvideo1.5-i2v-720p", "debug-hunyuan15")


def test_the_family_and_its_presets_sample_with_the_pipelines_sigmas():
    assert check_sampler("flow_matching", None, SPEC.sampling.samplers) == "flow_linear"
    for preset in PRESETS:
        assert load_config(preset).val.sampler == "flow_linear", preset


def _caption(g, qwen: int, glyph: int):
    """(Qwen states [1, 8, QWEN], mask, byT5 states [1, 4, GLYPH], mask): padding rows zero, as the toolkit reads
    padding (a row of zeros) and as the transformer zeroes it."""
    states, states_2 = torch.randn(1, 8, QWEN, generator=g), torch.randn(1, 4, GLYPH, generator=g)
    states[:, qwen:], states_2[:, glyph:] = 0, 0
    return states, (torch.arange(8) < qwen).long()[None], states_2, (torch.arange(4) < glyph).long()[None]


def _rows(qwen, glyph) -> torch.Tensor:
    """The toolkit's text input: 4 zero image rows, 4 byT5 rows in their first GLYPH channels, 8 Qwen rows."""
    rows = torch.zeros(1, 16, QWEN)
    rows[:, 4:8, :GLYPH] = glyph
    rows[:, 8:] = qwen
    return rows


class _NoVae(torch.nn.Module):
    """What the pipeline reads of a VAE when it returns latents: its channels and compression."""
    config = types.SimpleNamespace(latent_channels=C)
    temporal_compression_ratio, spatial_compression_ratio = 4, 16


def test_pipeline_latents_equal_the_toolkit_sampler(released):  # noqa: F811
    from parallel.build import build_model
    from parallel.distributed.topology import ParallelContext
    from parallel.train.validate import StageForward
    from parallel.weights.diffusers import load_released

    folder, transformer = released
    g, steps, cfg_scale = torch.Generator().manual_seed(5), 4, 4.0
    (text, mask, text_2, mask_2), (neg, neg_mask, neg_2, neg_mask_2) = _caption(g, 6, 2), _caption(g, 3, 0)
    noise = torch.randn(1, C, FRAMES, HEIGHT, WIDTH, generator=g)
    pipe = HunyuanVideo15Pipeline(text_encoder=None, tokenizer=None, transformer=transformer,
                                  vae=_NoVae(),
                                  scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=None,
                                  tokenizer_2=None, guider=ClassifierFreeGuidance(guidance_scale=cfg_scale))
    pipe.vae = None                      # read by __init__ only; output_type="latent" decodes nothing
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        want = pipe(prompt_embeds=text, prompt_embeds_mask=mask, prompt_embeds_2=text_2, prompt_embeds_mask_2=mask_2,
                    negative_prompt_embeds=neg, negative_prompt_embeds_mask=neg_mask, negative_prompt_embeds_2=neg_2,
                    negative_prompt_embeds_mask_2=neg_mask_2, latents=noise.clone(), num_frames=(FRAMES - 1) * 4 + 1,
                    height=HEIGHT * 16, width=WIDTH * 16, num_inference_steps=steps, output_type="latent").frames

    cfg = load_config("debug-hunyuan15", overrides(folder))
    ctx = ParallelContext.single()
    model = build_model(cfg, {}, ctx)
    load_released(model, ctx, cfg.model, folder)
    forward = StageForward(types.SimpleNamespace(module=model.eval(), device=torch.device("cpu")), ctx)
    rows = {True: _rows(text, text_2), False: _rows(neg, neg_2)}

    def predict(x, t, conditional):       # text-to-video: the condition latents and mask are zeros (appended)
        return forward.predict((x, t, rows[conditional]), x)

    got = sample(predict, noise, Objective.of(cfg.model), steps, cfg.val.sampler, cfg_scale)
    torch.testing.assert_close(got, want)
