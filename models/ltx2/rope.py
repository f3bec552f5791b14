"""LTX-2's rotary positions (diffusers' LTX2AudioVideoRotaryPosEmbed), as tables over the whole attention width.

A token's position is the midpoint of the span it covers, in seconds and pixels: a video token at latent
(f, i, j) covers frames [8f, 8f + 8) shifted by causal_offset - 8 and clamped at 0 (the causal VAE's first latent
frame is one pixel frame), divided by the frame rate, and pixels [32i, 32i + 32), [32j, 32j + 32); an audio token
at latent frame f covers mel frames [4f, 4f + 4) shifted likewise, times hop / sampling rate seconds. Each axis
position p, over its span P (20 s, 2048 px), gives u = 2 p / P - 1 and the angles u x w_k, w_k = theta^(k / (K - 1))
pi / 2 (k < K = width / (2 x axes)); the angles of all axes, frequency-major, fill width / 2 channel pairs, the
rest (width mod 2 x axes channels, in front) unrotated.

The table spans every head (width = heads x head_dim): `interleaved` turns neighbouring channels (cos, sin
[N, width]); `split` turns the two halves of each head (cos, sin [N, heads, head_dim / 2]). Under tensor
parallelism a rank takes the part of its heads' columns (`local`), under Ulysses the part of those its
attention holds (`local` again), and under sequence parallelism the rows of its tokens (`rows`). The
audio-video cross-attentions use the time axis alone, over the audio heads' width, for the video queries and the
audio keys (and the reverse).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

F32 = torch.float32


def _midpoints(start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    return (start + end) / 2.0


def video_positions(scales: tuple[int, int, int], causal_offset: int, fps: float, t: int, h: int, w: int):
    """[3, t h w] positions (seconds, pixels, pixels) of the tokens of a (t, h, w) latent grid (patch 1)."""
    axes = [torch.arange(0, n, 1, dtype=F32) for n in (t, h, w)]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=0)                  # (3, t, h, w)
    ends = grid + torch.tensor([1, 1, 1], dtype=F32).view(3, 1, 1, 1)
    coords = torch.stack([grid, ends], dim=-1).flatten(1, 3)                          # (3, N, 2)
    pixels = coords * torch.tensor(scales).view(3, 1, 1)
    pixels[0] = (pixels[0] + causal_offset - scales[0]).clamp(min=0)
    pixels[0] = pixels[0] / fps
    return _midpoints(pixels[..., 0], pixels[..., 1])


def audio_positions(scale: int, causal_offset: int, hop: int, rate: int, n: int) -> torch.Tensor:
    """[1, n] positions in seconds of n audio latent frames."""
    f = torch.arange(0, n, 1, dtype=F32)

    def seconds(mel):
        return (mel + causal_offset - scale).clip(min=0) * hop / rate
    return _midpoints(seconds(f * scale), seconds((f + 1) * scale))[None]


def rope_table(positions: torch.Tensor, spans: tuple[float, ...], width: int, heads: int, theta: float,
               rope_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of positions [P, N] over spans (P axes): [N, width] (interleaved) or [N, heads, width / heads / 2]
    (split)."""
    axes = positions.shape[0]
    grid = torch.stack([positions[i] / spans[i] for i in range(axes)], dim=-1)       # (N, P)
    pairs = axes * 2
    powers = torch.pow(theta, torch.linspace(0.0, 1.0, steps=width // pairs, dtype=torch.float64))
    freqs = (powers * math.pi / 2.0).to(F32)
    freqs = ((grid.unsqueeze(-1) * 2 - 1) * freqs).transpose(-1, -2).flatten(1)      # (N, K P)
    if rope_type == "interleaved":
        cos, sin = freqs.cos().repeat_interleave(2, dim=-1), freqs.sin().repeat_interleave(2, dim=-1)
        pad = width % pairs
    else:
        cos, sin = freqs.cos(), freqs.sin()
        pad = width // 2 - freqs.shape[-1]
    if pad:
        cos = torch.cat([torch.ones_like(cos[:, :pad]), cos], dim=-1)
        sin = torch.cat([torch.zeros_like(sin[:, :pad]), sin], dim=-1)
    if rope_type == "split":
        cos, sin = cos.unflatten(-1, (heads, -1)), sin.unflatten(-1, (heads, -1))   # (N, heads, d/2)
    return cos, sin


def local(table: tuple[torch.Tensor, torch.Tensor], rank: int, size: int):
    """This tp rank's part of a table over the whole width: its 1/size of the columns (interleaved), or of the
    groups (split: diffusers groups by the head count it was built with, which a rank's columns hold whole)."""
    if size == 1:
        return table

    def part(x):
        n = x.shape[1] // size                              # columns (interleaved) or groups (split)
        return x[:, rank * n:(rank + 1) * n]
    return part(table[0]), part(table[1])


def rows(table: tuple[torch.Tensor, torch.Tensor], start: int, stop: int):
    """Rows [start, stop) of a table: an sp rank's tokens (parallel/distributed/sequence.py `local_range`); rows
    past the table's end (sp padding) unturned, cos 1 and sin 0."""
    cos, sin = table
    real = max(min(stop, cos.shape[0]) - start, 0)
    cos, sin = cos[start:start + real], sin[start:start + real]
    pad = stop - start - real
    if pad:
        cos = torch.cat([cos, cos.new_ones((pad, *cos.shape[1:]))])
        sin = torch.cat([sin, sin.new_zeros((pad, *sin.shape[1:]))])
    return cos, sin


def apply_rope(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """[B, N, C] (C = local heads x head_dim) turned by a table of N rows, in fp32, as diffusers."""
    cos, sin = table
    if cos.dim() == 2:                                      # interleaved: pairs (2i, 2i + 1)
        real, imag = x.unflatten(2, (-1, 2)).unbind(-1)
        turned = torch.stack([-imag, real], dim=-1).flatten(2)
        return (x.float() * cos + turned.float() * sin).to(x.dtype)
    b, n, _ = x.shape                                       # split: halves of each head
    halves = x.reshape(b, n, cos.shape[1], 2, -1).float()                              # (B, N, h, 2, d/2)
    first, second = halves[..., 0, :], halves[..., 1, :]
    out = torch.stack([first * cos - sin * second, second * cos + sin * first], dim=-2)
    return out.reshape(b, n, -1).to(x.dtype)


class RopeParams(NamedTuple):
    """The model section's fields the tables read (hashable: the key of models.geometry.PositionCache)."""

    hidden_size: int
    num_heads: int
    audio_hidden_size: int
    audio_num_heads: int
    vae_scale_temporal: int
    vae_scale_spatial: int
    causal_offset: int
    frame_rate: float
    pos_embed_max_pos: int
    audio_pos_embed_max_pos: int
    base_height: int
    base_width: int
    audio_scale_factor: int
    audio_hop_length: int
    audio_sampling_rate: int
    rope_theta: float
    rope_type: str

    @classmethod
    def of(cls, m) -> "RopeParams":
        return cls(*(getattr(m, f) for f in cls._fields))


def video_rope(m: RopeParams, t: int, h: int, w: int):
    """Video self-attention's table (3 axes over the video heads)."""
    positions = video_positions((m.vae_scale_temporal, m.vae_scale_spatial, m.vae_scale_spatial), m.causal_offset,
                                m.frame_rate, t, h, w)
    return rope_table(positions, (m.pos_embed_max_pos, m.base_height, m.base_width), m.hidden_size, m.num_heads,
                      m.rope_theta, m.rope_type)


def audio_rope(m: RopeParams, n: int):
    """Audio self-attention's table (time over the audio heads)."""
    positions = audio_positions(m.audio_scale_factor, m.causal_offset, m.audio_hop_length, m.audio_sampling_rate, n)
    return rope_table(positions, (m.audio_pos_embed_max_pos,), m.audio_hidden_size, m.audio_num_heads, m.rope_theta,
                      m.rope_type)


def cross_ropes(m: RopeParams, t: int, h: int, w: int, n: int):
    """(video cos, sin, audio cos, sin) tables of the audio-video cross-attentions: time alone, over the audio heads' width, with the
    span of the longer of the two time spans."""
    span = (max(m.pos_embed_max_pos, m.audio_pos_embed_max_pos),)
    video = video_positions((m.vae_scale_temporal, m.vae_scale_spatial, m.vae_scale_spatial), m.causal_offset,
                            m.frame_rate, t, h, w)[:1]
    audio = audio_positions(m.audio_scale_factor, m.causal_offset, m.audio_hop_length, m.audio_sampling_rate, n)
    # diffusers builds the video side with num_attention_heads = the video heads (only `split` reads it)
    return (*rope_table(video, span, m.audio_hidden_size, m.num_heads, m.rope_theta, m.rope_type),
            *rope_table(audio, span, m.audio_hidden_size, m.audio_num_heads, m.rope_theta, m.rope_type))
