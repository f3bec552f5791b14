"""Image-to-video conditioning of Wan 2.1 I2V: what the transformer takes beside the noisy latent.

    latents [B, 2C + 4, T, H, W] = [x_t (C) ; mask (4) ; image latents (C)]       (C = 16: 36 channels)
    image   [B, I, image_dim]      CLIP's penultimate hidden states of the first frame (I = 257 for ViT-H/14)

as WanImageToVideoPipeline builds them (prepare_latents, encode_image):
  - mask: one channel per pixel frame of a temporal VAE step (vae_scale_temporal = 4): latent frame 0 holds
    pixel frame 0, repeated 4 times, all ones; the later latent frames are zeros (pixel frames 1.. are unknown);
  - image latents: the VAE latent of the pixel video [first frame, 0, ..., 0] (num_frames frames, zeros = mid
    gray in [-1, 1]), normalised as the training latents ((z - latents_mean) / latents_std): the VAE is causal,
    so latent frame 0 is the first frame's latent alone, but the later frames encode the gray frames behind it
    (not zeros), which is why data preparation stores the whole [C, T, H, W] tensor ("image");
  - image: the CLIP states ("image_embeds"), fed to the image cross-attention unchanged.
Synthetic data has neither stored tensor: latent frame 0 of x0 stands in for the image latents (zeros after it)
and a fixed function of it for the CLIP states (`stand_in_embeds`), so every layout trains on the same inputs.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from models.wan.ti2v import TI2VCondition


def first_frame_mask(x_t: torch.Tensor, channels: int) -> torch.Tensor:
    """[B, channels, T, H, W]: ones at latent frame 0, zeros after (the pipeline's mask_lat_size)."""
    mask = x_t.new_zeros(x_t.shape[0], channels, *x_t.shape[2:])
    mask[:, :, 0] = 1
    return mask


def condition_latents(x_t: torch.Tensor, image_latents: torch.Tensor, channels: int,
                      keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """cat([x_t, mask, image_latents]) on channels -> [B, 2C + channels, T, H, W]; samples whose keep [B] is False
    get zeros for mask and image latents (an image dropout: Wan's releases train with none)."""
    cond = torch.cat([first_frame_mask(x_t, channels), image_latents.to(x_t.dtype)], dim=1)
    if keep is not None:
        cond = cond * keep.to(cond.dtype)[:, None, None, None, None]
    return torch.cat([x_t, cond], dim=1)


def stand_in_latents(x0: torch.Tensor) -> torch.Tensor:
    """Synthetic data: x0's latent frame 0 then zeros, [B, C, T, H, W]."""
    return torch.cat([x0[:, :, :1], x0.new_zeros(x0.shape[0], x0.shape[1], x0.shape[2] - 1, *x0.shape[3:])], dim=2)


def stand_in_embeds(x0: torch.Tensor, tokens: int, width: int) -> torch.Tensor:
    """Synthetic data: [B, tokens, width] from x0's latent frame 0, deterministic and different per sample:
    its values at scattered positions (stride 7919, a prime) plus a fixed cos pattern, so that no token is
    constant (a LayerNorm would zero it)."""
    z = x0[:, :, 0].flatten(1)                                                        # (B, C H W)
    n = torch.arange(tokens * width)
    return (z[:, n * 7919 % z.shape[1]] + torch.cos(n.to(z.dtype))).reshape(len(x0), tokens, width)


def gray_after_first(pixels: torch.Tensor) -> torch.Tensor:
    """pixels [B, 3, F, H, W] in [-1, 1] -> the first frame, then zeros (the pipeline's video_condition)."""
    return torch.cat([pixels[:, :, :1], torch.zeros_like(pixels[:, :, 1:])], dim=2)


def encode_condition(encode, vae, frames: np.ndarray) -> torch.Tensor:
    """A clip's uint8 frames [F, H, W, 3] -> its image latents [C, T, H', W'] fp32 (encode: models.vae.encode): the
    VAE posterior's mode of [frame 0, gray, ..., gray], normalised as the training latents (prepare_latents:
    argmax, (z - mean) / std)."""
    return encode(vae, frames, None, gray_after_first)


@torch.no_grad()
def encode_pictures(vae, pictures: list, height: int, width: int, num_frames: int) -> torch.Tensor:
    """Pictures (PIL images) -> image latents [N, C, T, H', W'] fp32 for sampling, as WanImageToVideoPipeline
    builds its condition: VideoProcessor.preprocess (resize to height x width, [-1, 1]), the picture then
    num_frames - 1 gray frames through the VAE (the posterior's mode), normalised."""
    from diffusers.video_processor import VideoProcessor

    from models.wan.pipeline import WanLatents
    spatial = vae.config.scale_factor_spatial
    param = next(vae.parameters())
    x = VideoProcessor(vae_scale_factor=spatial).preprocess(pictures, height=height, width=width).unsqueeze(2)
    x = gray_after_first(x.expand(-1, -1, num_frames, -1, -1))
    z = vae.encode(x.to(param.device, param.dtype)).latent_dist.mode().float()
    return WanLatents.normalise(z, vae.config).cpu()


@torch.no_grad()
def encode_image_states(encoder, processor, pictures: list) -> torch.Tensor:
    """Pictures (PIL images or uint8 [H, W, 3] arrays) -> CLIP states [N, I, image_dim] fp32, as
    WanImageToVideoPipeline.encode_image: CLIPImageProcessor (resize, center crop, normalise), then
    CLIPVisionModel's penultimate hidden states (hidden_states[-2], before the last layer)."""
    param = next(encoder.parameters())
    pixels = processor(images=pictures, return_tensors="pt").pixel_values.to(param.device, param.dtype)
    return encoder(pixel_values=pixels, output_hidden_states=True).hidden_states[-2].float().cpu()


def load_image_encoder(path, device="cpu", dtype: torch.dtype = torch.float32):
    """(CLIPVisionModel, CLIPImageProcessor) from one folder (a release's image_encoder/ with the files of its
    image_processor/ copied in), eval mode, nothing downloaded."""
    from transformers import CLIPImageProcessor, CLIPVisionModel
    encoder = CLIPVisionModel.from_pretrained(str(path), torch_dtype=dtype, local_files_only=True)
    return encoder.to(device).eval().requires_grad_(False), CLIPImageProcessor.from_pretrained(str(path))


def image_encoder_problems(path, model, key: str = "--image-encoder") -> list[str]:
    """What is wrong with `path` as the CLIP vision encoder of `model` (config files only)."""
    import json
    from pathlib import Path
    what = ("expected a folder written by CLIPVisionModel.save_pretrained with preprocessor_config.json beside it "
            "(for a release: image_encoder/ with the files of image_processor/ copied in)")
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        return [f"{key}={path}: cannot read config.json ({e}); {what}"]
    config = config.get("vision_config", config)
    problems = []
    if config.get("hidden_size") != model.image_dim:
        problems.append(f"{key}={path}: hidden_size {config.get('hidden_size')} != model.image_dim {model.image_dim}")
    tokens = (config.get("image_size", 224) // config.get("patch_size", 32)) ** 2 + 1
    if tokens != model.image_len:
        problems.append(f"{key}={path}: (image_size / patch_size)^2 + 1 = {tokens} tokens != model.image_len "
                        f"{model.image_len}; set --set model.image_len={tokens}")
    if not (path / "preprocessor_config.json").is_file():
        problems.append(f"{key}={path}: no preprocessor_config.json in it; {what}")
    return problems


class WanImageCondition:
    """The family's training-input hook (FamilySpec.condition) for model.image_condition: (x_t, x0, keep,
    stored image latents, stored CLIP states) -> (the transformer's latents, the CLIP states) when the model
    has an image cross-attention (model.image_dim), else the latents alone (Wan 2.2 I2V)."""

    dropout = 0.0        # Wan's releases and trainers (DiffSynth, musubi-tuner) never drop the image
    states_name, encoder_name = "CLIP states", "CLIP vision encoder"       # in the checks' messages

    def __init__(self, model, data):
        self.model, self.data = model, data

    def __call__(self, x_t: torch.Tensor, x0: torch.Tensor, keep: torch.Tensor,
                 first: Optional[torch.Tensor] = None, embeds: Optional[torch.Tensor] = None):
        """first [B, C, T, H, W]: prepare_data's image latents; embeds [B, I, image_dim]: its CLIP states."""
        m = self.model
        latents = condition_latents(x_t, stand_in_latents(x0) if first is None else first, m.vae_scale_temporal, keep)
        if m.image_dim is None:
            return latents
        return latents, (stand_in_embeds(x0, m.image_len, m.image_dim) if embeds is None else embeds).to(x_t.dtype)

    @property
    def image_encoder(self) -> bool:
        """Whether data preparation needs the CLIP vision encoder (an image cross-attention)."""
        return self.model.image_dim is not None

    def image_encoder_problems(self, path) -> list[str]:
        return image_encoder_problems(path, self.model)

    @staticmethod
    def load_image_encoder(path, device="cpu", dtype: torch.dtype = torch.float32):
        return load_image_encoder(path, device, dtype)

    def stored_tensors(self, encode, vae, frames: np.ndarray, generator, noise, image_encoder=None) -> dict:
        """Data preparation (encode: models.vae.encode): {"image": the image latents [C, T, H, W] of the clip's first
        frame, "image_embeds": its CLIP states [I, image_dim] (with an image cross-attention; image_encoder =
        load_image_encoder's pair)}. Neither is a posterior draw nor noise-augmented: the pipeline takes the
        posterior's mode."""
        out = {"image": encode_condition(encode, vae, frames)}
        if self.model.image_dim is not None:
            out["image_embeds"] = encode_image_states(*image_encoder, [frames[0]])[0]
        return out

    def stored_shapes(self, latent: list[int]) -> dict[str, list[int]]:
        """The stored tensors' shapes for a sample's latent [C, T, H, W]."""
        m = self.model
        return {"image": list(latent), **({"image_embeds": [m.image_len, m.image_dim]} if m.image_dim else {})}

    def sampling_parts(self, x0: torch.Tensor, stored: list) -> tuple[torch.Tensor, tuple]:
        """Validation of sample x0 [C, T, H, W] with its stored tensors (image latents, CLIP states; none for
        synthetic data): (image latents [1, C, T, H, W], (CLIP states [1, I, image_dim],) or ())."""
        m = self.model
        first = (stored[0] if stored else stand_in_latents(x0[None])[0])[None]
        if m.image_dim is None:
            return first, ()
        return first, ((stored[1] if len(stored) > 1 else stand_in_embeds(x0[None], m.image_len, m.image_dim)[0])[None],)

    def encode_pictures(self, vae, pictures: list, height: int, width: int) -> torch.Tensor:
        """Image latents [N, C, T, H', W'] of the pictures for sampling (data.num_frames frames)."""
        return encode_pictures(vae, pictures, height, width, self.data.num_frames)

    @staticmethod
    def encode_image_states(image_encoder, pictures: list) -> torch.Tensor:
        """CLIP states [N, I, image_dim] of the pictures (image_encoder: load_image_encoder's pair)."""
        return encode_image_states(*image_encoder, pictures)

    def sampling_input(self, x_t: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Sampling: x_t [B, C, T, H, W] and the image latents [B, C, T, H, W] (`encode_pictures`) -> the
        transformer's latents, for the conditional and the unconditional call alike (as the pipeline)."""
        return condition_latents(x_t, first, self.model.vae_scale_temporal)


def image_condition(model, data):
    """WanImageCondition for an image-to-video section (TI2VCondition for Wan 2.2 TI2V: model.expand_timesteps),
    None for text-to-video."""
    if not model.image_condition:
        return None
    return TI2VCondition(model, data) if model.expand_timesteps else WanImageCondition(model, data)
