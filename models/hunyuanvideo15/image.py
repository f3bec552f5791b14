"""Image-to-video conditioning of HunyuanVideo 1.5 I2V: what the transformer takes beside the noisy latent.

    latents [B, 2C + 1, T, H, W] = [x_t (C) ; condition latents (C) ; mask (1)]       (C = 32: 65 channels)

as HunyuanVideo15ImageToVideoPipeline builds them (prepare_cond_latents_and_mask):
  - condition latents: the picture alone through the VAE (HunyuanVideo15ImageProcessor.preprocess, one frame, the
    posterior's mode, z * scaling_factor) in latent frame 0, zeros in the later frames;
  - mask: one channel, ones at latent frame 0, zeros after.
The SigLIP states of the picture are image rows of the text input (models/hunyuanvideo15/config.py), not a
condition input: data preparation stores them beside the picture latent ("image_embeds", models/hunyuanvideo15/
siglip.py) and `text_rows` puts them in the rows of the conditional and the unconditional text alike. Synthetic data
has neither: x0's latent frame 0 stands in for the picture latent (the VAE is causal, so the first frame's latent
alone is latent frame 0 of the clip's), and its text rows are kept as they are.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from models.hunyuanvideo15 import siglip


def condition_channels(x_t: torch.Tensor, first: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """cat([x_t, [first, 0, ..., 0], mask]) on channels -> [B, 2C + 1, T, H, W]; first [B, C, 1, H, W]. Samples whose
    keep [B] is False get the text-to-video pipeline's zeros for condition latents and mask."""
    cond = torch.zeros(x_t.shape[0], x_t.shape[1] + 1, *x_t.shape[2:], dtype=x_t.dtype, device=x_t.device)
    cond[:, :-1, :1] = first.to(x_t.dtype)
    cond[:, -1:, 0] = 1
    if keep is not None:
        cond = cond * keep.to(cond.dtype)[:, None, None, None, None]
    return torch.cat([x_t, cond], dim=1)


def pipeline_pictures(pictures: list, height: int, width: int) -> list:
    """PIL pictures as HunyuanVideo15ImageToVideoPipeline.__call__ first makes them: resized to cover height x width
    (aspect ratio kept) and center-cropped (`resize(..., resize_mode="crop")`; a picture of that size is unchanged)."""
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor
    processor = HunyuanVideo15ImageProcessor()
    return [processor.resize(p, height=height, width=width, resize_mode="crop") for p in pictures]


@torch.no_grad()
def encode_pictures(vae, pictures: list, height: int, width: int) -> torch.Tensor:
    """Pictures (PIL images) -> their latents [N, C, 1, H', W'] fp32, as the pipeline's _get_image_latents:
    HunyuanVideo15ImageProcessor.preprocess (resize and crop to height x width, [-1, 1]), one frame through the
    VAE, the posterior's mode, times scaling_factor."""
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    from models.hunyuanvideo15.pipeline import Hunyuan15Latents
    param = next(vae.parameters())
    processor = HunyuanVideo15ImageProcessor(vae_scale_factor=vae.config.spatial_compression_ratio)
    x = processor.preprocess(pictures, height=height, width=width).unsqueeze(2)
    z = vae.encode(x.to(param.device, param.dtype)).latent_dist.mode().float()
    return Hunyuan15Latents.normalise(z, vae.config).cpu()


class Hunyuan15ImageCondition:
    """FamilySpec.condition of model.image_condition: the first frame's latents and mask on the condition channels,
    its SigLIP states in the text input's image rows (`text_rows`)."""

    dropout = 0.0                # the picture is never dropped
    image_encoder = True         # data preparation and sampling from a picture need the SigLIP encoder
    states_name, encoder_name = "SigLIP states", "SigLIP vision encoder"       # in the checks' messages

    def __init__(self, model, data):
        self.model, self.data = model, data

    def __call__(self, x_t: torch.Tensor, x0: torch.Tensor, keep: torch.Tensor,
                 first: Optional[torch.Tensor] = None, embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x_t [B, C, T, H, W] -> the transformer's latents; first [B, C, 1, H, W]: prepare_data's picture latent,
        else x0's latent frame 0. embeds (the SigLIP states) travel in the text: `text_rows`."""
        return condition_channels(x_t, x0[:, :, :1] if first is None else first, keep)

    @staticmethod
    def text_rows(text: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """text [B, L, D] with the SigLIP states [B, I, image_dim] as its image rows (training after caption
        dropout, and both calls of sampling: the pipeline feeds the same image_embeds to both)."""
        return siglip.text_rows(text, embeds)

    def image_encoder_problems(self, path) -> list[str]:
        return siglip.image_encoder_problems(path, self.model)

    @staticmethod
    def load_image_encoder(path, device="cpu", dtype: torch.dtype = torch.float32):
        return siglip.load_image_encoder(path, device, dtype)

    def encode_image_states(self, image_encoder, pictures: list) -> torch.Tensor:
        """SigLIP states [N, I, image_dim] of the pictures (PIL images; image_encoder: load_image_encoder's pair),
        each first resized and cropped to data.height x data.width as the pipeline's __call__ does."""
        return siglip.encode_image_states(*image_encoder, pipeline_pictures(pictures, self.data.height,
                                                                           self.data.width))

    def stored_tensors(self, encode, vae, frames: np.ndarray, generator, noise, image_encoder=None) -> dict:
        """Data preparation: {"image": the clip's first frame alone through the VAE, [C, 1, H, W] (the posterior's
        mode, scaled: what the pipeline conditions on), "image_embeds": that frame's SigLIP states [I, image_dim]}."""
        return {"image": encode(vae, frames[:1], None, None),
                "image_embeds": siglip.encode_image_states(*image_encoder, [frames[0]])[0]}

    def stored_shapes(self, latent: list[int]) -> dict[str, list[int]]:
        return {"image": [latent[0], 1, *latent[2:]], "image_embeds": [self.model.image_len, self.model.image_dim]}

    def sampling_parts(self, x0: torch.Tensor, stored: list) -> tuple[torch.Tensor, tuple]:
        """Validation of x0 [C, T, H, W]: (the picture latent [1, C, 1, H, W], (its SigLIP states [1, I, image_dim],)
        for `text_rows`); x0's first frame and no states for synthetic data."""
        first = (stored[0] if stored else x0[:, :1])[None]
        return first, ((stored[1][None],) if len(stored) > 1 else ())

    def encode_pictures(self, vae, pictures: list, height: int, width: int) -> torch.Tensor:
        return encode_pictures(vae, pipeline_pictures(pictures, height, width), height, width)

    def sampling_input(self, x_t: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """The transformer's latents at every step, for the conditional and the unconditional call alike."""
        return condition_channels(x_t, first)


def image_condition(model, data):
    """Hunyuan15ImageCondition for an image-to-video section (model.image_condition), None for text-to-video."""
    return Hunyuan15ImageCondition(model, data) if model.image_condition else None
