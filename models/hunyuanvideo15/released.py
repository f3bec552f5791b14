"""HunyuanVideo 1.5 as diffusers publishes it (`HunyuanVideo15Transformer3DModel`): config translation, tensor names
and how its pipelines call it.

    toolkit                              diffusers
    embed.patch_proj                     x_embedder.proj (Conv3d [H, 2C+1, pt, p, p] = our Linear [H, (C pt p q)])
    embed.timestep_embedder              time_embed.timestep_embedder
    embed.refiner_timestep_embedder / refiner_text_embedder
                                         context_embedder.time_text_embed.{timestep_embedder, text_embedder}
    embed.refiner_proj_in, refiner.j.*   context_embedder.proj_in, context_embedder.token_refiner.refiner_blocks.j.*
    embed.glyph_{norm, linear_1..3}      context_embedder_2.{norm, linear_1..3}
    embed.image_{norm_in, linear_1, linear_2, norm_out}
                                         image_embedder.{norm_in, linear_1, linear_2, norm_out}
    embed.cond_type_embed                cond_type_embed
    blocks.i.*                           transformer_blocks.i.* (HunyuanVideo's dual-stream map)
    final.norm_out_linear / proj_out     norm_out.linear / proj_out

The refiner, the blocks and the head are named as HunyuanVideo's (models/shared/released.py, every block
dual-stream). The text input's row layout (image_len, glyph_len) is not in diffusers' config: the pipelines fix
729 and 256, so `bind(model)` carries the model's for `reference_call`.
"""
from __future__ import annotations

from typing import Optional

import torch

from models.hunyuanvideo15.config import HunyuanVideo15Config
from models.shared.released import mlp_ratio_check, mmdit_names
from models.spec import DiffusersFormat, config_problems, release_hidden_size

_EMBED = {"patch_proj": "x_embedder.proj", "refiner_proj_in": "context_embedder.proj_in",
          "cond_type_embed": "cond_type_embed",
          **{f"glyph_{k}": f"context_embedder_2.{k}" for k in ("norm", "linear_1", "linear_2", "linear_3")},
          **{f"image_{k}": f"image_embedder.{k}" for k in ("norm_in", "linear_1", "linear_2", "norm_out")},
          **{f"{ours}.linear_{k}": f"{theirs}.linear_{k}" for k in (1, 2) for ours, theirs in (
              ("timestep_embedder", "time_embed.timestep_embedder"),
              ("refiner_timestep_embedder", "context_embedder.time_text_embed.timestep_embedder"),
              ("refiner_text_embedder", "context_embedder.time_text_embed.text_embedder"))}}
PATCH_WEIGHT = "embed.patch_proj.weight"
_DUAL_ONLY = 1 << 30                 # num_dual: every block index below it, transformer_blocks.i


# diffusers' HunyuanVideo15Transformer3DModel arguments: (config.json key, its default, our key or None, ours).
def _config_pairs(m: HunyuanVideo15Config) -> list[tuple[str, object, Optional[str], object]]:
    return [
        ("in_channels", 65, "2 x model.in_channels + 1", m.transformer_in_channels),
        ("out_channels", 32, "model.in_channels", m.in_channels),
        ("num_attention_heads", 16, "model.num_heads", m.num_heads),
        ("attention_head_dim", 128, "model.head_dim", m.head_dim),
        ("num_layers", 54, "model.num_layers", m.num_layers),
        ("num_refiner_layers", 2, "model.num_refiner_layers", m.num_refiner_layers),
        ("mlp_ratio", 4.0, "model.ffn_hidden_size", m.ffn_size / m.hidden_size),
        ("patch_size", 1, "model.patch_size", m.patch_size),
        ("patch_size_t", 1, "model.patch_size_t", m.patch_size_t),
        ("text_embed_dim", 3584, "model.text_embed_dim", m.text_embed_dim),
        ("text_embed_2_dim", 1472, "model.glyph_dim", m.glyph_dim),
        ("image_embed_dim", 1152, "model.image_dim", m.image_dim),
        ("rope_theta", 256.0, "model.rope_theta", m.rope_theta),
        ("rope_axes_dim", [16, 56, 56], "model.rope_axes_dim", list(m.rope_axes_dim)),
        ("target_size", 640, "model.target_size", m.target_size),
        ("task_type", "i2v", "model.task_type", m.task_type),
        # What the toolkit's HunyuanVideo 1.5 model always is: no model.* key.
        ("qk_norm", "rms_norm", None, "rms_norm"),
        ("use_meanflow", False, None, False),
    ]


class HunyuanVideo15Diffusers(DiffusersFormat):
    """The `ReleasedFormat` (models/spec.py) of diffusers' HunyuanVideo15Transformer3DModel, bound to a config's
    text rows (`bind`)."""

    class_name = "HunyuanVideo15Transformer3DModel"

    def __init__(self, image_len: int = 729, glyph_len: int = 256):
        self.image_len, self.glyph_len = image_len, glyph_len

    def bind(self, m: HunyuanVideo15Config) -> "HunyuanVideo15Diffusers":
        return HunyuanVideo15Diffusers(m.image_len, m.glyph_len)

    def check_config(self, m: HunyuanVideo15Config, config: dict, path: str) -> list[str]:
        def in_channels(theirs, value) -> Optional[str]:
            return None if theirs == value else (f"in_channels {theirs} != 2 x model.in_channels + 1 = {value} (noisy "
                                                 f"latents, condition latents, mask); set --set model.in_channels="
                                                 f"{(theirs - 1) // 2}")

        return config_problems(_config_pairs(m), config, path, "the toolkit's HunyuanVideo 1.5 model has {}; the "
                               "480p and 720p T2V and I2V releases qualify",
                               {"in_channels": in_channels,
                                "mlp_ratio": mlp_ratio_check(m, release_hidden_size(_config_pairs(m), config))})

    def config(self, m: HunyuanVideo15Config, data) -> dict:
        return {key: value for key, _, _, value in _config_pairs(m)}

    def names(self, name: str) -> list[str]:
        section, _, rest = name.partition(".")
        if section != "embed" or rest.startswith("refiner."):
            return mmdit_names(name, _DUAL_ONLY, {}, "HunyuanVideoTransformer3DModel")
        module, _, leaf = rest.rpartition(".")
        if module not in _EMBED:
            raise KeyError(f"{name} has no counterpart in diffusers' {self.class_name}")
        return [f"{_EMBED[module]}.{leaf}"]

    def shapes(self, name: str, shape: tuple[int, ...], m: HunyuanVideo15Config) -> dict[str, tuple[int, ...]]:
        sources = self.names(name)
        if name == PATCH_WEIGHT:
            return {sources[0]: (m.hidden_size, m.transformer_in_channels, m.patch_size_t, m.patch_size,
                                 m.patch_size)}
        return {s: (shape[0] // len(sources), *shape[1:]) for s in sources}

    def example_inputs(self, m: HunyuanVideo15Config, data, batch: int, generator) -> tuple:
        """(latents [B, 2C+1, T, H, W], integer timesteps [B], text rows [B, L, D]) as the model's task's pipeline
        feeds them: text-to-video with zero condition latents, mask and image rows; image-to-video with all."""
        latents, timesteps, text = super().example_inputs(m, data, batch, generator)
        if m.task_type == "t2v":
            latents[:, m.in_channels:] = 0
            text[:, :m.image_len] = 0
        return latents, timesteps, text

    def split_text(self, text: torch.Tensor, model) -> tuple[torch.Tensor, ...]:
        """Text rows [B, L, D] -> diffusers' (Qwen states, their mask, byT5 states, their mask, image states)."""
        c = model.config
        image, glyph, qwen = text.split([self.image_len, self.glyph_len, text.shape[1] - self.image_len -
                                         self.glyph_len], dim=1)
        glyph, image = glyph[..., :c.text_embed_2_dim], image[..., :c.image_embed_dim]
        return qwen, qwen.ne(0).any(dim=-1).long(), glyph, glyph.ne(0).any(dim=-1).long(), image

    def reference_call(self, model: torch.nn.Module, inputs: tuple, kwargs: dict) -> torch.Tensor:
        """diffusers' HunyuanVideo 1.5 takes [B, 2C+1, T, H, W], the float timestep (as the pipelines pass it),
        the Qwen and byT5 states with their masks (a row is padding when it is all zero) and the image states."""
        latents, timesteps, text = inputs
        qwen, mask, glyph, mask_2, image = self.split_text(text, model)
        return model(hidden_states=latents, timestep=timesteps.to(latents.dtype), encoder_hidden_states=qwen,
                     encoder_attention_mask=mask, encoder_hidden_states_2=glyph, encoder_attention_mask_2=mask_2,
                     image_embeds=image).sample


DIFFUSERS = HunyuanVideo15Diffusers()
