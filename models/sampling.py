"""Deterministic samplers for the two objectives of models/diffusion.py, free of any distribution.

    ddim   (v_prediction)   DDIM with eta = 0 on the zero-terminal-SNR schedule, "trailing" spacing
                            t_i = round(1000 - i * 1000 / steps) - 1, i = 0..steps-1 (so t_0 = 999, pure noise).
                            From the model's v:  x0 = sqrt(a) x_t - sqrt(1 - a) v,  e = sqrt(1 - a) x_t + sqrt(a) v,
                            then x_prev = sqrt(a_prev) x0 + sqrt(1 - a_prev) e, with a_prev = 1 after the last step.
    euler  (flow_matching)  s goes 1 -> 0 in `steps` equal steps: x <- x + (s_next - s) u. The model sees the
                            integer timestep min(999, round(s * 1000)); the update uses the exact s.

Classifier-free guidance mixes the two predictions as u + g (c - u) (c conditional, u unconditional);
with g = 1 only the conditional call is made. There is no randomness inside: the same `noise` gives the
same sample bit for bit.
"""
from __future__ import annotations

from typing import Callable

import torch

from models.diffusion import NUM_TRAIN_TIMESTEPS, Objective

# predict(x_t [B, C, T, H, W], t [B] int64, conditional) -> v (v_prediction) or u (flow_matching)
Predictor = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]

SAMPLERS = {"v_prediction": "ddim", "flow_matching": "euler"}


def check_sampler(objective_kind: str, sampler: str | None) -> str:
    """The sampler to use for `objective_kind`: `sampler`, or the objective's own when None."""
    if objective_kind not in SAMPLERS:
        raise ValueError(f"unknown objective {objective_kind!r}; use one of {sorted(SAMPLERS)}")
    natural = SAMPLERS[objective_kind]
    if sampler is None:
        return natural
    if sampler not in SAMPLERS.values():
        raise ValueError(f"unknown sampler {sampler!r}; use one of {sorted(SAMPLERS.values())}")
    if sampler != natural:
        raise ValueError(f"sampler {sampler!r} does not fit objective {objective_kind!r}: "
                         f"{objective_kind} samples with {natural!r} (or leave sampler unset)")
    return sampler


def _flow_sigmas(steps: int) -> list[float]:
    """s_0 = 1 > s_1 > ... > s_steps = 0, equally spaced."""
    return [1.0 - i / steps for i in range(steps)] + [0.0]


def sampling_timesteps(objective_kind: str, steps: int, sampler: str | None = None) -> list[int]:
    """The integer timesteps the model is called with, in order (one per step)."""
    sampler = check_sampler(objective_kind, sampler)
    if not 1 <= steps <= NUM_TRAIN_TIMESTEPS:
        raise ValueError(f"steps must be in [1, {NUM_TRAIN_TIMESTEPS}], got {steps}")
    n = NUM_TRAIN_TIMESTEPS
    if sampler == "ddim":
        return [round(n - i * n / steps) - 1 for i in range(steps)]
    return [min(n - 1, round(s * n)) for s in _flow_sigmas(steps)[:-1]]


def _guided(predict: Predictor, x: torch.Tensor, t: int, guidance_scale: float) -> torch.Tensor:
    tt = torch.full((x.shape[0],), t, dtype=torch.long, device=x.device)
    c = predict(x, tt, True).float()
    if guidance_scale == 1.0:
        return c
    u = predict(x, tt, False).float()
    return u + guidance_scale * (c - u)


def _coef(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sqrt(a), sqrt(1 - a)) for a float64 alpha_bar, each rounded once to fp32."""
    return a.sqrt().float(), (1 - a).sqrt().float()


@torch.no_grad()
def sample(predict: Predictor, noise: torch.Tensor, objective: Objective, steps: int,
           sampler: str | None = None, guidance_scale: float = 1.0) -> torch.Tensor:
    """Integrate from `noise` (x_T, [B, C, T, H, W], seeded by the caller) to a clean latent, in fp32."""
    sampler = check_sampler(objective.kind, sampler)
    timesteps = sampling_timesteps(objective.kind, steps, sampler)
    x = noise.float()
    if sampler == "euler":
        sigmas = _flow_sigmas(steps)
        for i, t in enumerate(timesteps):
            x = x + (sigmas[i + 1] - sigmas[i]) * _guided(predict, x, t, guidance_scale)
        return x
    # DDIM; a_prev = 1 after the last step, so it returns the model's x0.
    ab = objective.alphas_cumprod.double()
    for i, t in enumerate(timesteps):
        (sa, s1a), v = _coef(ab[t]), _guided(predict, x, t, guidance_scale)
        x0, e = sa * x - s1a * v, s1a * x + sa * v
        sa_prev, s1a_prev = _coef(ab[timesteps[i + 1]] if i + 1 < steps else torch.tensor(1.0, dtype=torch.float64))
        x = sa_prev * x0 + s1a_prev * e
    return x
