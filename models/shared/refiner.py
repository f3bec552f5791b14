"""The token refiner HunyuanVideo and HunyuanVideo 1.5 run on their text states before the blocks, and the
two-linear MLP their time and text embedders are (diffusers' TimestepEmbedding, PixArtAlphaTextProjection).

The refiner block: x + g_a Attn(LN(x)), then x + g_m FFN_silu(LN(x)), the gates from its own temb. It runs on the
L text tokens before the sequence is split, replicated over tp and sp ranks (the family's embed.py builds it).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig

EPS = 1e-6


class MLP(nn.Module):
    """linear_1 -> SiLU -> linear_2 (diffusers' TimestepEmbedding and PixArtAlphaTextProjection(act silu))."""

    def __init__(self, d_in: int, hidden: int):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(d_in, hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.linear_2(F.silu(self.linear_1(x)))


class RefinerBlock(nn.Module):
    """HunyuanVideoIndividualTokenRefinerBlock without a mask: every text row attends to every other."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hid, self.head_dim = cfg.hidden_size, cfg.head_dim
        self.norm1 = nn.LayerNorm(hid, eps=EPS)
        self.to_qkv = nn.Linear(hid, 3 * hid)                          # diffusers' attn.to_{q,k,v}, rows fused
        self.to_out = nn.Linear(hid, hid)
        self.norm2 = nn.LayerNorm(hid, eps=EPS)
        self.ff_in, self.ff_out = nn.Linear(hid, 4 * hid), nn.Linear(4 * hid, hid)
        self.norm_out = nn.Linear(hid, 2 * hid)                        # gate_msa, gate_mlp

    def forward(self, x, temb, mask):
        """x [B, L, H], temb [B, H], mask [B, 1, L, L] (query i may attend to key j)."""
        gate_msa, gate_mlp = self.norm_out(F.silu(temb))[:, None].chunk(2, dim=-1)        # (B, 1, H) each
        q, k, v = self.to_qkv(self.norm1(x)).unflatten(-1, (3, -1, self.head_dim)).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)   # (B, L, H)
        x = x + self.to_out(o) * gate_msa
        return x + self.ff_out(F.silu(self.ff_in(self.norm2(x)))) * gate_mlp
