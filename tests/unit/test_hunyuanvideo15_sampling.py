"""HunyuanVideo 1.5 samples as HunyuanVideo15Pipeline (text-to-video): its latents (output_type="latent") from a tiny
random transformer (tests/helpers/hunyuanvideo15.py's `released` folder) equal the toolkit's sampler (`flow_linear`,
the family's default and the presets' val.sampler) on the toolkit's model read from the same folder: the pipeline's
sigmas linspace(1, 0, steps + 1)[:-1] shifted by FlowMatchEulerDiscreteScheduler(shift=5.0), zero condition latents,
mask and image states, ClassifierFreeGuidance with a negative prompt, Qwen and byT5 states with padding rows.
Image-to-video (model.image_condition, Hunyuan15ImageCondition): HunyuanVideo15ImageToVideoPipeline's latents from a
picture through a tiny AutoencoderKLHunyuanVideo15 and given SigLIP states equal the toolkit's sampler on the
condition's picture latents; its training input puts the first frame's latents and mask where the pipeline does.
"""
import types

import torch
from diffusers import (ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                       HunyuanVideo15Pipeline)
from PIL import Image

from models.diffusion import Objective
from models.hunyuanvideo15 import SPEC
from models.sampling import check_sampler, sample
from parallel.experiment.config import load_config
from models.registry import family
from tests.helpers.hunyuanvideo15 import C, FRAMES, HEIGHT, IMAGE, WIDTH, overrides
from tests.helpers.hunyuanvideo15 import released  # noqa: F401  (fixture)
from tests.helpers.hunyuanvideo15_sampling import _caption, _rows, i2v_latents, i2v_pipeline

PRESETS = ("hunyuanvideo1.5-t2v-480p", "hunyuanvideo1.5-t2v-720p", "hunyuanvideo1.5-i2v-720p", "debug-hunyuan15")


def test_the_family_and_its_presets_sample_with_the_pipelines_sigmas():
    assert check_sampler("flow_matching", None, SPEC.sampling.samplers) == "flow_linear"
    for preset in PRESETS:
        assert load_config(preset).val.sampler == "flow_linear", preset


class _NoVae(torch.nn.Module):
    """What the pipeline reads of a VAE when it returns latents: its channels and compression."""
    config = types.SimpleNamespace(latent_channels=C)
    temporal_compression_ratio, spatial_compression_ratio = 4, 16


def _toolkit_forward(folder, extra=()):
    from parallel.model.build import build_model
    from parallel.distributed.topology import ParallelContext
    from parallel.validation.validate import StageForward
    from parallel.weights.diffusers import load_released

    cfg = load_config("debug-hunyuan15", overrides(folder) + list(extra))
    ctx = ParallelContext.single()
    model = build_model(cfg, {}, ctx)
    load_released(model, ctx, cfg.model, folder)
    return cfg, StageForward(types.SimpleNamespace(module=model.eval(), device=torch.device("cpu")), ctx)


def test_pipeline_latents_equal_the_toolkit_sampler(released):  # noqa: F811
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

    cfg, forward = _toolkit_forward(folder)
    rows = {True: _rows(text, text_2), False: _rows(neg, neg_2)}

    def predict(x, t, conditional):       # text-to-video: the condition latents and mask are zeros (appended)
        return forward.predict((x, t, rows[conditional]), x)

    got = sample(predict, noise, Objective.of(cfg.model), steps, cfg.val.sampler, cfg_scale)
    torch.testing.assert_close(got, want)


def test_image_to_video_pipeline_latents_equal_the_toolkit_sampler(released):  # noqa: F811
    folder, transformer = released
    g, steps, cfg_scale = torch.Generator().manual_seed(6), 3, 3.0
    (text, mask, text_2, mask_2), (neg, neg_mask, neg_2, neg_mask_2) = _caption(g, 5, 3), _caption(g, 8, 0)
    siglip = torch.randn(1, 4, IMAGE, generator=g)
    noise = torch.randn(1, C, FRAMES, HEIGHT, WIDTH, generator=g)
    picture = Image.fromarray((torch.rand(HEIGHT * 16, WIDTH * 16, 3, generator=g) * 255).to(torch.uint8).numpy())
    pipe = i2v_pipeline(transformer, cfg_scale)
    pipe._get_image_embeds = lambda **_: siglip                                     # the SigLIP states, given
    want = i2v_latents(pipe, picture, (text, mask, text_2, mask_2), (neg, neg_mask, neg_2, neg_mask_2), noise, steps)
    vae = pipe.vae
    with torch.no_grad():
        cond_latents, cond_mask = pipe.prepare_cond_latents_and_mask(noise, picture, 1, HEIGHT * 16, WIDTH * 16,
                                                                     torch.float32, torch.device("cpu"))

    cfg, forward = _toolkit_forward(folder, ["model.image_condition=true"])
    condition = family(cfg.model).training_condition(cfg.model, cfg.data)
    t2v = load_config("debug-hunyuan15")
    assert (t2v.model.image_condition, family(t2v.model).training_condition(t2v.model, t2v.data)) == (False, None)
    assert load_config("hunyuanvideo1.5-i2v-720p").model.image_condition is True
    first = condition.encode_pictures(vae, [picture], HEIGHT * 16, WIDTH * 16)
    # Training: the first frame's latents (here x0's frame 0) and the mask on the channels where the pipeline puts
    # them; a dropped sample gets text-to-video's zeros.
    x0 = torch.cat([first, torch.randn(1, C, FRAMES - 1, HEIGHT, WIDTH, generator=g)], dim=2)
    built = condition(noise, x0, torch.tensor([True]))
    torch.testing.assert_close(built, torch.cat([noise, cond_latents, cond_mask], dim=1), rtol=0, atol=0)
    assert condition(noise, x0, torch.tensor([False]))[:, C:].abs().sum() == 0
    rows = {True: _rows(text, text_2, siglip), False: _rows(neg, neg_2, siglip)}

    def predict(x, t, conditional):
        return forward.predict((condition.sampling_input(x, first), t, rows[conditional]), x)

    got = sample(predict, noise, Objective.of(cfg.model), steps, cfg.val.sampler, cfg_scale)
    torch.testing.assert_close(got, want)
