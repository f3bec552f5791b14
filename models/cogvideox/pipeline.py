"""What CogVideoX's released pipeline feeds its transformer and samples it with (FamilySpec.vae, text_encoder,
sampling): the VAE latents, the T5 text input and the DDPM schedulers.

- VAE `AutoencoderKLCogVideoX`: z = scaling_factor * (x - shift_factor) (CogVideoX trains on
  `latent_dist.sample() * scaling_factor`; shift_factor is None there, i.e. 0); decoding
  x = z / scaling_factor + shift_factor. The encoder halves H and W in every down block but the last, and T
  in the first log2(temporal_compression_ratio) of those.
- Text `T5EncoderModel` (`CogVideoXPipeline._get_t5_prompt_embeds`): the caption tokenised to exactly max_len
  tokens (padded, truncated), encoded without an attention mask; every row kept (CogVideoX attends to all 226).
- Schedulers: CogVideoXDDIMScheduler (2B) / CogVideoXDPMScheduler (5B), v-prediction: models/sampling.py's
  ddim and dpm; their constructor defaults (the same in both) fill keys absent from scheduler_config.json.
"""
from __future__ import annotations

import math

import torch

from models.scheduler_config import DiffusersScheduler
from models.spec import Sampling, TextEncoderFormat


class CogVideoXLatents:
    class_name = "AutoencoderKLCogVideoX"
    release = "the vae/ folder of a CogVideoX release"

    @staticmethod
    def channels(config: dict) -> int | None:
        return config.get("latent_channels")

    @staticmethod
    def compression(config: dict) -> tuple[int, int]:
        down = len(config.get("down_block_types", ())) - 1
        level = int(math.log2(config.get("temporal_compression_ratio", 4)))
        return 2 ** min(level, down), 2 ** down

    @staticmethod
    def normalise(z: torch.Tensor, config) -> torch.Tensor:
        """Posterior latent (1, C, T, H, W) fp32 -> training latent."""
        return (z - (config.get("shift_factor") or 0.0)) * config["scaling_factor"]

    @staticmethod
    def denormalise(z: torch.Tensor, config) -> torch.Tensor:
        """Training latent (1, C, T, H, W) fp32 -> what vae.decode takes."""
        return z / config["scaling_factor"] + (config.get("shift_factor") or 0.0)


T5 = TextEncoderFormat(class_name="T5EncoderModel", model_type="t5", masked=False, clean=False)

# diffusers' CogVideoXDDIMScheduler / CogVideoXDPMScheduler constructor defaults (the same in both).
SCHEDULER = DiffusersScheduler(
    defaults={"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
              "trained_betas": None, "set_alpha_to_one": True, "steps_offset": 0, "prediction_type": "epsilon",
              "timestep_spacing": "leading", "rescale_betas_zero_snr": False, "snr_shift_scale": 3.0},
    release="the CogVideoX releases")

# v_prediction: the pipelines' DDIM (2B) and DPM (5B); flow_matching (a toolkit option): the flow samplers.
SAMPLING = Sampling(samplers={"v_prediction": ("ddim", "dpm"), "flow_matching": ("euler", "flow_euler", "unipc")},
                    scheduler=SCHEDULER)
