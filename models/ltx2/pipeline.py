"""What LTX-2's released pipelines (LTX2Pipeline, LTX2ImageToVideoPipeline, diffusers 0.42) feed the transformer
(FamilySpec.formats.vae, text_encoder, FamilySpec.sampling), as far as the toolkit has it.

- VAE `AutoencoderKLLTX2Video`: compression as the class computes it (the release: 8 x temporal, 32 x spatial,
  128 channels). The pipelines normalise latents per channel with the VAE's `latents_mean` / `latents_std`
  *buffers* ((z - mean) x scaling_factor / std), which config.json does not hold: normalising from the config
  alone is refused until data preparation reads the buffers (with the audio VAE's, AutoencoderKLLTX2Audio).
- Text: Gemma-3 hidden states through the pipeline's connector (LTX2TextConnectors): not encoded by the toolkit
  yet (`prepared=False`: `prepare_data --t5` and `data.text_encoder` refuse it by name).
- Scheduler: LTX2Pipeline's denoising loop, video and audio together (the sampler "ltx2", the family's own:
  models/ltx2/sampling.py, which the audio stream's `sample` runs); the release's scheduler_config.json is not
  read (its values are written there), so there is no release scheduler check. Guidance: the video's scale and the
  audio's (val.guidance_scale_2), as the pipeline's guidance_scale and audio_guidance_scale.
"""
from __future__ import annotations

import torch

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

    @staticmethod
    def normalise(z: torch.Tensor, config) -> torch.Tensor:
        raise NotImplementedError("LTX-2 latents are normalised with AutoencoderKLLTX2Video's latents_mean / "
                                  "latents_std buffers, which the toolkit does not read yet (docs/models.md#ltx-2)")

    denormalise = normalise


GEMMA3 = TextEncoderFormat(class_name="Gemma3ForConditionalGeneration", model_type="gemma3", masked=True,
                           clean=False, prepared=False)


def guidance(model, guidance_scale: float, guidance_scale_2: float) -> tuple[float, float]:
    """(video, audio) guidance: guidance_scale and guidance_scale_2 (val.guidance_scale_2, parallel.sample's
    --guidance-2), LTX2Pipeline's guidance_scale and audio_guidance_scale."""
    return guidance_scale, guidance_scale_2


SAMPLING = Sampling(samplers={"flow_matching": ("ltx2",)}, scheduler=None, guidance=guidance)
