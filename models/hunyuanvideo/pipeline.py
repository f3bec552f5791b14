"""What HunyuanVideo's released pipeline (HunyuanVideoPipeline, diffusers 0.42) feeds its transformer and samples it
with (FamilySpec.formats.vae, text_encoder, FamilySpec.sampling).

- VAE `AutoencoderKLHunyuanVideo`: training latents z * scaling_factor (0.476986 in the release's config), decoded
  as the pipeline does, z / scaling_factor; 4 x temporal, 8 x spatial compression, 16 channels.
- Text: the LLaMA states (a chat template, hidden_states[-3], the template's tokens cropped) with the CLIP text
  model's pooled vector beside them on every row (models/hunyuanvideo/config.py), encoded by
  models/hunyuanvideo/captions.py from the pipeline folder (`prepared=False`: not the T5 path; `encoder`: its own).
- Scheduler: FlowMatchEulerDiscreteScheduler with shift 7.0 (model.schedule.shift), given the pipeline's sigmas
  linspace(1, 0, steps + 1)[:-1]: the toolkit's `flow_linear` (the default; `flow_euler` takes that scheduler's
  own spacing). The embedded guidance is the pipeline's default guidance_scale 6.0 (x 1000); its true_cfg_scale
  with a negative prompt is the toolkit's val.guidance_scale with the unconditional text. Open-Sora 2.0
  (configs/opensora2.0.yaml) samples with `opensora`: its own shifted linspace(1, 0) and oscillating text guidance
  (models/sampling.py).
"""
from __future__ import annotations

from models.hunyuanvideo.captions import caption_encoder
from models.shared.pipeline import ScaledLatents
from models.spec import Sampling, TextEncoderFormat


class HunyuanLatents(ScaledLatents):
    class_name = "AutoencoderKLHunyuanVideo"
    release = "the vae/ folder of a HunyuanVideo diffusers release"

    @staticmethod
    def channels(config: dict) -> int | None:
        return config.get("latent_channels", 16)

    @staticmethod
    def compression(config: dict) -> tuple[int, int]:
        return config.get("temporal_compression_ratio", 4), config.get("spatial_compression_ratio", 8)


LLAMA_CLIP = TextEncoderFormat(class_name="LlamaModel", model_type="llama", masked=True, clean=False, prepared=False,
                               encoder=caption_encoder)

SAMPLING = Sampling(samplers={"flow_matching": ("flow_linear", "flow_euler", "opensora", "euler")}, scheduler=None)
