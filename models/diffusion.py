"""Diffusion objectives: v-prediction on a DDPM schedule (CogVideoX) and rectified flow matching.

Both turn a clean latent x0, noise e and a timestep into (model input x_t, regression target):

    v-prediction   x_t = sqrt(a_t) x0 + sqrt(1 - a_t) e,   target v = sqrt(a_t) e - sqrt(1 - a_t) x0
    flow matching  x_t = (1 - s) x0 + s e  (s = t / T),     target u = e - x0

The DDPM schedule is CogVideoX's: scaled-linear betas from 0.00085 to 0.012 over 1000 steps, rescaled
to zero terminal SNR.
"""
from __future__ import annotations

import torch

NUM_TRAIN_TIMESTEPS = 1000


def ddpm_alphas_cumprod(num_steps: int = NUM_TRAIN_TIMESTEPS, beta_start: float = 0.00085,
                        beta_end: float = 0.012) -> torch.Tensor:
    betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_steps, dtype=torch.float64) ** 2
    sqrt_ab = torch.cumprod(1.0 - betas, 0).sqrt()
    # Zero terminal SNR (Lin et al. 2024): shift and scale sqrt(alpha_bar) so the last step is pure noise.
    first, last = sqrt_ab[0].clone(), sqrt_ab[-1].clone()
    sqrt_ab = (sqrt_ab - last) * first / (first - last)
    return (sqrt_ab ** 2).float()


class Objective:
    """Noising and targets for one objective; `alphas_cumprod` is built once."""

    def __init__(self, kind: str):
        if kind not in ("v_prediction", "flow_matching"):
            raise ValueError(f"unknown objective {kind!r}; use v_prediction or flow_matching")
        self.kind = kind
        self.alphas_cumprod = ddpm_alphas_cumprod()

    def noised(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x0, noise: [B, C, T, H, W]; t: [B] integer timesteps in [0, 1000). Returns (x_t, target)."""
        shape = (-1,) + (1,) * (x0.dim() - 1)
        if self.kind == "v_prediction":
            a = self.alphas_cumprod.to(x0.device)[t].view(shape)
            return a.sqrt() * x0 + (1 - a).sqrt() * noise, a.sqrt() * noise - (1 - a).sqrt() * x0
        s = (t.float() / NUM_TRAIN_TIMESTEPS).view(shape)
        return (1 - s) * x0 + s * noise, noise - x0


def mse_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error in fp32 whatever the model's dtype."""
    return torch.nn.functional.mse_loss(prediction.float(), target.float())
