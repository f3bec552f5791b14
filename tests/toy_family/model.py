"""A tiny video DiT with two traits no built-in family has: a timestep per token, and two experts chosen by
timestep (FamilySpec.experts: tokens at t >= 500 use the high-noise expert's MLP, the others the low-noise
one's). It exists to prove that a family defined outside models/ runs through every command.

Between stages flow

    x       [B, S, H]   video tokens (t, h, w order; S / sp of them under sequence parallelism)
    temb    [B, S, H]   each token's timestep embedding
    expert  [B, S]      each token's expert (int64: 0 high noise, 1 low noise; no gradient, as DeepSpeed allows)
    y       [B, L, H]   projected text tokens

A layer: mod = W_ada temb (per token, [B, S, 6H]);
    x = x + gate_msa * SelfAttn(LN(x) (1 + scale_msa) + shift_msa)      full 3D attention, 3D sin-cos added at embed
    x = x + CrossAttn(x, y)
    x = x + gate_mlp * MoE-MLP(LN(x) (1 + scale_mlp) + shift_mlp)

The two experts' MLPs are one column-parallel W_in [2F, H] and one row-parallel W_out [H, 2F]: expert e owns
inner columns [e F, (e + 1) F); a token's inner activations of the other expert are zeroed before W_out, so
MoE-MLP(h) = W_out,e gelu(W_in,e h) + b with one all-reduce under tensor parallelism (the row-parallel
output), as a dense MLP. Timesteps: [B] (validation, sampling) or [B, T, H, W] (training, constant within
a patch) are read per token at each patch's first latent position.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from models.embeddings import sincos_3d, timestep_embedding
from models.geometry import PositionCache, patchify, unpatchify
from parallel.distributed.layers import ColumnParallelLinear, RowParallelLinear
from parallel.distributed.sequence import SequenceAttention, gather_sequence, sp_size_of, split_sequence
from tests.toy_family.config import ToyConfig


def token_timesteps(timesteps: torch.Tensor, cfg: ToyConfig, grid) -> torch.Tensor:
    """[B] or [B, T, H, W] -> [B, S]: each patch's timestep (S = t h w in (t, h, w) order)."""
    b, (t, h, w) = timesteps.shape[0], tuple(grid)
    if timesteps.dim() == 1:
        return timesteps[:, None].expand(b, t * h * w)
    p, pt = cfg.patch_size, cfg.patch_size_t
    return timesteps[:, ::pt, ::p, ::p].reshape(b, t * h * w)


class EmbedStage(nn.Module):
    """(latents [B,C,T,H,W], timesteps [B] or [B,T,H,W], text [B,L,D]) -> (x, temb, expert, y)."""

    def __init__(self, cfg: ToyConfig, grid, ctx=None):
        super().__init__()
        self.cfg, self.grid, self.ctx = cfg, grid, ctx
        p, pt, hid = cfg.patch_size, cfg.patch_size_t, cfg.hidden_size
        self.x_embedder = nn.Linear(cfg.in_channels * pt * p * p, hid)
        self.t_embedder = nn.Sequential(nn.Linear(cfg.time_embed_dim, hid), nn.SiLU(), nn.Linear(hid, hid))
        self.y_embedder = nn.Linear(cfg.text_embed_dim, hid)
        self._pos = PositionCache(functools.partial(sincos_3d, hid))

    def forward(self, inputs):
        from models.registry import FAMILIES

        latents, timesteps, text = inputs
        dtype = self.x_embedder.weight.dtype
        x = self.x_embedder(patchify(latents.to(dtype), self.cfg))                     # (B, S, H)
        x = x + self._pos.get(tuple(self.grid), x.device).to(dtype)
        t = token_timesteps(timesteps, self.cfg, self.grid)                            # (B, S)
        temb = self.t_embedder(timestep_embedding(t.flatten(), self.cfg.time_embed_dim).to(dtype)).unflatten(0, t.shape)
        expert = FAMILIES[self.cfg.family].expert(t)                                   # (B, S) int64
        y = self.y_embedder(text.to(dtype))
        return (split_sequence(x, self.ctx), split_sequence(temb, self.ctx), split_sequence(expert, self.ctx), y)


def modulate(x, shift, scale):
    return x * (1 + scale) + shift


class ToyBlock(nn.Module):
    """(x, temb, expert, y) -> the same, x updated."""

    def __init__(self, cfg: ToyConfig, grid, ctx):
        super().__init__()
        hid, self.head_dim, self.grid, self.ctx = cfg.hidden_size, cfg.head_dim, grid, ctx
        self.ada = nn.Linear(hid, 6 * hid)
        self.qkv = ColumnParallelLinear(hid, [hid, hid, hid], ctx=ctx)
        self.proj = RowParallelLinear(hid, hid, ctx=ctx)
        self.core = SequenceAttention(self._attend, ctx, tokens=lambda: math.prod(self.grid))
        self.cross_q = ColumnParallelLinear(hid, hid, ctx=ctx)
        self.cross_kv = ColumnParallelLinear(hid, [hid, hid], ctx=ctx)
        self.cross_proj = RowParallelLinear(hid, hid, ctx=ctx)
        self.ffn = cfg.ffn_size
        self.mlp_in = ColumnParallelLinear(hid, 2 * cfg.ffn_size, ctx=ctx)    # [expert 0 | expert 1] inner columns
        self.mlp_out = RowParallelLinear(2 * cfg.ffn_size, hid, ctx=ctx)
        tp, rank = (ctx.tp_size, ctx.tp_rank) if ctx is not None else (1, 0)
        self.local = 2 * cfg.ffn_size // tp                # this rank's inner columns: [rank local, (rank + 1) local)
        self.offset = rank * self.local

    @staticmethod
    def _attend(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    def attn(self, h):
        q, k, v = rearrange(self.qkv(h), "b s (three n d) -> three b s n d", three=3, d=self.head_dim)
        return self.proj(rearrange(self.core(q, k, v), "b s n d -> b s (n d)"))

    def cross(self, x, y):
        q = rearrange(self.cross_q(x), "b s (n d) -> b n s d", d=self.head_dim)
        k, v = rearrange(self.cross_kv(y), "b l (two n d) -> two b n l d", two=2, d=self.head_dim)
        return self.cross_proj(rearrange(F.scaled_dot_product_attention(q, k, v), "b n s d -> b s (n d)"))

    def mlp(self, h, expert):
        """Each token through its expert's MLP: the other expert's inner columns zeroed."""
        column_expert = (torch.arange(self.local, device=h.device) + self.offset) // self.ffn     # (2F / tp,)
        keep = (column_expert == expert[..., None]).to(h.dtype)                                  # (B, S, 2F / tp)
        return self.mlp_out(F.gelu(self.mlp_in(h), approximate="tanh") * keep)

    def forward(self, inputs):
        x, temb, expert, y = inputs
        hid = x.shape[-1]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.ada(F.silu(temb)).chunk(6, dim=-1)
        x = x + gate_msa * self.attn(modulate(F.layer_norm(x, (hid,), eps=1e-6), shift_msa, scale_msa))
        x = x + self.cross(x, y)
        x = x + gate_mlp * self.mlp(modulate(F.layer_norm(x, (hid,), eps=1e-6), shift_mlp, scale_mlp), expert)
        return x, temb, expert, y


class FinalStage(nn.Module):
    """(x, temb, expert, y) -> prediction [B, C, T, H, W] (sp: this rank's patch rows; `assemble` gathers)."""

    def __init__(self, cfg: ToyConfig, grid, ctx=None):
        super().__init__()
        self.cfg, self.grid, self.ctx = cfg, grid, ctx
        p, pt, hid = cfg.patch_size, cfg.patch_size_t, cfg.hidden_size
        self.ada = nn.Linear(hid, 2 * hid)
        self.linear = nn.Linear(hid, cfg.in_channels * pt * p * p)

    def forward(self, inputs):
        x, temb, _, _ = inputs
        shift, scale = self.ada(F.silu(temb)).chunk(2, dim=-1)
        out = self.linear(modulate(F.layer_norm(x, (x.shape[-1],), eps=1e-6), shift, scale))
        return unpatchify(out, self.cfg, self.grid) if sp_size_of(self.ctx) == 1 else out

    def assemble(self, out: torch.Tensor) -> torch.Tensor:
        if sp_size_of(self.ctx) == 1:
            return out
        return unpatchify(gather_sequence(out, self.ctx, total=math.prod(self.grid)), self.cfg, self.grid)
