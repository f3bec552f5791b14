"""Image-to-video conditioning of CogVideoX (5B-I2V, 1.5-5B-I2V): the first frame's latent, zero-padded over
the frames and concatenated with the noisy latent on channels, [B, 2C, T, H, W] into the transformer.

Layout of the image latents, T the transformer's latent frames (1.5: the VAE's frames padded to a multiple of
patch_size_t, models/geometry.py):
    [z_img, 0, ..., 0]                 (T frames; z_img the VAE latent of the first frame)
as CogVideoXImageToVideoPipeline.__call__ builds them (it adds the 1.5 padding to num_frames before
prepare_latents, so prepare_latents' "first_frame" copy is empty) and CogVideo's I2V fine-tuning trains them
(finetune/models/cogvideox_i2v/lora_trainer.py: zeros up to the padded latent's frame count).

Scale: z_img = scaling_factor * z, except for a VAE whose config says invert_scale_latents (CogVideoX 1.5):
z / scaling_factor, as the pipeline does ("the CogVideoX team forgot to multiply the scaling factor during
training"); `image_latent_scale`.

Training (docs/released-weights.md, "Image-to-video" says what differs from the sources and why):
  - noise augmentation, SAT's add_noise_to_first_frame (sat/diffusion_video.py, `noised_image_input: True`):
    the first frame in pixels gets image + exp(N(-3, 0.5)) * randn before the VAE; `noised_first_frame` below,
    drawn once per clip by parallel.prepare_data (the sources draw it every step, with the VAE online);
  - image-latent dropout (`noised_image_dropout: 0.05`): the whole image latent is zeros, drawn per sample
    from (seed, step, position) (the sources draw once per micro-batch on each rank).
z_img: the "image" tensor parallel.prepare_data stores beside the latent for an image_condition preset (a directory
dataset without it is refused: parallel/train/data.check_shapes); synthetic data has none, and the first latent
frame stands in (CogVideoX's VAE is causal, so that frame encodes the first frame alone, but at the training
latents' scale, which is not the image latents' for a VAE with invert_scale_latents).
"""
from __future__ import annotations

from typing import Optional

import torch


def noised_first_frame(frame: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """SAT's add_noise_to_first_frame: frame [B, 3, 1, H, W] in [-1, 1] + sigma * randn, log sigma ~ N(-3, 0.5)."""
    sigma = torch.exp(torch.normal(-3.0, 0.5, (frame.shape[0],), generator=generator)).to(frame.dtype)
    return frame + torch.randn(frame.shape, generator=generator).to(frame.dtype) * sigma[:, None, None, None, None]


def image_latent_scale(vae_config: dict) -> float:
    """The factor on the VAE's posterior for image latents (CogVideoXImageToVideoPipeline.prepare_latents)."""
    sf = vae_config.get("scaling_factor") or 1.0
    return 1.0 / sf if vae_config.get("invert_scale_latents") else sf


def image_latents(first: torch.Tensor, frames: int) -> torch.Tensor:
    """first [B, C, 1, H, W] -> [B, C, frames, H, W]: zeros after it (frames: the transformer's latent frames)."""
    zeros = first.new_zeros(first.shape[0], first.shape[1], frames - 1, *first.shape[3:])
    return torch.cat([first, zeros], dim=2)


def condition(x_t: torch.Tensor, first: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The transformer's input [B, 2C, T, H, W]: x_t [B, C, T, H, W] and the image latents of `first`
    [B, C, 1, H, W], zeroed for the samples whose keep [B] is False (the image-latent dropout)."""
    image = image_latents(first, x_t.shape[2]) * keep.to(first.dtype)[:, None, None, None, None]
    return torch.cat([x_t, image.to(x_t.dtype)], dim=1)


class FirstFrameCondition:
    """The family's training-input hook (FamilySpec.condition) for image_condition models: (x_t, x0, keep) ->
    the transformer's input; `dropout` is the image-latent dropout probability (model.image_dropout)."""

    def __init__(self, model, data):
        self.model, self.dropout = model, model.image_dropout

    def __call__(self, x_t: torch.Tensor, x0: torch.Tensor, keep: torch.Tensor,
                 first: Optional[torch.Tensor] = None) -> torch.Tensor:
        """first [B, C, 1, H, W]: the stored (noise-augmented) image latents; None: x0's first latent frame
        (1.5: the padded frame in front is a copy of it)."""
        return condition(x_t, x0[:, :, :1] if first is None else first, keep)

    @staticmethod
    def sampling_input(x_t: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Sampling (parallel.sample, validation): x_t [B, C, T, H, W] and the image latents [B, C, 1, H, W],
        never dropped, as CogVideoXImageToVideoPipeline feeds both the conditional and unconditional calls."""
        return condition(x_t, first.to(x_t.dtype), torch.ones(len(x_t), dtype=torch.bool))

    @staticmethod
    def sampling_parts(x0: torch.Tensor, stored: list) -> tuple[torch.Tensor, tuple]:
        """Validation of sample x0 [C, T, H, W]: (its first-frame latents [1, C, 1, H, W], no further inputs): the
        stored image latents, else x0's first latent frame."""
        return (stored[0] if stored else x0[:, :1])[None], ()

    @staticmethod
    def stored_scale(vae_config: dict) -> float:
        """Factor from a training latent's scale (scaling_factor x z) to the image latents' (`image_latent_scale`):
        1 for the 1.0 VAEs, 1 / scaling_factor^2 for a VAE with invert_scale_latents (1.5)."""
        return image_latent_scale(vae_config) / (vae_config.get("scaling_factor") or 1.0)

    @staticmethod
    def encode_pictures(vae, pictures: list, height: int, width: int) -> torch.Tensor:
        """Image latents [N, C, 1, H', W'] of the pictures for sampling (the module's `encode_pictures`)."""
        return encode_pictures(vae, pictures, height, width)

    @staticmethod
    def augment(pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The first frame's pixels [1, 3, 1, H, W] before the VAE (data preparation): SAT's noise augmentation."""
        return noised_first_frame(pixels, generator)

    def stored_tensors(self, encode, vae, frames, generator, noise: torch.Generator, image_encoder=None) -> dict:
        """Data preparation (encode: models.vae.encode): {"image": the noise-augmented first frame's latent
        [C, 1, H, W]} at the pipeline's scale of image latents (1.5's VAE: z / scaling_factor, not z x
        scaling_factor)."""
        image = encode(vae, frames[:1], generator, lambda x: self.augment(x, noise))
        return {"image": image * self.stored_scale(dict(vae.config))}

    @staticmethod
    def stored_shapes(latent: list[int]) -> dict[str, list[int]]:
        """The stored tensors' shapes for a sample's latent [C, T, H, W]: the first frame's latent alone."""
        return {"image": [latent[0], 1, *latent[2:]]}


def first_frame_condition(model, data):
    """FirstFrameCondition for an image-to-video section, None for text-to-video."""
    return FirstFrameCondition(model, data) if model.image_condition else None


@torch.no_grad()
def encode_pictures(vae, pictures: list, height: int, width: int) -> torch.Tensor:
    """Pictures (PIL images) -> image latents [N, C, 1, H/8, W/8] fp32, as CogVideoXImageToVideoPipeline encodes
    its `image`: VideoProcessor.preprocess (resize to height x width, [-1, 1]), vae.encode(...).latent_dist, the
    posterior's mode (the pipeline draws a sample from its generator, which also drives the dpm sampler's step
    noise; the mode keeps the image latents independent of the seed), times `image_latent_scale`."""
    from diffusers.video_processor import VideoProcessor

    spatial = 2 ** (len(vae.config.block_out_channels) - 1)
    param = next(vae.parameters())
    x = VideoProcessor(vae_scale_factor=spatial).preprocess(pictures, height=height, width=width)
    z = vae.encode(x.unsqueeze(2).to(param.device, param.dtype)).latent_dist.mode().float().cpu()
    return z * image_latent_scale(dict(vae.config))
