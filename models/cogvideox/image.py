"""Image-to-video conditioning of CogVideoX (5B-I2V, 1.5-5B-I2V): the first frame's latent, zero-padded over
the frames and concatenated with the noisy latent on channels, [B, 2C, T, H, W] into the transformer.

Layout of the image latents, as CogVideoXImageToVideoPipeline.prepare_latents builds them:
    [z_img, 0, ..., 0]                 (VAE frames T_v; z_img the VAE latent of the first frame)
    1.5 (patch_size_t 2, T_v odd):     [z_img, z_img, 0, ..., 0]  (its "first_frame" copy in front)
which is `pad_frames` of the first layout, like the video latents (models/geometry.py).

Training, as CogVideo's SAT I2V fine-tuning does (sat/diffusion_video.py, SATVideoDiffusionEngine.shared_step
with `noised_image_input: True`, `noised_image_all_concat: False`, `noised_image_dropout: 0.05`):
  - noise augmentation: the first frame in pixels gets image + exp(N(-3, 0.5)) * randn before the VAE
    (`add_noise_to_first_frame`); `noised_first_frame` below, for data preparation;
  - the rest zero-padded (noised_image_all_concat False);
  - image-latent dropout: with probability noised_image_dropout the whole image latent is zeros.
z_img: the "image" tensor parallel.prepare_data stores beside the latent for an image_condition preset (the
augmented first frame's latent, drawn once per clip, where SAT draws a new sigma every step); without it the
first latent frame stands in: CogVideoX's VAE is causal, so that frame encodes the first frame alone.
"""
from __future__ import annotations

from typing import Optional

import torch

from models.geometry import pad_frames, vae_frames


def noised_first_frame(frame: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """SAT's add_noise_to_first_frame: frame [B, 3, 1, H, W] in [-1, 1] + sigma * randn, log sigma ~ N(-3, 0.5)."""
    sigma = torch.exp(torch.normal(-3.0, 0.5, (frame.shape[0],), generator=generator)).to(frame.dtype)
    return frame + torch.randn(frame.shape, generator=generator).to(frame.dtype) * sigma[:, None, None, None, None]


def image_latents(first: torch.Tensor, vae_frames: int, model) -> torch.Tensor:
    """first [B, C, 1, H, W] -> [B, C, T, H, W]: zeros after it to the VAE's frame count, then the front
    padding to a multiple of patch_size_t (CogVideoXImageToVideoPipeline.prepare_latents)."""
    zeros = first.new_zeros(first.shape[0], first.shape[1], vae_frames - 1, *first.shape[3:])
    return pad_frames(torch.cat([first, zeros], dim=2), model)


def condition(x_t: torch.Tensor, first: torch.Tensor, vae_frames: int, keep: torch.Tensor, model) -> torch.Tensor:
    """The transformer's input [B, 2C, T, H, W]: x_t [B, C, T, H, W] and the image latents of `first`
    [B, C, 1, H, W], zeroed for the samples whose keep [B] is False (the image-latent dropout)."""
    image = image_latents(first, vae_frames, model) * keep.to(first.dtype)[:, None, None, None, None]
    return torch.cat([x_t, image.to(x_t.dtype)], dim=1)


class FirstFrameCondition:
    """The family's training-input hook (FamilySpec.condition) for image_condition models: (x_t, x0, keep) ->
    the transformer's input; `dropout` is the image-latent dropout probability (model.image_dropout)."""

    def __init__(self, model, data):
        self.model, self.vae_frames, self.dropout = model, vae_frames(model, data), model.image_dropout

    def __call__(self, x_t: torch.Tensor, x0: torch.Tensor, keep: torch.Tensor,
                 first: Optional[torch.Tensor] = None) -> torch.Tensor:
        """first [B, C, 1, H, W]: the stored (noise-augmented) image latents; None: x0's first latent frame
        (1.5: the padded frame in front is a copy of it)."""
        return condition(x_t, x0[:, :, :1] if first is None else first, self.vae_frames, keep, self.model)

    @staticmethod
    def augment(pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The first frame's pixels [1, 3, 1, H, W] before the VAE (data preparation): SAT's noise augmentation."""
        return noised_first_frame(pixels, generator)


def first_frame_condition(model, data):
    """FirstFrameCondition for an image-to-video section, None for text-to-video."""
    return FirstFrameCondition(model, data) if model.image_condition else None
