"""The VAE folders prepare_data reads, keyed by the `_class_name` of their config.json: how each class
compresses a clip and how its pipeline normalises latents (a file format, so keyed by class, not by family;
a family names the class it trains on in FamilySpec.vae).

- `AutoencoderKLCogVideoX`: z = scaling_factor * (x - shift_factor) (CogVideoX trains on
  `latent_dist.sample() * scaling_factor`; shift_factor is None there, i.e. 0); decoding
  x = z / scaling_factor + shift_factor. The encoder halves H and W in every down block but the last, and T
  in the first log2(temporal_compression_ratio) of those.
- `AutoencoderKLWan`: per channel c, z_c = (x_c - latents_mean[c]) / latents_std[c] (finetrainers'
  WanLatentEncodeProcessor + `_normalize_latents`: (x - mean) * (1 / std), training on a posterior draw);
  decoding as WanPipeline.__call__ (diffusers 0.42): x = z / (1 / latents_std) + latents_mean. The encoder
  halves H and W at every level but the last (len(dim_mult) - 1 times; times patch_size for a patchified VAE)
  and T where temperal_downsample is true.
diffusers is imported only when a VAE is loaded (the optional [data] extra).
"""
from __future__ import annotations

import math

import torch


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


VAES = {f.class_name: f for f in (CogVideoXLatents, WanLatents)}
