"""What Wan 2.1's released pipeline (WanPipeline, diffusers 0.42) feeds its transformer and samples it with
(FamilySpec.formats.vae, text_encoder, FamilySpec.sampling).

- VAE `AutoencoderKLWan`: per channel c, z_c = (x_c - latents_mean[c]) / latents_std[c] (finetrainers'
  WanLatentEncodeProcessor + `_normalize_latents`: (x - mean) * (1 / std), training on a posterior draw);
  decoding as WanPipeline.__call__: x = z / (1 / latents_std) + latents_mean. The encoder halves H and W at
  every level but the last (len(dim_mult) - 1 times; times patch_size for a patchified VAE) and T where
  temperal_downsample is true.
- Text `UMT5EncoderModel` (`WanPipeline._get_t5_prompt_embeds`): the caption cleaned (`prompt_clean`: ftfy when
  installed, HTML entities unescaped twice, runs of whitespace to one space), tokenised to max_len with the
  attention mask, encoded with that mask; the rows of the n real tokens kept and rows n..max_len-1 set to zero.
- Scheduler: UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=k)
  (models/unipc.py); flow matching with a timestep shift (model.schedule.shift).
"""
from __future__ import annotations

import torch

from models.scheduler_config import DiffusersScheduler
from models.spec import Sampling, TextEncoderFormat
from models.wan.experts import guidance


class WanLatents:
    class_name = "AutoencoderKLWan"
    release = "the vae/ folder of a Wan 2.1 diffusers release"

    @staticmethod
    def channels(config: dict) -> int | None:
        return config.get("z_dim", 16)

    @staticmethod
    def compression(config: dict) -> tuple[int, int]:
        down = len(config.get("dim_mult", (1, 2, 4, 4))) - 1
        temporal = sum(bool(d) for d in config.get("temperal_downsample", (False, True, True)))
        return 2 ** temporal, 2 ** down * (config.get("patch_size") or 1)

    @staticmethod
    def _stats(config, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latents_mean, latents_std as (1, C, 1, 1, 1) fp32 on z's device."""
        mean, std = (torch.tensor(config[k], dtype=torch.float32).view(1, -1, 1, 1, 1).to(z.device)
                     for k in ("latents_mean", "latents_std"))
        return mean, std

    @classmethod
    def normalise(cls, z: torch.Tensor, config) -> torch.Tensor:
        mean, std = cls._stats(config, z)
        return (z - mean) / std

    @classmethod
    def denormalise(cls, z: torch.Tensor, config) -> torch.Tensor:
        mean, std = cls._stats(config, z)
        return z / (1.0 / std) + mean          # WanPipeline's own arithmetic, so decoding matches it bit for bit


UMT5 = TextEncoderFormat(class_name="UMT5EncoderModel", model_type="umt5", masked=True, clean=True)

# diffusers' UniPCMultistepScheduler constructor defaults, for the keys a DDPM-schedule check reads (a Wan
# release ships it with flow sigmas, which needs only model.objective flow_matching).
SCHEDULER = DiffusersScheduler(
    defaults={"num_train_timesteps": 1000, "beta_start": 0.0001, "beta_end": 0.02, "beta_schedule": "linear",
              "trained_betas": None, "steps_offset": 0, "prediction_type": "epsilon", "timestep_spacing": "linspace",
              "rescale_betas_zero_snr": False},
    release="the Wan 2.1 releases")

# flow_matching: Euler (the toolkit's default), FlowMatchEulerDiscreteScheduler's, and the release's UniPC;
# v_prediction (a toolkit option) with the DDPM samplers.
SAMPLING = Sampling(samplers={"v_prediction": ("ddim", "dpm"), "flow_matching": ("euler", "flow_euler", "unipc")},
                    scheduler=SCHEDULER, guidance=guidance)      # guidance_scale_2: Wan 2.2 A14B's low-noise expert
