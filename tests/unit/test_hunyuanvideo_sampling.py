"""HunyuanVideo samples as HunyuanVideoPipeline: its latents (output_type="latent") from a tiny random transformer
(tests/helpers/hunyuanvideo.py's `released` folder) equal the toolkit's sampler (`flow_linear`, the family's
default) on the toolkit's model read from the same folder: the pipeline's sigmas linspace(1, 0, steps + 1)[:-1]
shifted by FlowMatchEulerDiscreteScheduler(shift=7.0), the embedded guidance 6.0 x 1000, true CFG with a negative
prompt, a caption with padding rows.
"""
import types

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline

from models.diffusion import Objective
from models.hunyuanvideo import SPEC
from models.sampling import check_sampler, linear_flow_sigmas, sample, sampling_timesteps
from parallel.experiment.config import load_config
from tests.helpers.hunyuanvideo import FRAMES, HEIGHT, LLAMA, POOLED, TEXT, WIDTH, overrides, released  # noqa: F401


@pytest.mark.parametrize("steps", [1, 4, 30])
def test_sigmas_are_the_pipelines(steps):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1])      # HunyuanVideoPipeline's
    assert torch.equal(linear_flow_sigmas(steps, 7.0), scheduler.sigmas)
    assert sampling_timesteps("flow_matching", steps, "flow_linear", shift=7.0) == scheduler.timesteps.tolist()
    assert check_sampler("flow_matching", None, SPEC.sampling.samplers) == "flow_linear"


def _caption(g, real: int):
    """(LLaMA states [1, L, 32] with zero padding rows, pooled [1, 8], mask [1, L])."""
    llama = torch.randn(1, TEXT, LLAMA, generator=g)
    llama[:, real:] = 0
    return llama, torch.randn(1, POOLED, generator=g), (torch.arange(TEXT) < real).long()[None]


def test_pipeline_latents_equal_the_toolkit_sampler(released):  # noqa: F811
    from parallel.model.build import build_model
    from parallel.distributed.topology import ParallelContext
    from parallel.validation.validate import StageForward
    from parallel.weights.diffusers import load_released

    folder, transformer = released
    g, steps, cfg_scale = torch.Generator().manual_seed(11), 4, 3.0
    (text, pooled, mask), (neg, neg_pooled, neg_mask) = _caption(g, 5), _caption(g, 3)
    noise = torch.randn(1, 4, FRAMES, HEIGHT, WIDTH, generator=g)
    pipe = HunyuanVideoPipeline(text_encoder=None, tokenizer=None, transformer=transformer, vae=None,
                                scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=None,
                                tokenizer_2=None)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        want = pipe(prompt_embeds=text, pooled_prompt_embeds=pooled, prompt_attention_mask=mask,
                    negative_prompt_embeds=neg, negative_pooled_prompt_embeds=neg_pooled,
                    negative_prompt_attention_mask=neg_mask, true_cfg_scale=cfg_scale, latents=noise.clone(),
                    num_frames=(FRAMES - 1) * 4 + 1, height=HEIGHT * 8, width=WIDTH * 8, num_inference_steps=steps,
                    output_type="latent").frames

    cfg = load_config("debug-hunyuan", overrides(folder))
    ctx = ParallelContext.single()
    model = build_model(cfg, {}, ctx)
    load_released(model, ctx, cfg.model, folder)
    forward = StageForward(types.SimpleNamespace(module=model.eval(), device=torch.device("cpu")), ctx)
    rows = {True: torch.cat([text, pooled[:, None].expand(-1, TEXT, -1)], dim=-1),
            False: torch.cat([neg, neg_pooled[:, None].expand(-1, TEXT, -1)], dim=-1)}

    def predict(x, t, conditional):
        return forward.predict((x, t, rows[conditional]), x)

    got = sample(predict, noise, Objective.of(cfg.model), steps, "flow_linear", cfg_scale)
    torch.testing.assert_close(got, want)
