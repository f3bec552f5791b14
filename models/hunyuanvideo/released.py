"""HunyuanVideo as diffusers publishes it (`HunyuanVideoTransformer3DModel`): config translation and tensor names.

    toolkit                              diffusers
    embed.patch_proj                     x_embedder.proj (Conv3d [H, C, pt, p, p] = our Linear [H, (C pt p q)])
    embed.timestep_embedder / guidance_embedder / pooled_embedder
                                         time_text_embed.{timestep_embedder, guidance_embedder, text_embedder}
    embed.refiner_timestep_embedder / refiner_text_embedder
                                         context_embedder.time_text_embed.{timestep_embedder, text_embedder}
    embed.refiner_proj_in                context_embedder.proj_in
    embed.refiner.j.*, blocks.i, final.*  as in models/shared/released.py's table (shared with HunyuanVideo 1.5)

D = model.num_dual_layers: the map depends on the config, so parallel/weights/ asks for `bind(model)`.
"""
from __future__ import annotations

from typing import Optional

import torch

from models.geometry import latent_shape
from models.hunyuanvideo.config import EMBEDDED_GUIDANCE, HunyuanVideoConfig
from models.shared.released import mlp_ratio_check, mmdit_names
from models.spec import DiffusersFormat, config_problems, release_hidden_size

_EMBED = {"patch_proj": "x_embedder.proj", "refiner_proj_in": "context_embedder.proj_in",
          **{f"{ours}.linear_{k}": f"{theirs}.linear_{k}" for k in (1, 2) for ours, theirs in (
              ("timestep_embedder", "time_text_embed.timestep_embedder"),
              ("guidance_embedder", "time_text_embed.guidance_embedder"),
              ("pooled_embedder", "time_text_embed.text_embedder"),
              ("refiner_timestep_embedder", "context_embedder.time_text_embed.timestep_embedder"),
              ("refiner_text_embedder", "context_embedder.time_text_embed.text_embedder"))}}
PATCH_WEIGHT = "embed.patch_proj.weight"


# diffusers' HunyuanVideoTransformer3DModel arguments: (config.json key, its default, our key or None, ours).
def _config_pairs(m: HunyuanVideoConfig) -> list[tuple[str, object, Optional[str], object]]:
    return [
        ("num_attention_heads", 24, "model.num_heads", m.num_heads),
        ("attention_head_dim", 128, "model.head_dim", m.head_dim),
        ("num_layers", 20, "model.num_dual_layers", m.num_dual_layers),
        ("num_single_layers", 40, "model.num_layers - model.num_dual_layers", m.num_single_layers),
        ("num_refiner_layers", 2, "model.num_refiner_layers", m.num_refiner_layers),
        ("mlp_ratio", 4.0, "model.ffn_hidden_size", m.ffn_size / m.hidden_size),
        ("in_channels", 16, "model.in_channels", m.in_channels),
        ("out_channels", 16, "model.in_channels", m.in_channels),
        ("patch_size", 2, "model.patch_size", m.patch_size),
        ("patch_size_t", 1, "model.patch_size_t", m.patch_size_t),
        ("text_embed_dim", 4096, "model.text_embed_dim", m.llama_dim),
        ("pooled_projection_dim", 768, "model.pooled_projection_dim", m.pooled_projection_dim),
        ("rope_theta", 256.0, "model.rope_theta", m.rope_theta),
        ("rope_axes_dim", [16, 56, 56], "model.rope_axes_dim", list(m.rope_axes_dim)),
        ("guidance_embeds", True, "model.guidance_embed", m.guidance_embed),
        # What the toolkit's HunyuanVideo model always is (text-to-video): no model.* key.
        ("qk_norm", "rms_norm", None, "rms_norm"),
        ("image_condition_type", None, None, None),
    ]


class HunyuanVideoDiffusers(DiffusersFormat):
    """The `ReleasedFormat` (models/spec.py) of diffusers' HunyuanVideoTransformer3DModel, bound to a config
    (`bind`: which blocks are dual-stream)."""

    class_name = "HunyuanVideoTransformer3DModel"

    def __init__(self, num_dual: Optional[int] = None):
        self.num_dual = num_dual

    def bind(self, m: HunyuanVideoConfig) -> "HunyuanVideoDiffusers":
        return HunyuanVideoDiffusers(m.num_dual_layers)

    def check_config(self, m: HunyuanVideoConfig, config: dict, path: str) -> list[str]:
        # diffusers' text_embed_dim is the LLaMA width, ours that plus the pooled vector's
        def text_dim(theirs, value) -> Optional[str]:
            return None if theirs == value else (f"text_embed_dim {theirs} != model.text_embed_dim - model."
                                                 f"pooled_projection_dim {value}; set --set model.text_embed_dim="
                                                 f"{theirs + config.get('pooled_projection_dim', 768)}")
        # the toolkit's num_layers counts both kinds: the release's dual + single blocks
        def single_layers(theirs, value) -> Optional[str]:
            return None if theirs == value else (f"num_single_layers {theirs} != model.num_layers - model."
                                                 f"num_dual_layers {value}; set --set model.num_layers="
                                                 f"{config.get('num_layers', 20) + theirs}")
        problems = config_problems(_config_pairs(m), config, path, "the toolkit's HunyuanVideo model has {}; "
                                   "HunyuanVideo text-to-video (13B) qualifies",
                                   {"text_embed_dim": text_dim,
                                    "mlp_ratio": mlp_ratio_check(m, release_hidden_size(_config_pairs(m), config)),
                                    "num_single_layers": single_layers})
        if m.cond_embed:
            problems.append(f"{path}: model.cond_embed=true (Open-Sora 2.0's cond_in) has no counterpart in "
                            f"diffusers' {self.class_name}; read Open-Sora's own checkpoint (a .safetensors file "
                            f"as model.init_from) or set model.cond_embed=false")
        return problems

    def config(self, m: HunyuanVideoConfig, data) -> dict:
        return {key: value for key, _, _, value in _config_pairs(m)}

    def names(self, name: str) -> list[str]:
        return mmdit_names(name, self.num_dual, _EMBED, self.class_name)

    def shapes(self, name: str, shape: tuple[int, ...], m: HunyuanVideoConfig) -> dict[str, tuple[int, ...]]:
        sources = self.names(name)
        if name == PATCH_WEIGHT:
            return {sources[0]: (m.hidden_size, m.in_channels, m.patch_size_t, m.patch_size, m.patch_size)}
        if len(sources) == 4:                             # single block: [q; k; v; MLP] rows
            rows = [m.hidden_size] * 3 + [m.ffn_size]
        else:
            rows = [shape[0] // len(sources)] * len(sources)
        return {s: (n, *shape[1:]) for s, n in zip(sources, rows)}

    def example_inputs(self, m: HunyuanVideoConfig, data, batch: int, generator) -> tuple:
        """(latents [B, C, T, H, W], integer timesteps [B], text [B, L, llama + pooled]: each row a LLaMA state and
        the caption's pooled vector)."""
        latents = torch.randn(batch, m.in_channels, *latent_shape(m, data), generator=generator)
        timesteps = torch.randint(0, 1000, (batch,), generator=generator)
        llama = torch.randn(batch, m.max_text_len, m.llama_dim, generator=generator)
        pooled = torch.randn(batch, 1, m.pooled_projection_dim, generator=generator)
        return latents, timesteps, torch.cat([llama, pooled.expand(-1, m.max_text_len, -1)], dim=-1)

    def reference_call(self, model: torch.nn.Module, inputs: tuple, kwargs: dict) -> torch.Tensor:
        """diffusers' HunyuanVideo takes [B, C, T, H, W], the LLaMA states with their mask (a row is padding when
        its LLaMA channels are all zero), the pooled vector and the guidance x 1000, as HunyuanVideoPipeline."""
        latents, timesteps, text = inputs
        pooled_dim = model.config.pooled_projection_dim
        llama, pooled = text[..., :-pooled_dim], text[:, 0, -pooled_dim:]
        mask = llama.ne(0).any(dim=-1).long()
        guidance = torch.full((latents.shape[0],), EMBEDDED_GUIDANCE * 1000.0, device=latents.device, dtype=text.dtype)
        return model(hidden_states=latents, timestep=timesteps, encoder_hidden_states=llama,
                     encoder_attention_mask=mask, pooled_projections=pooled, guidance=guidance).sample


DIFFUSERS = HunyuanVideoDiffusers()
