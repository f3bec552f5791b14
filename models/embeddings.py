"""Positional and timestep embeddings of the CogVideoX and STDiT families (no parameters here except in callers).

Latent video [B, C, T, H, W] becomes T x (H/p) x (W/p) patch tokens, ordered (t, h, w). The tables are
computed as diffusers' CogVideoXTransformer3DModel and its pipeline compute them (same dtypes, same
order of operations), so released weights give the released model's outputs.
"""
from __future__ import annotations

import math

import torch


def timestep_embedding(t: torch.Tensor, dim: int, flip_sin_to_cos: bool = True, freq_shift: float = 0.0,
                       max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of (possibly fractional) timesteps: [B] -> [B, dim].

    freqs_i = exp(-ln(max_period) i / (dim/2 - freq_shift)); [cos, sin] with flip_sin_to_cos (CogVideoX),
    else [sin, cos].
    """
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device)
    args = t.float()[:, None] * torch.exp(exponent / (half - freq_shift))[None]     # (B, half)
    emb = torch.cat([torch.cos(args), torch.sin(args)] if flip_sin_to_cos else [torch.sin(args), torch.cos(args)],
                    dim=-1)
    return torch.nn.functional.pad(emb, (0, dim % 2))


def _sincos_1d(dim: int, pos: torch.Tensor) -> torch.Tensor:
    """[N] positions -> [N, dim] (sin half, cos half) in float64, as in MAE/DiT."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    out = pos.double()[:, None] * omega[None]
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)


def sincos_3d(dim: int, t: int, h: int, w: int, spatial_scale: float = 1.875,
              temporal_scale: float = 1.0) -> torch.Tensor:
    """Fixed 3D sin-cos positions [t*h*w, dim]: 1/4 of dim for time, then 3/4 for (w, h) (CogVideoX-2B).

    Positions are divided by the interpolation scales (in float32, as diffusers does); text tokens get none.
    """
    if dim % 16:
        raise ValueError(f"sin-cos 3D positions need hidden_size divisible by 16, got {dim}")
    dim_s, dim_t = dim // 4 * 3, dim // 4
    gh = torch.arange(h, dtype=torch.float32) / spatial_scale
    gw = torch.arange(w, dtype=torch.float32) / spatial_scale
    grid_h, grid_w = torch.meshgrid(gh, gw, indexing="ij")
    spatial = torch.cat([_sincos_1d(dim_s // 2, grid_w.flatten()), _sincos_1d(dim_s // 2, grid_h.flatten())], 1)
    temporal = _sincos_1d(dim_t, torch.arange(t, dtype=torch.float32) / temporal_scale)   # (t, dim_t)
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


def resize_crop_region(grid: tuple[int, int], base: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """((top, left), (bottom, right)): the (h, w) patch grid resized to fit the base grid, centred.

    base is the (height, width) patch grid the model was trained at (sample size / patch size); a grid of
    another aspect ratio gets fractional rotary positions inside it (CogVideoX's get_resize_crop_region_for_grid).
    """
    (h, w), (th, tw) = grid, base
    if h / w > th / tw:
        rh, rw = th, int(round(th / h * w))
    else:
        rw, rh = tw, int(round(tw / w * h))
    top, left = int(round((th - rh) / 2.0)), int(round((tw - rw) / 2.0))
    return (top, left), (top + rh, left + rw)


def _rope_1d(dim: int, pos: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, dim] of positions [N]; each frequency repeated for its channel pair (float32)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))   # (dim/2,)
    freqs = torch.outer(pos, inv)
    return freqs.cos().repeat_interleave(2, dim=1), freqs.sin().repeat_interleave(2, dim=1)


def rope_3d(head_dim: int, t: int, h: int, w: int, base: tuple[int, int] | None = None,
            theta: float = 10000.0, grid: str = "linspace") -> tuple[torch.Tensor, torch.Tensor]:
    """3D rotary frequencies for (t, h, w) tokens: cos, sin of shape [t*h*w, head_dim] (CogVideoX-5B).

    head_dim is split 1/4 time, 3/8 height, 3/8 width; each pair of channels rotates. Spatial positions
    span the grid's crop region inside `base` (the model's (h, w) patch grid; default: the grid itself):
    h positions evenly from top to bottom (h-1)/h, likewise w. grid="slice" (CogVideoX 1.5, diffusers'
    grid_type="slice" with max_size=base): integer positions 0..h-1, 0..w-1, 0..t-1, the grid within `base`.
    """
    dim_t, dim_h = head_dim // 4, head_dim // 8 * 3
    if head_dim % 16:
        raise ValueError(f"3D rotary positions need head_dim divisible by 16, got {head_dim}")
    if grid == "slice":
        if base is not None and (h > base[0] or w > base[1]):
            raise ValueError(f"a {h} x {w} patch grid exceeds the rotary table's {base[0]} x {base[1]} "
                             f"(model.sample_height/width divided by model.patch_size)")
        grid_h, grid_w, grid_t = (torch.arange(n, dtype=torch.float32) for n in (h, w, t))
    else:
        (top, left), (bottom, right) = resize_crop_region((h, w), base or (h, w))
        grid_h = torch.linspace(top, bottom * (h - 1) / h, h, dtype=torch.float32)
        grid_w = torch.linspace(left, right * (w - 1) / w, w, dtype=torch.float32)
        grid_t = torch.linspace(0, t * (t - 1) / t, t, dtype=torch.float32)
    tables = [_rope_1d(dim_t, grid_t, theta), _rope_1d(dim_h, grid_h, theta), _rope_1d(dim_h, grid_w, theta)]

    def combine(ft, fh, fw):
        return torch.cat([ft[:, None, None].expand(t, h, w, dim_t), fh[None, :, None].expand(t, h, w, dim_h),
                          fw[None, None].expand(t, h, w, dim_h)], dim=-1).reshape(t * h * w, head_dim)
    return combine(*(c for c, _ in tables)).float(), combine(*(s for _, s in tables)).float()


def rope_3d_complex(head_dim: int, t: int, h: int, w: int, base: tuple[int, int] | None = None,
                    grid: str = "linspace", lead: int = 0) -> torch.Tensor:
    """rope_3d as complex rotations [lead + t*h*w, head_dim/2] (rope_complex), `lead` text rows unrotated."""
    return rope_complex(*rope_3d(head_dim, t, h, w, base=base, grid=grid), lead=lead)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin); x: [B, heads, S, D]."""
    return apply_rope_complex(x, rope_complex(cos, sin))


def rope_complex(cos: torch.Tensor, sin: torch.Tensor, lead: int = 0) -> torch.Tensor:
    """The rotation as one complex number per channel pair: [lead + S, D/2] = cos + i sin of each pair (the
    tables repeat every frequency for its pair), after `lead` rows of 1 + 0i (tokens that do not rotate:
    CogVideoX's text, which comes first; multiplying by 1 + 0i is exact)."""
    table = torch.complex(cos[..., 0::2].float(), sin[..., 0::2].float())         # (S, D/2)
    return torch.cat([table.new_ones(lead, table.shape[-1]), table]) if lead else table


def apply_rope_complex(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """apply_rope as (x0 + i x1)(cos + i sin): one complex multiply over x [B, heads, S, D] viewed as
    [B, heads, S, D/2] complex, instead of a negated, stacked copy and two real products (forward and backward).

    Works on strided views (a head slice of a fused QKV output) whose pairs are adjacent; returns a contiguous
    [B, heads, S, D] in x's dtype (computed in fp32)."""
    dtype, x = x.dtype, x.float()
    if torch.compiler.is_compiling():
        # the same products as real pairs: inductor generates no code for complex operators (it calls eager kernels
        # for them, unfused, and its backward's view_as_complex needs a layout the compiler need not give); as
        # pairs the rotation fuses with what surrounds it (the q/k norm, the casts). Dynamo cannot trace the
        # storage_offset() check below either (a graph break a block).
        x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)                                    # (B, n, S, D/2) each
        cos, sin = freqs.real, freqs.imag
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2).to(dtype)
    if x.stride(-1) != 1 or x.storage_offset() % 2 or any(s % 2 for s in x.stride()[:-1]):
        x = x.contiguous()
    out = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * freqs)   # (B, n, S, D/2, 2)
    return out.flatten(-2).to(dtype)
