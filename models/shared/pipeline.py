"""VAE latent formats and text encoders that more than one family's pipeline uses (FamilySpec.formats.vae,
text_encoder).

- VAE `AutoencoderKLCogVideoX` (CogVideoX; STDiT trains on its latents): z = scaling_factor * (x - shift_factor)
  (CogVideoX trains on `latent_dist.sample() * scaling_factor`; shift_factor is None there, i.e. 0); decoding
  x = z / scaling_factor + shift_factor. The encoder halves H and W in every down block but the last, and T
  in the first log2(temporal_compression_ratio) of those.
- Text `T5EncoderModel` (CogVideoX, STDiT; `CogVideoXPipeline._get_t5_prompt_embeds`): the caption tokenised to
  exactly max_len tokens (padded, truncated), encoded without an attention mask; every row kept (CogVideoX attends
  to all 226).
- `ScaledLatents`: training latents z * scaling_factor, decoded z / scaling_factor (HunyuanVideo's and
  HunyuanVideo 1.5's VAEs; each family's pipeline.py names its VAE class, channels and compression).
"""
from __future__ import annotations

import math

import torch

from models.spec import TextEncoderFormat


class ScaledLatents:
    """Training latents z * scaling_factor; decoded as z / scaling_factor."""

    @staticmethod
    def normalise(z: torch.Tensor, config) -> torch.Tensor:
        return z * config.scaling_factor

    @staticmethod
    def denormalise(z: torch.Tensor, config) -> torch.Tensor:
        return z / config.scaling_factor


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


T5 = TextEncoderFormat(class_name="T5EncoderModel", model_type="t5", masked=False, clean=False)
