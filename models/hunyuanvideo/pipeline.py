"""What HunyuanVideo's released pipeline (HunyuanVideoPipeline, diffusers 0.42) feeds its transformer and samples it
with (FamilySpec.vae, text_encoder, sampling).

- VAE `AutoencoderKLHunyuanVideo`: training latents z * scaling_factor (0.476986 in the release's config), decoded
  as the pipeline does, z / scaling_factor; 4 x temporal, 8 x spatial compression, 16 channels.
- Text: the LLaMA states (a chat template, hidden_states[-3], the template's tokens cropped) with the CLIP text
  model's pooled vector beside them on every row (models/hunyuanvideo/config.py). The toolkit does not encode
  captions this way yet: `prepared=False`, so `prepare_data` and `data.text_encoder` refuse the family by name
  rather than encode a LLaMA folder as a T5 one.
- Scheduler: FlowMatchEulerDiscreteScheduler with shift 7.0 (model.schedule.shift); validation samples with the
  toolkit's `flow_euler` (that scheduler's default spacing; the pipeline passes its own sigmas: docs/models.md).
"""
from __future__ import annotations

import torch

from models.spec import Sampling, TextEncoderFormat


class HunyuanLatents:
    class_name = "AutoencoderKLHunyuanVideo"
    release = "the vae/ folder of a HunyuanVideo diffusers release"

    @staticmethod
    def channels(config: dict) -> int | None:
        return config.get("latent_channels", 16)

    @staticmethod
    def compression(config: dict) -> tuple[int, int]:
        return config.get("temporal_compression_ratio", 4), config.get("spatial_compression_ratio", 8)

    @staticmethod
    def normalise(z: torch.Tensor, config) -> torch.Tensor:
        return z * config.scaling_factor

    @staticmethod
    def denormalise(z: torch.Tensor, config) -> torch.Tensor:
        return z / config.scaling_factor


LLAMA_CLIP = TextEncoderFormat(class_name="LlamaModel", model_type="llama", masked=True, clean=False, prepared=False)

SAMPLING = Sampling(samplers={"flow_matching": ("flow_euler", "euler")}, scheduler=None)
