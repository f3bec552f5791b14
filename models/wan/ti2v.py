"""Wan 2.2 TI2V-5B (model.expand_timesteps): a timestep per token, and image-to-video by a clean first latent frame.

diffusers 0.42 (WanPipeline / WanImageToVideoPipeline with `expand_timesteps: true`, WanTransformer3DModel with a
[B, S] timestep) builds, at denoising timestep t,

    mask      [1, 1, T, H, W]    0 at latent frame 0, 1 after (text-to-video: all ones)
    latents   = (1 - mask) * z_image + mask * x_t       z_image [B, C, 1, H, W]: the VAE latent of the picture alone
    timestep  = (mask[0, 0][:, ::p, ::p] * t).flatten()  [B, S]: 0 on the first frame's tokens, t on the others

and after the last step puts z_image back into frame 0. There is no mask or image channel (in_channels =
out_channels = 48, the Wan 2.2 VAE's z_dim) and no CLIP image encoder: one transformer does text-to-video
(model.image_condition false: every token at t) and image-to-video (true: the first frame clean at t = 0).

Training (model.image_condition true), as DiffSynth-Studio trains TI2V (the Wan repo publishes no trainer):
every latent position but the first frame's draws the sample's timestep, the first frame's t = 0, so flow
matching's x_t = (1 - s) x0 + s e keeps it clean (s = 0); the condition puts the stored picture latent there
when prepare_data wrote one; the loss leaves the first frame out (`loss_skip_frames`: it is an input, not a
prediction). Text-to-video training (image_condition false) draws one timestep per sample on every token.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from models.diffusion import PER_SAMPLE
from models.wan.experts import WanTimesteps
from models.wan.pipeline import WanLatents


def token_timesteps(timesteps: torch.Tensor, cfg, grid: tuple[int, int, int]) -> torch.Tensor:
    """The transformer's timestep per token [B, S] (S = t h w, (t, h, w) order) from [B] (sampling: every token at
    t, the first frame's at 0 with model.image_condition, as the pipeline's mask), [B, S] (diffusers' own) or
    [B, T, H, W] on the latent grid (training: read at each patch's first position)."""
    b, (t, h, w) = timesteps.shape[0], tuple(grid)
    if timesteps.dim() == 2:
        return timesteps
    if timesteps.dim() == 4:
        p, pt = cfg.patch_size, cfg.patch_size_t
        return timesteps[:, ::pt, ::p, ::p].reshape(b, t * h * w)
    mask = torch.ones(t, h * w, dtype=torch.float32, device=timesteps.device)
    if cfg.image_condition:
        mask[0] = 0
    return mask.flatten()[None] * timesteps[:, None]                                # (B, S) fp32


class TI2VTimesteps(WanTimesteps):
    """The Wan family's training timesteps (FamilySpec.timesteps): a TI2V model's (model.expand_timesteps) are the
    sample's one timestep (PER_SAMPLE's draw) on every latent position [1, T, H, W], 0 on the first latent frame
    with model.image_condition; every other Wan model's are WanTimesteps' (models/wan/experts.py)."""

    @staticmethod
    def per_token(model) -> bool:
        """One per token for a TI2V model (model.expand_timesteps), one per sample for the family's others."""
        return bool(model.expand_timesteps)

    def draw(self, generator: torch.Generator, latent_shape, model) -> torch.Tensor:
        if not model.expand_timesteps:
            return super().draw(generator, latent_shape, model)
        t = PER_SAMPLE.draw(generator, latent_shape, model)                          # [1]
        tokens = t.view(1, 1, 1, 1).repeat(1, *latent_shape[1:])                     # [1, T, H, W]
        if model.image_condition:
            tokens[:, 0] = 0
        return tokens


def first_frame(x: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
    """x [B, C, T, H, W] with latent frame 0 replaced by image [B, C, 1, H, W] (the pipeline's
    (1 - mask) * image + mask * x, which is this exactly)."""
    return torch.cat([image.to(x.dtype), x[:, :, 1:]], dim=2)


@torch.no_grad()
def encode_pictures(vae, pictures: list, height: int, width: int) -> torch.Tensor:
    """Pictures (PIL images) -> their latents [N, C, 1, H', W'] fp32, as WanImageToVideoPipeline.prepare_latents
    with expand_timesteps: VideoProcessor.preprocess (resize, [-1, 1]), the picture alone through the VAE
    (the posterior's mode), normalised as the training latents."""
    from diffusers.video_processor import VideoProcessor

    param = next(vae.parameters())
    x = VideoProcessor(vae_scale_factor=vae.config.scale_factor_spatial).preprocess(pictures, height=height,
                                                                                   width=width).unsqueeze(2)
    z = vae.encode(x.to(param.device, param.dtype)).latent_dist.mode().float()
    return WanLatents.normalise(z, vae.config).cpu()


class TI2VCondition:
    """FamilySpec.condition of a TI2V image-to-video section: the first latent frame is the picture's latent."""

    dropout = 0.0                # the picture is never dropped (DiffSynth-Studio, the release)
    image_encoder = False        # no CLIP states
    loss_skip_frames = 1         # latent frames the loss leaves out (parallel/model/build.py SequenceLoss)

    def __init__(self, model, data):
        self.model, self.data = model, data

    def __call__(self, x_t: torch.Tensor, x0: torch.Tensor, keep: torch.Tensor,
                 first: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x_t [B, C, T, H, W] with the stored picture latent first [B, C, 1, H, W] (prepare_data's) in frame 0, else
        x0's frame 0 (training: already there, t = 0; validation: its per-sample timesteps noised it)."""
        return first_frame(x_t, x0[:, :, :1] if first is None else first)

    def stored_tensors(self, encode, vae, frames: np.ndarray, generator, noise, image_encoder=None) -> dict:
        """Data preparation: {"image": the clip's first frame alone through the VAE, [C, 1, H, W]} (the
        posterior's mode, normalised: what the pipeline conditions on)."""
        return {"image": encode(vae, frames[:1], None, None)}

    def stored_shapes(self, latent: list[int]) -> dict[str, list[int]]:
        return {"image": [latent[0], 1, *latent[2:]]}

    def sampling_parts(self, x0: torch.Tensor, stored: list) -> tuple[torch.Tensor, tuple]:
        """Validation of x0 [C, T, H, W]: (the picture latent [1, C, 1, H, W], no extra inputs); x0's first
        frame for synthetic data."""
        return (stored[0] if stored else x0[:, :1])[None], ()

    def encode_pictures(self, vae, pictures: list, height: int, width: int) -> torch.Tensor:
        return encode_pictures(vae, pictures, height, width)

    def sampling_input(self, x_t: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """The transformer's latents at every step: x_t with the picture latent in frame 0."""
        return first_frame(x_t, first)

    def sampled(self, x: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """The sampler's result with the picture latent put back in frame 0 (the pipeline's last line)."""
        return first_frame(x, first)
