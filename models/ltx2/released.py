"""LTX-2 as diffusers publishes it (`LTX2VideoTransformer3DModel`): config translation and tensor names.

The toolkit's modules carry diffusers' names, so the map is short:

    toolkit                               diffusers
    embed.<name>, final.<name>            <name> (proj_in, caption_projection, time_embed, ..., proj_out)
    blocks.i.<attn>.to_qkv                transformer_blocks.i.<attn>.to_{q,k,v} (fused: rows [q; k; v])
    blocks.i.<attn>.to_kv                 transformer_blocks.i.<attn>.to_{k,v} (fused: rows [k; v])
    blocks.i.<attn>.to_out                transformer_blocks.i.<attn>.to_out.0
    blocks.i.<ff>.ff_in / ff_out          transformer_blocks.i.<ff>.net.0.proj / net.2
    blocks.i.<rest>                       transformer_blocks.i.<rest>
"""
from __future__ import annotations

from typing import Optional

import torch

from models.geometry import latent_shape
from models.ltx2.config import LTX2Config
from models.spec import DiffusersFormat, config_problems, placed

_FUSED = {"to_qkv": ("to_q", "to_k", "to_v"), "to_kv": ("to_k", "to_v")}
_RENAMED = {"to_out": "to_out.0", "ff_in": "net.0.proj", "ff_out": "net.2"}


def _config_pairs(m: LTX2Config) -> list[tuple[str, object, Optional[str], object]]:
    """(config.json key, the class's default, our key or None, ours)."""
    return [
        ("num_layers", 48, "model.num_layers", m.num_layers),
        ("num_attention_heads", 32, "model.num_heads", m.num_heads),
        ("attention_head_dim", 128, "model.head_dim", m.head_dim),
        ("cross_attention_dim", 4096, "model.hidden_size", m.hidden_size),
        ("in_channels", 128, "model.in_channels", m.in_channels),
        ("out_channels", 128, "model.in_channels", m.in_channels),
        ("caption_channels", 3840, "model.text_embed_dim", m.text_embed_dim),
        ("audio_num_attention_heads", 32, "model.audio_num_heads", m.audio_num_heads),
        ("audio_attention_head_dim", 64, "model.audio_head_dim", m.audio_head_dim),
        ("audio_cross_attention_dim", 2048, "model.audio_hidden_size", m.audio_hidden_size),
        ("audio_in_channels", 128, "model.audio_in_channels", m.audio_in_channels),
        ("audio_out_channels", 128, "model.audio_in_channels", m.audio_in_channels),
        ("audio_scale_factor", 4, "model.audio_scale_factor", m.audio_scale_factor),
        ("audio_sampling_rate", 16000, "model.audio_sampling_rate", m.audio_sampling_rate),
        ("audio_hop_length", 160, "model.audio_hop_length", m.audio_hop_length),
        ("vae_scale_factors", [8, 32, 32], "model.vae_scale_temporal, model.vae_scale_spatial",
         [m.vae_scale_temporal, m.vae_scale_spatial, m.vae_scale_spatial]),
        ("pos_embed_max_pos", 20, "model.pos_embed_max_pos", m.pos_embed_max_pos),
        ("audio_pos_embed_max_pos", 20, "model.audio_pos_embed_max_pos", m.audio_pos_embed_max_pos),
        ("base_height", 2048, "model.base_height", m.base_height),
        ("base_width", 2048, "model.base_width", m.base_width),
        ("rope_theta", 10000.0, "model.rope_theta", m.rope_theta),
        ("rope_type", "interleaved", "model.rope_type", m.rope_type),
        ("causal_offset", 1, "model.causal_offset", m.causal_offset),
        ("timestep_scale_multiplier", 1000, "model.timestep_scale_multiplier", m.timestep_scale_multiplier),
        ("cross_attn_timestep_scale_multiplier", 1000, "model.cross_attn_timestep_scale_multiplier",
         m.cross_attn_timestep_scale_multiplier),
        ("gated_attn", False, "model.gated_attn", m.gated_attn),
        ("audio_gated_attn", False, "model.audio_gated_attn", m.audio_gated_attn),
        ("cross_attn_mod", False, "model.cross_attn_mod", m.cross_attn_mod),
        ("audio_cross_attn_mod", False, "model.audio_cross_attn_mod", m.audio_cross_attn_mod),
        ("use_prompt_embeddings", True, "model.prompt_embeddings", m.prompt_embeddings),
        # What the toolkit's LTX-2 always is: these have no model.* key.
        ("patch_size", 1, None, 1),
        ("patch_size_t", 1, None, 1),
        ("audio_patch_size", 1, None, 1),
        ("audio_patch_size_t", 1, None, 1),
        ("activation_fn", "gelu-approximate", None, "gelu-approximate"),
        ("qk_norm", "rms_norm_across_heads", None, "rms_norm_across_heads"),
        ("norm_elementwise_affine", False, None, False),
        ("norm_eps", 1e-6, None, 1e-6),
        ("attention_bias", True, None, True),
        ("attention_out_bias", True, None, True),
        ("rope_double_precision", True, None, True),
        ("ff_bias", True, None, True),
        ("audio_ff_bias", True, None, True),
        ("use_prompt_adaln_single", True, None, True),
        ("use_keyframes_abs_pos_embedding", False, None, False),
    ]


class LTX2Diffusers(DiffusersFormat):
    """The `ReleasedFormat` (models/spec.py) of diffusers' LTX2VideoTransformer3DModel."""

    class_name = "LTX2VideoTransformer3DModel"
    predictions = ("video", "audio")

    def check_config(self, m: LTX2Config, config: dict, path: str) -> list[str]:
        # perturbed_attn only changes the processor (STG guidance at sampling); the weights and forward are equal.
        return config_problems(_config_pairs(m), config, path, "the toolkit's LTX-2 model has {}; LTX-2 and "
                               "LTX-2.3 transformers qualify")

    def config(self, m: LTX2Config, data) -> dict:
        return {key: value for key, _, _, value in _config_pairs(m)}

    def names(self, name: str) -> list[str]:
        section, _, rest = name.partition(".")
        if section in ("embed", "final"):
            return [rest]
        if section != "blocks":
            raise KeyError(f"{name} has no counterpart in diffusers' {self.class_name}")
        index, _, rest = rest.partition(".")
        module, _, leaf = rest.rpartition(".")
        head, _, last = module.rpartition(".")
        prefix = f"transformer_blocks.{index}." + (head + "." if head else "")
        if last in _FUSED:
            return [f"{prefix}{part}.{leaf}" for part in _FUSED[last]]
        return [f"{prefix}{_RENAMED.get(last, last)}" + (f".{leaf}" if module else leaf)]

    def shapes(self, name: str, shape: tuple[int, ...], m: LTX2Config) -> dict[str, tuple[int, ...]]:
        sources = self.names(name)
        rows = shape[0] // len(sources)
        return {s: (rows, *shape[1:]) for s in sources}

    def example_inputs(self, m: LTX2Config, data, batch: int, generator) -> tuple:
        """(latents, t [B], text, audio [B, A, Ca], audio text, audio t [B]): EmbedStage's inputs."""
        latents = torch.randn(batch, m.in_channels, *latent_shape(m, data), generator=generator)
        t = torch.randint(0, 1000, (batch,), generator=generator)
        text = torch.randn(batch, m.max_text_len, m.text_embed_dim, generator=generator)
        audio = torch.randn(batch, m.audio_tokens(data), m.audio_in_channels, generator=generator)
        atext = torch.randn(batch, m.max_text_len, m.audio_caption_dim, generator=generator)
        return latents, t, text, audio, atext, torch.randint(0, 1000, (batch,), generator=generator)

    def prediction_like(self, m: LTX2Config, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(video [B, C, T, H, W], audio [B, A, Ca]): the shapes of the latents and the audio latents."""
        return torch.empty(inputs[0].shape), torch.empty(inputs[3].shape)

    def reference_call(self, model: torch.nn.Module, inputs: tuple, kwargs: dict):
        """diffusers' (video [B, C, T, H, W], audio [B, A, Ca]) as the pipelines call it (sigma = the video
        timesteps, audio_sigma = the audio ones), positions from the grid and config.json's frame rate. Video
        timesteps per latent position [B, T, H, W] (image-to-video) go in as LTX2ImageToVideoPipeline passes them:
        `timestep` [B, S], and sigma the later frames' (its t)."""
        latents, t, text, audio, atext, at = inputs
        b, c, frames, h, w = latents.shape
        fps = kwargs.pop("fps", 24.0)
        cross = kwargs.pop("use_cross_timestep", True)
        t, sigma = (t, t) if t.dim() == 1 else (t.flatten(1), t.flatten(1)[:, -1])
        video, audio_out = model(
            hidden_states=latents.flatten(2).transpose(1, 2), audio_hidden_states=audio,
            encoder_hidden_states=text, audio_encoder_hidden_states=atext, timestep=t, audio_timestep=at,
            sigma=sigma, audio_sigma=at, num_frames=frames, height=h, width=w, fps=fps,
            audio_num_frames=audio.shape[1], use_cross_timestep=cross, return_dict=False, **kwargs)
        return video.transpose(1, 2).reshape(b, -1, frames, h, w), audio_out

    def reference(self, folder: str, inputs: tuple, place=None):
        """(video, audio) at fp32 under no_grad, on the host (DiffusersFormat's, for a model of two outputs)."""
        model, inputs = placed(self.reference_model(folder), inputs, place)
        with torch.no_grad():
            return tuple(o.float().cpu() for o in
                         self.reference_call(model, inputs, self.reference_kwargs(model, inputs)))


DIFFUSERS = LTX2Diffusers()
