"""LTX-2's sampler (the family's `Sampling.sample`, sampler name "ltx2"): LTX2Pipeline's denoising loop (diffusers
0.42 `pipeline_ltx2.py`), video and audio together, free of any distribution.

Schedule: the release's FlowMatchEulerDiscreteScheduler (`scheduler_config.json`: use_dynamic_shifting,
time_shift_type exponential, shift_terminal 0.1; base 1024 -> 0.95, max 4096 -> 2.05) as the pipeline sets it, in
numpy float32:

    r_i = linspace(1, 1 / N, N)                                    N steps
    s_i = e^mu / (e^mu + (1 / r_i - 1))                            mu = calculate_shift(S), S the video tokens
    s_i = 1 - (1 - s_i) (1 - shift_terminal) / (1 - s_{N-1})       stretched to end at shift_terminal
    s_N = 0

The audio stream is stepped by a copy of the scheduler at the same sigmas; the model sees t = 1000 s_i for both
streams (`timestep`, `audio_timestep`, `sigma`). Each step, per stream, in the pipeline's order of operations:

    x0 = x - s_i v                                                  the velocity v as x0 (convert_velocity_to_x0)
    x0 = x0_c + (g - 1) (x0_c - x0_u)                               classifier-free guidance (g > 1) in x0; else x0_c
    x0 = r x0 std(x0_c) / std(x0) + (1 - r) x0                     guidance rescale (r > 0; std over each sample)
    v  = (x - x0) / s_i;   x <- x + (s_{i+1} - s_i) v               back to a velocity; the Euler step in fp32

g is the stream's guidance scale (the pipeline's guidance_scale, audio_guidance_scale), r its guidance rescale
(guidance_rescale, audio_guidance_rescale: rescale_noise_cfg, applied whenever r > 0); the two calls (conditional,
unconditional) see the stream's caption states or the negative prompt's. Image-to-video (`first`): the video's
latent frame 0 is the picture's at the start and after every step, as LTX2ImageToVideoPipeline steps frames 1..
only (its x0, and so the rescale's std, sees the picture there). Not built (the pipeline's other terms, each off at
its neutral value): spatio-temporal guidance (stg_scale 0), modality isolation (modality_scale 1), noise_scale (0:
the noise given is the start).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np
import torch

from models.diffusion import NUM_TRAIN_TIMESTEPS

# LTX2Pipeline's calculate_shift arguments (its scheduler.config.get defaults, the release's values too)
BASE_SEQ_LEN, MAX_SEQ_LEN, BASE_SHIFT, MAX_SHIFT = 1024, 4096, 0.95, 2.05
SHIFT_TERMINAL = 0.1            # the release's scheduler_config.json
GUIDANCE_RESCALE = 0.7          # LTX2Pipeline's guidance_rescale and audio_guidance_rescale defaults
# One step has s_0 = 1, so 1 - s_0 = 0 and the stretch divides 0 by 0 (LTX2Pipeline's sigmas are NaN then).
MIN_STEPS = 2


def shift_mu(video_tokens: int) -> float:
    """calculate_shift (diffusers' pipeline_ltx2.py): the line through (1024, 0.95) and (4096, 2.05), in its order
    of operations. Training shifts its noise levels by it too (models/ltx2/training.py)."""
    m = (MAX_SHIFT - BASE_SHIFT) / (MAX_SEQ_LEN - BASE_SEQ_LEN)
    return video_tokens * m + (BASE_SHIFT - m * BASE_SEQ_LEN)


def ltx2_sigmas(steps: int, video_tokens: int) -> torch.Tensor:
    """The scheduler's sigmas [steps + 1] (float32, ending at 0) for a clip of `video_tokens` video tokens."""
    if steps < MIN_STEPS:
        raise ValueError(f"{steps} steps: LTX-2's schedule, stretched to end at {SHIFT_TERMINAL}, takes {MIN_STEPS} or "
                         f"more (one step divides 0 by 0)")
    r = np.linspace(1.0, 1 / steps, steps).astype(np.float32)
    s = math.exp(shift_mu(video_tokens)) / (math.exp(shift_mu(video_tokens)) + (1 / r - 1) ** 1.0)
    one_minus = 1 - s
    s = 1 - one_minus / (one_minus[-1] / (1 - SHIFT_TERMINAL))
    return torch.cat([torch.from_numpy(s).float(), torch.zeros(1)])


def rescaled(x0: torch.Tensor, x0_c: torch.Tensor, r: float) -> torch.Tensor:
    """rescale_noise_cfg (diffusers): the guided x0 scaled to the conditional one's std per sample, mixed by r."""
    dims = list(range(1, x0.dim()))
    return r * (x0 * (x0_c.std(dim=dims, keepdim=True) / x0.std(dim=dims, keepdim=True))) + (1 - r) * x0


def _guided(x: torch.Tensor, c: torch.Tensor, u, s: torch.Tensor, g: float, r: float) -> torch.Tensor:
    """The velocity the scheduler steps with: c (and u, the unconditional one, or None) through x0 and back."""
    x0_c = x - c * s
    x0 = x0_c if u is None else x0_c + (g - 1) * (x0_c - (x - u * s))
    return (x - (rescaled(x0, x0_c, r) if r > 0 else x0)) / s


@torch.no_grad()
def sample(predict: Callable, noise: tuple[torch.Tensor, torch.Tensor], steps: int,
           guidance: float | tuple[float, float], rescale: float = 0.0,
           first: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Integrate (video [B, C, T, H, W], audio [B, A, Ca]) from `noise` to clean latents, in fp32.
    predict(x, t [B] float32, conditional) -> the (video, audio) velocities at x = (video, audio); guidance: (video,
    audio) scales, or one for both, the unconditional call made when either is above 1 (the pipeline's
    do_classifier_free_guidance); rescale: both streams' guidance rescale; first [B, C, 1, H, W]: image-to-video's
    picture latent, the video's frame 0 throughout."""
    guidance = guidance if isinstance(guidance, tuple) else (guidance, guidance)
    keep = (lambda v: v) if first is None else (lambda v: torch.cat([first.to(v), v[:, :, 1:]], dim=2))
    x = (keep(noise[0].float()), noise[1].float())
    sigmas = ltx2_sigmas(steps, math.prod(x[0].shape[2:]))              # patch 1: T H W video tokens
    both = any(g > 1 for g in guidance)
    for i in range(steps):
        s = sigmas[i]
        t = (s * NUM_TRAIN_TIMESTEPS).expand(x[0].shape[0])
        c = tuple(p.float() for p in predict(x, t, True))
        u = tuple(p.float() for p in predict(x, t, False)) if both else (None, None)
        x = tuple(z + (sigmas[i + 1] - s) * _guided(z, cz, uz, s, g, rescale)
                  for z, cz, uz, g in zip(x, c, u, guidance))
        x = (keep(x[0]), x[1])
    return x
