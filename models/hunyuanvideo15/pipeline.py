"""What HunyuanVideo 1.5's released pipelines (HunyuanVideo15Pipeline, HunyuanVideo15ImageToVideoPipeline, diffusers
0.42) feed the transformer and sample it with (FamilySpec.formats.vae, text_encoder, FamilySpec.sampling).

- VAE `AutoencoderKLHunyuanVideo15`: training latents z * scaling_factor (1.03682 by default), decoded as the
  pipelines do, z / scaling_factor; 4 x temporal, 16 x spatial compression, 32 channels.
- Text: Qwen2.5-VL states (a chat template, hidden_states[-3], the template's 108 tokens cropped, 1000 rows), byT5
  states of the caption's quoted text (256 rows) and, for image-to-video, SigLIP states of the first frame (729
  rows), packed as rows of one text input (models/hunyuanvideo15/config.py). The family's own encoder
  (models/hunyuanvideo15/captions.py) encodes captions so from a pipeline folder, the SigLIP rows zero:
  `prepare_data --t5` and `data.text_encoder` take that folder; image-to-video's SigLIP states of the first frame
  (models/hunyuanvideo15/siglip.py, `--image-encoder`) fill them in training and sampling.
- Scheduler: FlowMatchEulerDiscreteScheduler with the release's shift (model.schedule.shift), given the sigmas
  linspace(1, 0, steps + 1)[:-1] as HunyuanVideoPipeline's: the toolkit's `flow_linear` (the default); guidance
  ClassifierFreeGuidance's u + g (c - u); text-to-video feeds zero condition latents, mask and image states.
"""
from __future__ import annotations

from models.hunyuanvideo15.captions import caption_encoder
from models.shared.pipeline import ScaledLatents
from models.spec import Sampling, TextEncoderFormat


class Hunyuan15Latents(ScaledLatents):
    class_name = "AutoencoderKLHunyuanVideo15"
    release = "the vae/ folder of a HunyuanVideo 1.5 diffusers release"

    @staticmethod
    def channels(config: dict) -> int | None:
        return config.get("latent_channels", 32)

    @staticmethod
    def compression(config: dict) -> tuple[int, int]:
        return config.get("temporal_compression_ratio", 4), config.get("spatial_compression_ratio", 16)


QWEN_BYT5 = TextEncoderFormat(class_name="Qwen2_5_VLTextModel", model_type="qwen2_5_vl", masked=True, clean=False,
                              prepared=False, encoder=caption_encoder)

SAMPLING = Sampling(samplers={"flow_matching": ("flow_linear", "flow_euler", "euler")}, scheduler=None)
