"""CogVideoX as diffusers publishes it (`CogVideoXTransformer3DModel`): config translation and tensor names.

    toolkit                     diffusers
    embed.patch_proj            patch_embed.proj (1.0: Conv2d [H, C, p, p] = our Linear [H, (C p q)], reshaped;
                                1.5: Linear [H, (C pt p q)], as is)
    embed.pos_embedding         patch_embed.pos_embedding (5B-I2V's learned positions, [1, S_txt + S_vid, H])
    embed.ofs_linear_{1,2}      ofs_embedding.linear_{1,2} (1.5-I2V)
    embed.text_proj             patch_embed.text_proj
    embed.time_linear_{1,2}     time_embedding.linear_{1,2}
    blocks.i.norm{1,2}.*        transformer_blocks.i.norm{1,2}.*
    blocks.i.attn.to_qkv        transformer_blocks.i.attn1.to_{q,k,v} (fused: rows [q; k; v])
    blocks.i.attn.norm_{q,k}_{weight,bias}  transformer_blocks.i.attn1.norm_{q,k}.{weight,bias}
    blocks.i.attn.to_out        transformer_blocks.i.attn1.to_out.0
    blocks.i.ff_in / ff_out     transformer_blocks.i.ff.net.0.proj / ff.net.2
    final.norm_final            norm_final
    final.norm_out_linear       norm_out.linear
    final.norm_out              norm_out.norm
    final.proj_out              proj_out

Reading and writing the folders is parallel/weights/'s job, for every family.
"""
from __future__ import annotations

from typing import Optional

import torch

from models.cogvideox.config import CogVideoXConfig
from models.geometry import vae_frames
from models.spec import DiffusersFormat, config_problems, show

_EMBED = {"patch_proj": "patch_embed.proj", "text_proj": "patch_embed.text_proj",
          "time_linear_1": "time_embedding.linear_1", "time_linear_2": "time_embedding.linear_2",
          "ofs_linear_1": "ofs_embedding.linear_1", "ofs_linear_2": "ofs_embedding.linear_2"}
_EMBED_LEAF = {"pos_embedding": "patch_embed.pos_embedding"}
_BLOCK = {"norm1.linear": "norm1.linear", "norm1.norm": "norm1.norm", "norm2.linear": "norm2.linear",
          "norm2.norm": "norm2.norm", "attn.to_out": "attn1.to_out.0", "ff_in": "ff.net.0.proj", "ff_out": "ff.net.2"}
_BLOCK_LEAF = {"attn.norm_q_weight": "attn1.norm_q.weight", "attn.norm_q_bias": "attn1.norm_q.bias",
               "attn.norm_k_weight": "attn1.norm_k.weight", "attn.norm_k_bias": "attn1.norm_k.bias"}
_FINAL = {"norm_final": "norm_final", "norm_out_linear": "norm_out.linear", "norm_out": "norm_out.norm",
          "proj_out": "proj_out"}
PATCH_WEIGHT = "embed.patch_proj.weight"


# diffusers' CogVideoXTransformer3DModel arguments: (config.json key, its default, our key or None, ours).
def _config_pairs(m: CogVideoXConfig) -> list[tuple[str, object, Optional[str], object]]:
    return [
        ("num_attention_heads", 30, "model.num_heads", m.num_heads),
        ("attention_head_dim", 64, "model.head_dim", m.head_dim),
        ("num_layers", 30, "model.num_layers", m.num_layers),
        ("in_channels", 16, "model.image_condition", m.transformer_in_channels),
        ("out_channels", 16, "model.in_channels", m.in_channels),
        ("time_embed_dim", 512, "model.time_embed_dim", m.time_embed_dim),
        ("text_embed_dim", 4096, "model.text_embed_dim", m.text_embed_dim),
        ("max_text_seq_length", 226, "model.max_text_len", m.max_text_len),
        ("patch_size", 2, "model.patch_size", m.patch_size),
        ("temporal_compression_ratio", 4, "model.vae_scale_temporal", m.vae_scale_temporal),
        ("flip_sin_to_cos", True, "model.flip_sin_to_cos", m.flip_sin_to_cos),
        ("freq_shift", 0, "model.freq_shift", m.freq_shift),
        ("spatial_interpolation_scale", 1.875, "model.spatial_interpolation_scale", m.spatial_interpolation_scale),
        ("temporal_interpolation_scale", 1.0, "model.temporal_interpolation_scale", m.temporal_interpolation_scale),
        ("sample_height", 60, "model.sample_height", m.sample_height),
        ("sample_width", 90, "model.sample_width", m.sample_width),
        ("use_rotary_positional_embeddings", False, "model.pos_embed", m.pos_embed == "rope3d"),
        ("patch_size_t", None, "model.patch_size_t", m.patch_size_t if m.patch_size_t > 1 else None),
        ("ofs_embed_dim", None, "model.ofs_embed_dim", m.ofs_embed_dim),
        ("use_learned_positional_embeddings", False, "model.learned_positions", m.learned_positions),
        *([("sample_frames", 49, "model.sample_frames", m.sample_frames)] if m.learned_positions else []),
        ("patch_bias", True, "model.patch_bias", m.patch_bias),
        # What the toolkit's model always is: these have no model.* key.
        ("attention_bias", True, None, True),
        ("activation_fn", "gelu-approximate", None, "gelu-approximate"),
        ("timestep_activation_fn", "silu", None, "silu"),
        ("norm_elementwise_affine", True, None, True),
        ("norm_eps", 1e-5, None, 1e-5),
        ("dropout", 0.0, None, 0.0),
    ]


class CogVideoXDiffusers(DiffusersFormat):
    """The `ReleasedFormat` (models/spec.py) of diffusers' CogVideoXTransformer3DModel."""

    class_name = "CogVideoXTransformer3DModel"

    def check_config(self, m: CogVideoXConfig, config: dict, path: str) -> list[str]:
        def rotary(theirs, value) -> Optional[str]:
            return None if bool(theirs) == value else (f"use_rotary_positional_embeddings {show(theirs)} != "
                                                       f"model.pos_embed {m.pos_embed}; set --set model.pos_embed="
                                                       f"{'rope3d' if theirs else 'sincos'}")

        def in_channels(theirs, value) -> Optional[str]:
            return None if theirs == value else (
                f"in_channels {show(theirs)} != {value} (model.in_channels x {2 if m.image_condition else 1}); set "
                f"--set model.image_condition={show(theirs == 2 * config.get('out_channels', 16))} (image-to-video "
                f"releases take 2 x out_channels)")

        def patch_size_t(theirs, value) -> Optional[str]:
            # diffusers' null (no temporal patches) is the toolkit's 1: model.patch_size_t takes an integer
            return None if theirs == value else (f"patch_size_t {show(theirs)} != model.patch_size_t {m.patch_size_t}; "
                                                 f"set --set model.patch_size_t={theirs or 1} or use the matching preset")

        problems = config_problems(_config_pairs(m), config, path, "the toolkit's CogVideoX model has {}; CogVideoX "
                                   "2B, 5B, 5B-I2V, 1.5-5B and 1.5-5B-I2V qualify",
                                   {"use_rotary_positional_embeddings": rotary, "in_channels": in_channels,
                                    "patch_size_t": patch_size_t})
        if m.ffn_hidden_size not in (None, 4 * m.hidden_size):
            problems.append(f"{path}: the released FFN is 4 x hidden = {4 * m.hidden_size} wide, model.ffn_hidden_size "
                            f"is {m.ffn_hidden_size}; remove it")
        return problems

    def config(self, m: CogVideoXConfig, data) -> dict:
        """sample_frames (diffusers: (VAE latent frames - 1) x temporal compression + 1, before any padding to
        patch_size_t) sizes a cache there, and 5B-I2V's learned position table."""
        config = {key: value for key, _, _, value in _config_pairs(m)}
        config["sample_frames"] = m.sample_frames if m.learned_positions else \
            (vae_frames(m, data) - 1) * m.vae_scale_temporal + 1
        return config

    def names(self, name: str) -> list[str]:
        section, _, rest = name.partition(".")
        if section == "blocks":
            index, _, rest = rest.partition(".")
            prefix = f"transformer_blocks.{index}."
            if rest in _BLOCK_LEAF:
                return [prefix + _BLOCK_LEAF[rest]]
            module, _, leaf = rest.rpartition(".")
            if module == "attn.to_qkv":
                return [f"{prefix}attn1.to_{x}.{leaf}" for x in "qkv"]
            table = _BLOCK
        elif section == "embed" and rest in _EMBED_LEAF:
            return [_EMBED_LEAF[rest]]
        else:
            table, prefix = {"embed": _EMBED, "final": _FINAL}.get(section, {}), ""
            module, _, leaf = rest.rpartition(".")
        if module not in table:
            raise KeyError(f"{name} has no counterpart in diffusers' {self.class_name}")
        return [f"{prefix}{table[module]}.{leaf}"]

    def shapes(self, name: str, shape: tuple[int, ...], m: CogVideoXConfig) -> dict[str, tuple[int, ...]]:
        sources = self.names(name)
        if name == PATCH_WEIGHT and m.patch_size_t == 1:
            return {sources[0]: (m.hidden_size, m.transformer_in_channels, m.patch_size, m.patch_size)}
        rows = shape[0] // len(sources)
        return {s: (rows, *shape[1:]) for s in sources}

    def reference_kwargs(self, model: torch.nn.Module, inputs: tuple) -> dict:
        """The rotary tables (fp32) and ofs as CogVideoXPipeline / CogVideoXImageToVideoPipeline make them
        (_prepare_rotary_positional_embeddings): 1.0 crops a grid of sample_height x sample_width patches,
        1.5 slices one of that size."""
        from diffusers.models.embeddings import get_3d_rotary_pos_embed
        from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

        latents = inputs[0]
        c, p = model.config, model.config.patch_size
        grid, base = (latents.shape[3] // p, latents.shape[4] // p), (c.sample_height // p, c.sample_width // p)
        rotary = None
        if c.use_rotary_positional_embeddings and c.patch_size_t is None:
            crop = get_resize_crop_region_for_grid(grid, base[1], base[0])
            rotary = get_3d_rotary_pos_embed(c.attention_head_dim, crop, grid, latents.shape[2])
        elif c.use_rotary_positional_embeddings:
            rotary = get_3d_rotary_pos_embed(c.attention_head_dim, None, grid, latents.shape[2] // c.patch_size_t,
                                             grid_type="slice", max_size=base)
        rotary = tuple(t.to(latents.device) for t in rotary) if rotary is not None else None
        return {"image_rotary_emb": rotary, "ofs": latents.new_full((1,), 2.0) if c.ofs_embed_dim else None}

    def reference_call(self, model: torch.nn.Module, inputs: tuple, kwargs: dict) -> torch.Tensor:
        """diffusers' CogVideoX takes and returns [B, T, C, H, W]: transposed in and out."""
        latents, timesteps, text = inputs
        return model(latents.transpose(1, 2), text, timesteps, **kwargs).sample.transpose(1, 2)


DIFFUSERS = CogVideoXDiffusers()
