"""Positional and timestep embeddings of the CogVideoX and STDiT families (no parameters here except in callers).

Latent video [B, C, T, H, W] becomes T x (H/p) x (W/p) patch tokens, ordered (t, h, w).
"""
from __future__ import annotations

import math

import torch


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of (possibly fractional) timesteps: [B] -> [B, dim], cos half first."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]                           # (B, half)
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return torch.nn.functional.pad(emb, (0, dim % 2))


def _sincos_1d(dim: int, pos: torch.Tensor) -> torch.Tensor:
    """[N] positions -> [N, dim] (sin half, cos half), as in MAE/DiT."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    out = pos.double()[:, None] * omega[None]
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)


def sincos_3d(dim: int, t: int, h: int, w: int, spatial_scale: float = 1.875) -> torch.Tensor:
    """Fixed 3D sin-cos positions [t*h*w, dim]: 3/4 of dim for (h, w), 1/4 for time (CogVideoX-2B).

    spatial_scale is CogVideoX's interpolation scale (positions divided by it).
    """
    if dim % 16:
        raise ValueError(f"sin-cos 3D positions need hidden_size divisible by 16, got {dim}")
    dim_s, dim_t = dim // 4 * 3, dim // 4
    gh = torch.arange(h, dtype=torch.float64) / spatial_scale
    gw = torch.arange(w, dtype=torch.float64) / spatial_scale
    grid_h, grid_w = torch.meshgrid(gh, gw, indexing="ij")
    spatial = torch.cat([_sincos_1d(dim_s // 2, grid_w.flatten()), _sincos_1d(dim_s // 2, grid_h.flatten())], 1)
    temporal = _sincos_1d(dim_t, torch.arange(t, dtype=torch.float64))  # (t, dim_t)
    pos = torch.cat([temporal[:, None, :].expand(t, h * w, dim_t),
                     spatial[None].expand(t, h * w, dim_s)], dim=-1)      # (t, h*w, dim)
    return pos.reshape(t * h * w, dim).float()


def sincos_2d(dim: int, h: int, w: int, scale: float = 1.0, base_size: float | None = None) -> torch.Tensor:
    """Fixed 2D sin-cos positions [h*w, dim] of one frame (Open-Sora STDiT3): half of dim for the column, half
    for the row. Positions are patch indices / scale, stretched to a base_size x base_size grid when given
    (Open-Sora: scale = sqrt(pixel height x width) / 512, base_size = round(sqrt(h w)))."""
    if dim % 4:
        raise ValueError(f"sin-cos 2D positions need hidden_size divisible by 4, got {dim}")
    gh = torch.arange(h, dtype=torch.float64) / scale * (base_size / h if base_size else 1.0)
    gw = torch.arange(w, dtype=torch.float64) / scale * (base_size / w if base_size else 1.0)
    grid_h, grid_w = torch.meshgrid(gh, gw, indexing="ij")
    return torch.cat([_sincos_1d(dim // 2, grid_w.flatten()), _sincos_1d(dim // 2, grid_h.flatten())], 1).float()


def rope_1d(head_dim: int, n: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """1D rotary frequencies for positions 0..n-1 (STDiT3's temporal attention): cos, sin of shape [n, head_dim],
    channel pairs (2i, 2i+1) rotating at theta^(-2i/head_dim), as rotary-embedding-torch does."""
    if head_dim % 2:
        raise ValueError(f"rotary positions need an even head_dim, got {head_dim}")
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv).repeat_interleave(2, dim=1)  # (n, head_dim)
    return freqs.cos().float(), freqs.sin().float()


def rope_3d(head_dim: int, t: int, h: int, w: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """3D rotary frequencies for (t, h, w) tokens: cos, sin of shape [t*h*w, head_dim].

    head_dim is split 1/4 time, 3/8 height, 3/8 width (CogVideoX-5B); each pair of channels rotates.
    """
    dim_t, dim_h = head_dim // 4, head_dim // 8 * 3
    dim_w = head_dim - dim_t - dim_h
    if min(dim_t, dim_h, dim_w) % 2:
        raise ValueError(f"3D rotary positions need head_dim divisible by 16, got {head_dim}")

    def axis(dim: int, n: int) -> torch.Tensor:
        inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        return torch.outer(torch.arange(n, dtype=torch.float64), inv).repeat_interleave(2, dim=1)  # (n, dim)

    ft, fh, fw = axis(dim_t, t), axis(dim_h, h), axis(dim_w, w)
    freqs = torch.cat([ft[:, None, None].expand(t, h, w, dim_t), fh[None, :, None].expand(t, h, w, dim_h),
                       fw[None, None].expand(t, h, w, dim_w)], dim=-1).reshape(t * h * w, head_dim)
    return freqs.cos().float(), freqs.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin); x: [B, heads, S, D]."""
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-x1, x0], dim=-1).flatten(-2)
    return (x.float() * cos + rotated * sin).to(x.dtype)
