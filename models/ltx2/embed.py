"""LTX-2's first and last stages: the inputs of both streams to the stage tuple, and the stage tuple to both
predictions (models/ltx2/model.py lists the tuple). Module names are diffusers' (LTX2VideoTransformer3DModel).

Inputs (as the pipelines call the transformer, in the toolkit's order):

    latents [B, C, T, H, W]   video latents (patch 1: one token per latent position)
    t       [B]               video timesteps (the pipelines' `timestep`, 0..1000; also `sigma` for LTX-2.3), or
            [B, T, H, W]      per latent position (image-to-video, LTX2ImageToVideoPipeline's timestep t (1 - mask)):
                              latent frame 0's, then the one of every later frame (its last position's), which is
                              also `sigma`; vmod then has a row for each (models/ltx2/model.py)
    text    [B, L, caption]   the connector's video caption states
    audio   [B, A, Ca]        packed audio latents (the pipelines' [B, C, frames, mel] -> [B, frames, C mel])
    atext   [B, L, caption]   the connector's audio caption states
    at      [B]               audio timesteps (`audio_timestep`, and `audio_sigma`)

Each timestep embedding is diffusers' AdaLayerNormSingle: e = MLP(sinusoid_256(t)) (the head's modulation) and
W silu(e) (the rows it modulates). Under `model.cross_timestep` (the pipelines' use_cross_timestep, default true)
the video stream's a2v/v2a modulation reads the audio timesteps and the audio stream's the video ones; the gates
see timesteps x cross_attn_timestep_scale_multiplier / timestep_scale_multiplier.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.embeddings import timestep_embedding
from models.geometry import patchify, unpatchify
from models.ltx2.config import LTX2Config
from models.ltx2.model import EPS, first_frame_tokens, mod_rows, modulate
from parallel.distributed.sequence import gather_sequence, local_range, sp_size_of, split_sequence


class TimestepEmbedder(nn.Module):
    """diffusers' TimestepEmbedding: linear_1 -> SiLU -> linear_2."""

    def __init__(self, width: int):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(256, width), nn.Linear(width, width)

    def forward(self, x):
        return self.linear_2(F.silu(self.linear_1(x)))


class _Emb(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.timestep_embedder = TimestepEmbedder(width)


class AdaLNSingle(nn.Module):
    """t [B] -> (W silu(e) [B, 1, rows x width], e [B, 1, width]), e = MLP([cos, sin](t)) (LTX2AdaLayerNormSingle)."""

    def __init__(self, width: int, rows: int):
        super().__init__()
        self.emb, self.linear = _Emb(width), nn.Linear(width, rows * width)

    def forward(self, t: torch.Tensor, dtype):
        e = self.emb.timestep_embedder(timestep_embedding(t.flatten(), 256).to(dtype))
        return self.linear(F.silu(e))[:, None], e[:, None]


class TextProjection(nn.Module):
    """diffusers' PixArtAlphaTextProjection: linear_1 -> GELU (tanh) -> linear_2."""

    def __init__(self, features: int, width: int):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(features, width), nn.Linear(width, width)

    def forward(self, x):
        return self.linear_2(F.gelu(self.linear_1(x), approximate="tanh"))


class EmbedStage(nn.Module):
    """(latents, t, text, audio, atext, at) -> (x, a, vmod, amod, y, ya)."""

    def __init__(self, cfg: LTX2Config, grid, ctx=None):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        d, da = cfg.hidden_size, cfg.audio_hidden_size
        self.proj_in = nn.Linear(cfg.in_channels, d)
        self.audio_proj_in = nn.Linear(cfg.audio_in_channels, da)
        if cfg.prompt_embeddings:
            self.caption_projection = TextProjection(cfg.text_embed_dim, d)
            self.audio_caption_projection = TextProjection(cfg.text_embed_dim, da)
        self.time_embed = AdaLNSingle(d, mod_rows(cfg, False)["block"])
        self.audio_time_embed = AdaLNSingle(da, mod_rows(cfg, True)["block"])
        self.av_cross_attn_video_scale_shift = AdaLNSingle(d, 4)
        self.av_cross_attn_audio_scale_shift = AdaLNSingle(da, 4)
        self.av_cross_attn_video_a2v_gate = AdaLNSingle(d, 1)
        self.av_cross_attn_audio_v2a_gate = AdaLNSingle(da, 1)
        if cfg.cross_attn_adaln:
            self.prompt_adaln, self.audio_prompt_adaln = AdaLNSingle(d, 2), AdaLNSingle(da, 2)

    def forward(self, inputs):
        latents, t, text, audio, atext, at = inputs
        m, dtype = self.cfg, self.proj_in.weight.dtype
        x = split_sequence(self.proj_in(patchify(latents.to(dtype), m)), self.ctx)     # (B, S/sp, D)
        a = self.audio_proj_in(audio.to(dtype))                                         # (B, A, Da)
        # image-to-video: the later frames' timestep (the pipeline's sigma) and the first frame's
        steps = (t,) if t.dim() == 1 else (t.flatten(1)[:, -1], t.flatten(1)[:, 0])
        gate = m.cross_attn_timestep_scale_multiplier / m.timestep_scale_multiplier
        # each stream's a2v/v2a modulation timestep: the other stream's (model.cross_timestep), else its own
        vmod = torch.cat([self._rows(self.time_embed, self.av_cross_attn_video_scale_shift,
                                     self.av_cross_attn_video_a2v_gate, getattr(self, "prompt_adaln", None), v,
                                     at if m.cross_timestep else v, steps[0], gate, dtype) for v in steps], dim=1)
        amod = self._rows(self.audio_time_embed, self.av_cross_attn_audio_scale_shift,
                          self.av_cross_attn_audio_v2a_gate, getattr(self, "audio_prompt_adaln", None), at,
                          steps[0] if m.cross_timestep else at, at, gate, dtype)
        y, ya = text.to(dtype), atext.to(dtype)
        if m.prompt_embeddings:
            y, ya = self.caption_projection(y), self.audio_caption_projection(ya)
        return x, a, vmod, amod, y, ya

    @staticmethod
    def _rows(block, cross, gate, prompt, t, ct, sigma, scale, dtype):
        """One stream's modulation rows [B, 1, M W] in mod_rows' order, at timesteps t (block, head), ct (a2v/v2a)
        and sigma (LTX-2.3's caption: the pipelines pass the stream's timestep); the head's e last."""
        rows, e = block(t, dtype)
        parts = [rows, cross(ct, dtype)[0], gate(ct * scale, dtype)[0]]
        if prompt is not None:
            parts.append(prompt(sigma, dtype)[0])
        return torch.cat(parts + [e], dim=-1)


class FinalStage(nn.Module):
    """(x, a, vmod, amod, ...) -> (video [B, C, T, H, W], audio [B, A, Ca]): LayerNorm (no affine), shift and scale
    from scale_shift_table [2, W] + e, proj_out; per stream. With sp, the video as this rank's tokens [B, S_pad/sp,
    C] (`assemble` makes the full prediction); the audio is whole on every rank."""

    def __init__(self, cfg: LTX2Config, grid, ctx=None):
        super().__init__()
        self.cfg, self.grid, self.ctx = cfg, grid, ctx
        d, da = cfg.hidden_size, cfg.audio_hidden_size
        self.scale_shift_table = nn.Parameter(torch.randn(2, d) / d ** 0.5)
        self.audio_scale_shift_table = nn.Parameter(torch.randn(2, da) / da ** 0.5)
        self.proj_out = nn.Linear(d, cfg.in_channels)
        self.audio_proj_out = nn.Linear(da, cfg.audio_in_channels)

    def forward(self, inputs):
        x, a, vmod, amod = inputs[:4]
        start = local_range(math.prod(tuple(self.grid)), self.ctx)[0]
        k = first_frame_tokens(self.grid, start, x.shape[1])     # image-to-video: the first frame's, here
        video = self._head(x, vmod[..., -x.shape[-1]:], self.scale_shift_table, self.proj_out, k)
        audio = self._head(a, amod[..., -a.shape[-1]:], self.audio_scale_shift_table, self.audio_proj_out)
        return (unpatchify(video, self.cfg, self.grid) if sp_size_of(self.ctx) == 1 else video), audio

    @staticmethod
    def _head(h, e, table, proj, k: int = 0):
        shift, scale = (table + e[:, :, None]).unbind(2)                 # (B, 1, W) each (image-to-video: 2)
        return proj(modulate(F.layer_norm(h, (h.shape[-1],), eps=EPS), scale, shift, k))

    def assemble(self, out):
        """The full (video, audio) from forward's output on any sp rank (no gradient)."""
        video, audio = out
        if sp_size_of(self.ctx) == 1:
            return out
        return unpatchify(gather_sequence(video, self.ctx, total=math.prod(self.grid.value)), self.cfg,
                          self.grid), audio
