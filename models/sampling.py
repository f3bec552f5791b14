"""Samplers for the two objectives of models/diffusion.py, free of any distribution.

    ddim   (v_prediction)   CogVideoXDDIMScheduler with eta = 0. Timesteps spaced as model.schedule.timestep_spacing
                            says, as diffusers' set_timesteps does (trailing: t_i = round(1000 - i * 1000 / steps) - 1,
                            so t_0 = 999, pure noise). From the model's v:  x0 = sqrt(a) x_t - sqrt(1 - a) v,
                            e = sqrt(1 - a) x_t + sqrt(a) v, then x_prev = sqrt(a_prev) x0 + sqrt(1 - a_prev) e with
                            a_prev = alpha_bar at t - 1000 // steps (diffusers' rule), 1 below 0.
    dpm    (v_prediction)   CogVideoXDPMScheduler: DPM-Solver++(2M) SDE in log-SNR l = log sqrt(a / (1 - a)),
                            h = l_prev - l:  x_prev = sqrt((1 - a_prev) / (1 - a)) e^-h x_t + (1 - e^-2h) sqrt(a_prev) D
                            + sqrt(1 - a_prev) sqrt(1 - e^-2h) z, with D = x0 on the first and last steps and
                            D = (1 + 1/2r) x0 - 1/2r x0_last otherwise (r = h_last / h); z ~ N(0, 1) drawn from the
                            caller's generator in diffusers' [B, T, C, H, W] order, so a generator gives the pipeline's.
    euler  (flow_matching)  s goes 1 -> 0 in `steps` equal steps: x <- x + (s_next - s) u. The model sees the
                            integer timestep min(999, round(s * 1000)); the update uses the exact s. No shift.
    flow_euler (flow_matching)  FlowMatchEulerDiscreteScheduler(shift=k, k = model.schedule.shift), its float32
                            arithmetic: r = linspace(1, k_min, steps) with k_min the shifted 1/1000, s = k r / (1 +
                            (k - 1) r) (diffusers shifts r twice at the low end: its k_min is already shifted), then 0;
                            the model sees the fractional timestep 1000 s; x <- x + (s_next - s) u. Wan 2.1's release
                            samples with `unipc`.
    flow_linear (flow_matching)  HunyuanVideoPipeline's: it passes sigmas = linspace(1, 0, steps + 1)[:-1] to
                            FlowMatchEulerDiscreteScheduler(shift=k), which shifts them in float32, s = k r / (1 +
                            (k - 1) r), then 0; the model sees 1000 s; x <- x + (s_next - s) u.
    opensora (flow_matching)  Open-Sora 2.0's (hpcaitech/Open-Sora opensora/utils/sampling.py): sigmas
                            linspace(1, 0, steps + 1) in float32, shifted by the sample's resolution
                            (get_schedule:307-332 with flow_shift unset: models/diffusion.py `open_sora_shift` of the
                            noise's [T, H, W]; model.schedule.shift is not read); the model sees 1000 s;
                            x <- x + (s_next - s) u (I2VDenoiser.denoise:159-226). Its guidance, text-to-video:
                            u + g_i (c - u), with g_i = g for the first 10 steps and the even ones, 1 on the odd
                            ones after (get_oscillation_gs:120-133; text_osci=True in configs/diffusion/inference/
                            256px.py, 768px.py), both predictions made at every step. Its image guidance multiplies
                            the difference of two predictions whose condition is the same zeros in text-to-video
                            (uncond - uncond_2 = 0): nothing to set.
    unipc  (flow_matching)  UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                            flow_shift=model.schedule.shift), Wan 2.1's release sampler: models/unipc.py.

Classifier-free guidance mixes the two predictions as u + g (c - u) (c conditional, u unconditional);
with g = 1 only the conditional call is made. CogVideoXPipeline's use_dynamic_cfg (with g > 1) replaces g at
timestep t by 1 + g (1 - cos(pi ((steps - t) / steps) ** 5)) / 2. ddim and euler have no randomness inside:
the same `noise` gives the same sample bit for bit; dpm adds the generator's draws.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np
import torch

from models.diffusion import NUM_TRAIN_TIMESTEPS, Objective, open_sora_shift, time_shift
from models.unipc import unipc_sample, unipc_schedule

# predict(x_t [B, C, T, H, W], t [B] int64 (float32: flow_euler), conditional) -> v (v_prediction) or u (flow_matching)
Predictor = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]

# Every sampler below, by the objective it integrates; a family lists those its pipeline offers, the first the
# default (FamilySpec.sampling.samplers).
SAMPLERS = {"v_prediction": ("ddim", "dpm"),
            "flow_matching": ("euler", "flow_euler", "flow_linear", "opensora", "unipc")}


def check_sampler(objective_kind: str, sampler: str | None, offered: Optional[dict] = None) -> str:
    """The sampler to use for `objective_kind`: `sampler`, or the first the family offers for it when None.
    offered: the family's FamilySpec.sampling.samplers (default: every sampler of the objective), which may name a
    sampler of the family's own (LTX-2's "ltx2": video and audio, its second stream's `sample`)."""
    offered = SAMPLERS if offered is None else offered
    if objective_kind not in SAMPLERS or objective_kind not in offered:
        raise ValueError(f"unknown objective {objective_kind!r}; use one of {sorted(offered)}")
    fitting = offered[objective_kind]
    if sampler is None:
        return fitting[0]
    known = sorted({s for group in (*SAMPLERS.values(), *offered.values()) for s in group})
    if sampler not in known:
        raise ValueError(f"unknown sampler {sampler!r}; use one of {known}")
    if sampler not in fitting:
        raise ValueError(f"sampler {sampler!r} does not fit objective {objective_kind!r}: "
                         f"{objective_kind} samples with {' or '.join(map(repr, fitting))} (or leave sampler unset)")
    return sampler


def _flow_sigmas(steps: int) -> list[float]:
    """s_0 = 1 > s_1 > ... > s_steps = 0, equally spaced."""
    return [1.0 - i / steps for i in range(steps)] + [0.0]


def flow_match_sigmas(steps: int, shift: float) -> torch.Tensor:
    """FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(steps).sigmas: [steps + 1] float32, ending at 0."""
    n, k = NUM_TRAIN_TIMESTEPS, shift
    train = torch.from_numpy(np.linspace(1, n, n, dtype=np.float32)[::-1].copy()) / n
    train = k * train / (1 + (k - 1) * train)                    # the training sigmas, float32
    r = np.linspace(train[0].item() * n, train[-1].item() * n, steps) / n
    s = torch.from_numpy(k * r / (1 + (k - 1) * r)).float()
    return torch.cat([s, torch.zeros(1)])


def linear_flow_sigmas(steps: int, shift: float) -> torch.Tensor:
    """HunyuanVideoPipeline's noise levels: FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(sigmas=
    np.linspace(1, 0, steps + 1)[:-1]).sigmas, [steps + 1] float32 ending at 0 (the shift in numpy float32)."""
    r = np.linspace(1.0, 0.0, steps + 1)[:-1].astype(np.float32)
    s = shift * r / (1 + (shift - 1) * r)
    return torch.cat([torch.from_numpy(s).float(), torch.zeros(1)])


def open_sora_sigmas(steps: int, shift: float) -> torch.Tensor:
    """Open-Sora 2.0's noise levels (opensora/utils/sampling.py:317, 330): time_shift(shift, linspace(1, 0,
    steps + 1)), [steps + 1] float32 ending at 0."""
    return time_shift(shift, torch.linspace(1, 0, steps + 1))


def oscillating_guidance(guidance_scale: float, i: int) -> float:
    """Open-Sora 2.0's text guidance at step i (get_oscillation_gs, force_num 10): g before step 10 and on even
    steps, 1 on odd steps from 10 on."""
    return guidance_scale if i < 10 or i % 2 == 0 else 1.0


def ddpm_timesteps(steps: int, spacing: str = "trailing") -> list[int]:
    """diffusers' set_timesteps of the CogVideoX schedulers (steps_offset 0), in its numpy arithmetic."""
    n = NUM_TRAIN_TIMESTEPS
    if spacing == "trailing":
        return (np.round(np.arange(n, 0, -n / steps)).astype(np.int64) - 1).tolist()
    if spacing == "leading":
        return (np.arange(0, steps) * (n // steps)).round()[::-1].astype(np.int64).tolist()
    if spacing == "linspace":
        return np.linspace(0, n - 1, steps).round()[::-1].astype(np.int64).tolist()
    raise ValueError(f"unknown timestep_spacing {spacing!r}; use trailing, leading or linspace")


def sampling_timesteps(objective_kind: str, steps: int, sampler: str | None = None,
                       spacing: str = "trailing", shift: float = 1.0) -> list:
    """The timesteps the model is called with, in order (one per step): integers, floats for flow_euler."""
    sampler = check_sampler(objective_kind, sampler)
    if not 1 <= steps <= NUM_TRAIN_TIMESTEPS:
        raise ValueError(f"steps must be in [1, {NUM_TRAIN_TIMESTEPS}], got {steps}")
    if sampler in ("ddim", "dpm"):
        return ddpm_timesteps(steps, spacing)
    if sampler in ("flow_euler", "flow_linear", "opensora"):
        sigmas = {"flow_euler": flow_match_sigmas, "flow_linear": linear_flow_sigmas}.get(sampler, open_sora_sigmas)
        return (sigmas(steps, shift)[:-1] * NUM_TRAIN_TIMESTEPS).tolist()
    if sampler == "unipc":
        return unipc_schedule(steps, shift)[1]
    n = NUM_TRAIN_TIMESTEPS
    return [min(n - 1, round(s * n)) for s in _flow_sigmas(steps)[:-1]]


def guidance_at(guidance_scale: float, t: int, steps: int, use_dynamic_cfg: bool) -> float:
    """The guidance scale at timestep t: g, or CogVideoXPipeline's dynamic one (when g > 1); g a function of t: its
    value (Wan 2.2 A14B: guidance_scale above the experts' boundary, guidance_scale_2 below)."""
    if callable(guidance_scale):
        return guidance_scale(t)
    if not use_dynamic_cfg or guidance_scale <= 1.0:
        return guidance_scale
    return 1 + guidance_scale * (1 - math.cos(math.pi * ((steps - t) / steps) ** 5.0)) / 2


def family_guidance(spec, model, guidance_scale: float, guidance_scale_2: Optional[float]):
    """The guidance `sample` takes for a model of family `spec` (FamilySpec): guidance_scale, or with
    guidance_scale_2 (val.guidance_scale_2) what the family makes of both (Wan 2.2 A14B: one per expert)."""
    if guidance_scale_2 is None:
        return guidance_scale
    if spec.sampling.guidance is None:
        raise ValueError(f"val.guidance_scale_2={guidance_scale_2}: model.family={spec.name} has one transformer; "
                         f"set val.guidance_scale only (--set val.guidance_scale_2=null)")
    return spec.sampling.guidance(model, guidance_scale, guidance_scale_2)


def _guided(predict: Predictor, x: torch.Tensor, t, guidance_scale, both: bool = False) -> torch.Tensor:
    """t: an int timestep, or a 0-dim float32 tensor (flow_euler's fractional ones); guidance_scale a float or a
    function of t (guidance_at). both: u + 1 (c - u) at scale 1, as a sampler that always makes both calls."""
    guidance_scale = guidance_at(guidance_scale, t, 0, False)
    tt = torch.full((x.shape[0],), t, dtype=torch.long, device=x.device) if isinstance(t, int) \
        else t.to(x.device).expand(x.shape[0])
    c = predict(x, tt, True).float()
    if guidance_scale == 1.0 and not both:
        return c
    u = predict(x, tt, False).float()
    return u + guidance_scale * (c - u)


def _coef(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sqrt(a), sqrt(1 - a)) for a float64 alpha_bar, each rounded once to fp32."""
    return a.sqrt().float(), (1 - a).sqrt().float()


def _dpm_step(x: torch.Tensor, v: torch.Tensor, ab: torch.Tensor, t: int, t_prev: int, t_back: Optional[int],
              x0_last: Optional[torch.Tensor], generator: torch.Generator,
              rows: Optional[tuple[range, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One CogVideoXDPMScheduler step (eta = 0, v_prediction), its float64 scalars and order of operations."""
    def noise():     # diffusers draws z in its latent order [B, T, C, H, W]; rows: this part's rows of the batch's
        shape = x.transpose(1, 2).shape
        if rows is None:
            return torch.randn(shape, generator=generator, dtype=x.dtype).transpose(1, 2)
        z = torch.randn((rows[1], *shape[1:]), generator=generator, dtype=x.dtype)
        return z[rows[0].start:rows[0].stop].transpose(1, 2)

    a, one = ab[t], torch.tensor(1.0, dtype=torch.float64)
    a_prev = ab[t_prev] if t_prev >= 0 else one
    x0 = (a ** 0.5) * x - ((1 - a) ** 0.5) * v
    lamb = ((a / (1 - a)) ** 0.5).log()
    h = ((a_prev / (1 - a_prev)) ** 0.5).log() - lamb
    mult1 = ((1 - a_prev) / (1 - a)) ** 0.5 * (-h).exp()
    mult2 = (-2 * h).expm1() * a_prev ** 0.5
    mult_noise = (1 - a_prev) ** 0.5 * (1 - (-2 * h).exp()) ** 0.5
    x_prev = mult1 * x - mult2 * x0 + mult_noise * noise()
    if x0_last is None or t_prev < 0:
        return x_prev, x0
    a_back = ab[t_back]
    r = (lamb - ((a_back / (1 - a_back)) ** 0.5).log()) / h
    denoised = (1 + 1 / (2 * r)) * x0 - (1 / (2 * r)) * x0_last
    return mult1 * x - mult2 * denoised + mult_noise * noise(), x0


@torch.no_grad()
def sample(predict: Predictor, noise: torch.Tensor, objective: Objective, steps: int,
           sampler: str | None = None, guidance_scale: float | Callable = 1.0, *, use_dynamic_cfg: bool = False,
           generator: Optional[torch.Generator] = None, rows: Optional[tuple[range, int]] = None) -> torch.Tensor:
    """Integrate from `noise` (x_T, [B, C, T, H, W], seeded by the caller) to a clean latent, in fp32.
    dpm draws its step noise from `generator`. rows = (r, N): `noise` is rows r of a batch of N (a data-parallel
    replica's share); dpm then draws the whole batch's step noise and keeps rows r, so the share's sample
    equals those rows of the whole batch's."""
    if rows is not None and len(rows[0]) != noise.shape[0]:
        raise ValueError(f"rows {rows[0]} of {rows[1]} do not fit a noise batch of {noise.shape[0]}")
    sampler = check_sampler(objective.kind, sampler)
    spacing = objective.schedule.timestep_spacing
    timesteps = sampling_timesteps(objective.kind, steps, sampler, spacing)
    x = noise.float()
    if sampler == "opensora":
        if use_dynamic_cfg:
            raise ValueError("val.use_dynamic_cfg is CogVideoX's guidance; the opensora sampler oscillates its own "
                             "(set --set val.use_dynamic_cfg=false, or another sampler)")
        sigmas = open_sora_sigmas(steps, open_sora_shift(tuple(noise.shape)))
        for i in range(steps):
            g = oscillating_guidance(guidance_scale, i)
            u = _guided(predict, x, sigmas[i] * NUM_TRAIN_TIMESTEPS, g, both=guidance_scale != 1.0)
            x = x + (sigmas[i + 1] - sigmas[i]) * u
        return x
    if sampler == "unipc":
        return unipc_sample(lambda x_, t: _guided(predict, x_, t, guidance_scale), x, steps, objective.schedule.shift)
    if sampler in ("flow_euler", "flow_linear"):
        sigmas = (flow_match_sigmas if sampler == "flow_euler" else linear_flow_sigmas)(steps, objective.schedule.shift)
        for i in range(steps):
            x = x + (sigmas[i + 1] - sigmas[i]) * _guided(predict, x, sigmas[i] * NUM_TRAIN_TIMESTEPS, guidance_scale)
        return x
    if sampler == "euler":
        sigmas = _flow_sigmas(steps)
        for i, t in enumerate(timesteps):
            x = x + (sigmas[i + 1] - sigmas[i]) * _guided(predict, x, t, guidance_scale)
        return x
    stride = NUM_TRAIN_TIMESTEPS // steps            # diffusers: the previous timestep is t - 1000 // steps
    if sampler == "dpm":
        if generator is None:
            raise ValueError("the dpm sampler draws noise at every step: pass a torch.Generator")
        ab, x0_last = objective.alphas_cumprod64, None
        for i, t in enumerate(timesteps):
            v = _guided(predict, x, t, guidance_at(guidance_scale, t, steps, use_dynamic_cfg))
            x, x0_last = _dpm_step(x, v, ab, t, t - stride, timesteps[i - 1] if i > 0 else None, x0_last, generator,
                                   rows)
        return x
    # DDIM; a_prev = 1 below timestep 0, so the last step returns the model's x0.
    ab = objective.alphas_cumprod.double()
    for t in timesteps:
        (sa, s1a), v = _coef(ab[t]), _guided(predict, x, t, guidance_at(guidance_scale, t, steps, use_dynamic_cfg))
        x0, e = sa * x - s1a * v, s1a * x + sa * v
        sa_prev, s1a_prev = _coef(ab[t - stride] if t - stride >= 0 else torch.tensor(1.0, dtype=torch.float64))
        x = sa_prev * x0 + s1a_prev * e
    return x
