"""The family's training timesteps (FamilySpec.timesteps), chosen by model.train_timesteps.

- uniform (HunyuanVideo): an integer timestep uniform over [0, 1000), shifted by model.schedule.shift
  (models/diffusion.py `PerSample`).
- opensora (Open-Sora 2.0, hpcaitech/Open-Sora @ 7ad6a96, scripts/diffusion/train.py:384-390): t = sigmoid(n),
  n ~ N(0, 1) (a logit-normal draw), then shifted by the sample's own resolution, s = a t / (1 + (a - 1) t) with
  a = (1 + (patches per latent frame - 256) / 1920) x sqrt(latent frames) (models/diffusion.py `open_sora_shift`),
  so each bucket gets its own shift; model.schedule.shift is not read. The draw is the noise level s itself
  (a float32 [1]): models/diffusion.py noises with it (and model.schedule.sigma_min) and the model sees 1000 s, as
  Open-Sora's time_in(sinusoid(1000 t)). Open-Sora draws the batch's n from the global generator and rounds t to
  the training dtype; here n is the sample's own draw (from its generator, after its noise), in float32.
"""
from __future__ import annotations

import torch

from models.diffusion import PER_SAMPLE, open_sora_shift, time_shift


class HunyuanTimesteps:
    per_token = False

    @staticmethod
    def draw(generator: torch.Generator, latent_shape: tuple[int, ...], model) -> torch.Tensor:
        if model.train_timesteps == "uniform":
            return PER_SAMPLE.draw(generator, latent_shape, model)
        t = torch.sigmoid(torch.randn(1, generator=generator))             # train.py:389
        return time_shift(open_sora_shift(latent_shape), t)                # train.py:386-390


HUNYUAN_TIMESTEPS = HunyuanTimesteps()
