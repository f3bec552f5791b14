"""Diffusion objectives: v-prediction on a DDPM schedule (CogVideoX) and rectified flow matching.

Both turn a clean latent x0, noise e and a timestep into (model input x_t, regression target):

    v-prediction   x_t = sqrt(a_t) x0 + sqrt(1 - a_t) e,   target v = sqrt(a_t) e - sqrt(1 - a_t) x0
    flow matching  x_t = (1 - s) x0 + s e,                  target u = e - x0
                   s = k r / (1 + (k - 1) r) at r = t / T (k = model.schedule.shift: 1 is no shift, Wan 2.1 3 or 5);
                   the model is conditioned on T s (`model_timesteps`), fractional when k != 1, as
                   FlowMatchEulerDiscreteScheduler gives it. With model.schedule.sigma_min > 0 (Open-Sora 2.0's
                   1e-5, after MovieGen): x_t = (1 - s) x0 + (1 - (1 - sigma_min)(1 - s)) e, target
                   u = (1 - sigma_min) e - x0 (hpcaitech/Open-Sora scripts/diffusion/train.py:433-434, 443/462)

The DDPM schedule is the release's, as diffusers' CogVideoXDDIMScheduler builds it from the
scheduler_config.json keys of `model.schedule` (models/config.py NoiseSchedule): scaled-linear betas from
0.00085 to 0.012 over 1000 steps, alpha_bar = cumprod(1 - beta), the SNR shift
alpha_bar / (s + (1 - s) alpha_bar) (s = snr_shift_scale: 3.0 for CogVideoX-2B, 1.0 for 5B), then the
rescale to zero terminal SNR.

Timesteps: t is [B] (one per sample, `PerSample`) or [B, T, H, W] (one per latent position, a family whose
FamilySpec.timesteps draws per token); noising broadcasts either over the latent [B, C, T, H, W]. Integer t is a
draw r = t / 1000 that the schedule shifts; a floating-point t (flow matching only) is already the noise level s
in (0, 1] (a family whose draw shifts by the sample's own resolution, Open-Sora 2.0's `open_sora_shift`): no
further shift, and the model sees 1000 s.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from models.config import NoiseSchedule

NUM_TRAIN_TIMESTEPS = 1000


def ddpm_alphas_cumprod(num_steps: int = NUM_TRAIN_TIMESTEPS, beta_start: float = 0.00085,
                        beta_end: float = 0.012, snr_shift_scale: float = 1.0,
                        rescale_betas_zero_snr: bool = True) -> torch.Tensor:
    """alpha_bar_t, t = 0..num_steps-1, in float64 (diffusers' order of operations)."""
    betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_steps, dtype=torch.float64) ** 2
    ab = torch.cumprod(1.0 - betas, 0)
    ab = ab / (snr_shift_scale + (1 - snr_shift_scale) * ab)     # s = 1: exactly ab
    if not rescale_betas_zero_snr:
        return ab
    sqrt_ab = ab.sqrt()
    # Zero terminal SNR (Lin et al. 2024): shift and scale sqrt(alpha_bar) so the last step is pure noise.
    first, last = sqrt_ab[0].clone(), sqrt_ab[-1].clone()
    sqrt_ab = (sqrt_ab - last) * first / (first - last)
    return sqrt_ab ** 2


class PerSample:
    """One training timestep per sample, uniform over [0, 1000) (FamilySpec.timesteps of CogVideoX, Wan 2.1, STDiT)."""

    per_token = False

    @staticmethod
    def draw(generator: torch.Generator, latent_shape, model) -> torch.Tensor:
        return torch.randint(0, NUM_TRAIN_TIMESTEPS, (1,), generator=generator)     # [1]


PER_SAMPLE = PerSample()


def time_shift(alpha: float, t: torch.Tensor) -> torch.Tensor:
    """hpcaitech/Open-Sora opensora/utils/sampling.py:295-296 (SD3's shift), its order of operations."""
    return alpha * t / (1 + (alpha - 1) * t)


def open_sora_shift(latent_shape: tuple[int, ...]) -> float:
    """Open-Sora 2.0's resolution-dependent shift of a latent [..., T, H, W] (2 x 2 patches): the line through
    (256 patches, 1) and (4096, 3) at the patches per frame, times sqrt(T) (scripts/diffusion/train.py:386-388;
    get_res_lin_function, opensora/utils/sampling.py:299-304; get_schedule:320-328 alike at sampling)."""
    t, h, w = latent_shape[-3:]
    m = (3 - 1) / (4096 - 256)
    alpha = m * ((w * h) // 4) + (1 - m * 256)
    return alpha * math.sqrt(t)


def _over_latent(t: torch.Tensor, x0: torch.Tensor) -> tuple[int, ...]:
    """The view of t ([B] or [B, T, H, W]) that broadcasts over x0 [B, C, T, H, W]."""
    if t.dim() == 1:
        return (-1,) + (1,) * (x0.dim() - 1)
    return (t.shape[0], 1, *t.shape[1:])


class Objective:
    """Noising and targets for one objective; `alphas_cumprod` (fp32; `alphas_cumprod64` in float64) is
    built once from `schedule` (default: NoiseSchedule(), CogVideoX-5B's)."""

    def __init__(self, kind: str, schedule: Optional[NoiseSchedule] = None):
        if kind not in ("v_prediction", "flow_matching"):
            raise ValueError(f"unknown objective {kind!r}; use v_prediction or flow_matching")
        self.kind = kind
        self.schedule = schedule or NoiseSchedule()
        s = self.schedule
        self.alphas_cumprod64 = ddpm_alphas_cumprod(NUM_TRAIN_TIMESTEPS, s.beta_start, s.beta_end, s.snr_shift_scale,
                                                    s.rescale_betas_zero_snr)
        self.alphas_cumprod = self.alphas_cumprod64.float()

    @classmethod
    def of(cls, model) -> "Objective":
        """The objective of a `model:` section: model.objective on model.schedule."""
        return cls(model.objective, model.schedule)

    def noised(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x0, noise: [B, C, T, H, W]; t: [B] or [B, T, H, W] integer timesteps in [0, 1000). Returns (x_t, target)."""
        shape = _over_latent(t, x0)
        if self.kind == "v_prediction":
            a = self.alphas_cumprod.to(x0.device)[t].view(shape)
            return a.sqrt() * x0 + (1 - a).sqrt() * noise, a.sqrt() * noise - (1 - a).sqrt() * x0
        s = self.flow_sigmas(t).view(shape)
        if not self.schedule.sigma_min:
            return (1 - s) * x0 + s * noise, noise - x0
        m, t_rev = self.schedule.sigma_min, 1 - s        # Open-Sora's order (scripts/diffusion/train.py:433-434)
        return t_rev * x0 + (1 - (1 - m) * t_rev) * noise, (1 - m) * noise - x0

    def flow_sigmas(self, t: torch.Tensor) -> torch.Tensor:
        """flow_matching's noise level of integer timesteps t (any shape): r = t / 1000, shifted (fp32); of
        floating-point t: t itself (a draw that is already the noise level)."""
        if t.is_floating_point():
            return t.float()
        r, k = t.float() / NUM_TRAIN_TIMESTEPS, self.schedule.shift
        return r if k == 1 else k * r / (1 + (k - 1) * r)

    def model_timesteps(self, t: torch.Tensor) -> torch.Tensor:
        """The timestep the model sees for timesteps t [B]: an integer t itself, but 1000 sigma under a shifted
        flow schedule or for a floating-point t (the model learns the noise level it is sampled at)."""
        if self.kind == "flow_matching" and (self.schedule.shift != 1 or t.is_floating_point()):
            return self.flow_sigmas(t) * NUM_TRAIN_TIMESTEPS
        return t


def mse_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error in fp32 whatever the model's dtype."""
    return torch.nn.functional.mse_loss(prediction.float(), target.float())
