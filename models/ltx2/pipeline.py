"""What LTX-2's released pipelines (LTX2Pipeline, LTX2ImageToVideoPipeline, diffusers 0.42) feed the transformer
(FamilySpec.formats.vae, text_encoder, FamilySpec.sampling), and how data preparation makes it.

- VAE `AutoencoderKLLTX2Video`: compression as the class computes it (the release: 8 x temporal, 32 x spatial,
  128 channels). The pipelines normalise latents per channel with the VAE's `latents_mean` / `latents_std`
  *buffers* ((z - mean) x scaling_factor / std), which config.json does not hold: models/vae.py hands them over
  from the loaded VAE (`buffers`); normalising from config.json alone is refused by name.
- Audio (`AutoencoderKLLTX2Audio`, the release's audio_vae/): the clip's sound track as a log-mel spectrogram,
  encoded, packed and normalised as the pipeline's audio latents (models/ltx2/audio.py).
- Text: Gemma-3 hidden states through the pipeline's connector (LTX2TextConnectors), a caption state for each
  stream (models/ltx2/captions.py; `prepare_data --t5 <release folder>`). Encoding while training
  (`data.text_encoder`) is refused by name (LTX2Config.unsupported): prepare the captions.
- Scheduler: LTX2Pipeline's denoising loop, video and audio together (the sampler "ltx2", the family's own:
  models/ltx2/sampling.py, which the audio stream's `sample` runs); the release's scheduler_config.json is not
  read (its values are written there), so there is no release scheduler check. Guidance: the video's scale and the
  audio's (val.guidance_scale_2), as the pipeline's guidance_scale and audio_guidance_scale.
"""
from __future__ import annotations

import torch

from models.ltx2.captions import caption_encoder
from models.spec import Sampling, TextEncoderFormat


class LTX2Latents:
    class_name = "AutoencoderKLLTX2Video"
    release = "the vae/ folder of an LTX-2 diffusers release (Lightricks/LTX-2)"

    @staticmethod
    def channels(config: dict) -> int | None:
        return config.get("latent_channels", 128)

    @staticmethod
    def compression(config: dict) -> tuple[int, int]:
        scaling = config.get("spatio_temporal_scaling", (True, True, True, True))
        steps = 2 ** (sum(scaling) if isinstance(scaling, (list, tuple)) else 4 * bool(scaling))
        return (config.get("temporal_compression_ratio") or config.get("patch_size_t", 1) * steps,
                config.get("spatial_compression_ratio") or config.get("patch_size", 4) * steps)

    buffers = ("latents_mean", "latents_std")     # what models/vae.py hands over beside the VAE's config

    @staticmethod
    def normalise(z: torch.Tensor, config) -> torch.Tensor:
        """LTX2Pipeline._normalize_latents: (z - mean) x scaling_factor / std, per channel."""
        mean, std, scale = latent_statistics(z, config)
        return (z - mean) * scale / std

    @staticmethod
    def denormalise(z: torch.Tensor, config) -> torch.Tensor:
        """LTX2Pipeline._denormalize_latents: z x std / scaling_factor + mean."""
        mean, std, scale = latent_statistics(z, config)
        return z * std / scale + mean


def latent_statistics(z: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(mean, std) [1, C, 1, 1, 1] and scaling_factor: the loaded VAE's buffers (models/vae.py `statistics`), never
    config.json's defaults."""
    if "latents_mean" not in config:
        raise NotImplementedError("LTX-2 latents are normalised with AutoencoderKLLTX2Video's latents_mean / "
                                  "latents_std buffers, which its config.json does not hold: load the VAE "
                                  "(models.vae.load_vae) and normalise with models.vae.encode (docs/models.md#ltx-2)")
    mean, std = (config[k].view(1, -1, 1, 1, 1).to(z.device, z.dtype) for k in LTX2Latents.buffers)
    return mean, std, config.get("scaling_factor", 1.0)


GEMMA3 = TextEncoderFormat(class_name="Gemma3ForConditionalGeneration", model_type="gemma3", masked=True,
                           clean=False, prepared=False, encoder=caption_encoder)


def guidance(model, guidance_scale: float, guidance_scale_2: float) -> tuple[float, float]:
    """(video, audio) guidance: guidance_scale and guidance_scale_2 (val.guidance_scale_2, parallel.sample's
    --guidance-2), LTX2Pipeline's guidance_scale and audio_guidance_scale."""
    return guidance_scale, guidance_scale_2


SAMPLING = Sampling(samplers={"flow_matching": ("ltx2",)}, scheduler=None, guidance=guidance)
