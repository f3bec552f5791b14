"""HunyuanVideo's first and last stages: patch, time / guidance / CLIP and token-refined text embeddings in;
the adaLN-continuous head out. Names follow diffusers' HunyuanVideoTransformer3DModel.

    temb = MLP_t(sinusoid(t)) + MLP_g(sinusoid(1000 g)) + MLP_clip(pooled)           [B, H]
    text = refiner(proj_in(llama), MLP_t'(sinusoid(t)) + MLP_txt(mean_real llama))   [B, L, H]
    x    = [text; patch(latents)]                                                   [B, L + S_vid, H]

The text mask, as HunyuanVideoPipeline's prompt_attention_mask: a row is real unless its LLaMA channels
are all zero (the data path zeroes the padding). The refiner averages the real rows, and row i attends to
row j when both are real, and to row 0 always (diffusers' rule); the blocks' attention skips padding keys.
The mask travels beside temb, as the last L channels of the stage tensor temb [B, H + L] (1.0 real, 0.0
padding), so the stage tuple stays (x, temb) and every pipeline stage sees it.

The refiner (2 blocks): x + g_a Attn(LN(x)), then x + g_m FFN_silu(LN(x)), the gates from its own temb.
It runs on the L text tokens before the sequence is split, replicated over tp and sp ranks (2% of the
13B's parameters; its S = L attention is small beside the blocks').

Open-Sora 2.0's switches (docs/models.md): model.num_refiner_layers 0 (text = txt_in(T5), one linear: diffusers'
proj_in with no refiner blocks), model.guidance_embed false (temb without the guidance term), model.text_mask
false (every text row a key), model.cond_embed (temb unchanged; x += cond_in(zero condition)).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.embeddings import timestep_embedding
from models.geometry import patchify, unpatchify
from models.hunyuanvideo.config import EMBEDDED_GUIDANCE, HunyuanVideoConfig
from parallel.distributed.sequence import gather_sequence, sp_size_of, split_sequence

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

    def __init__(self, cfg: HunyuanVideoConfig):
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


class EmbedStage(nn.Module):
    """(latents [B,C,T,H,W], timesteps [B], text [B,L,llama+pooled]) -> (x [B, L + S_vid, H] (sp: this rank's
    chunk), temb [B, H + L]: the time embedding, then the text mask)."""

    def __init__(self, cfg: HunyuanVideoConfig, grid, ctx=None):
        super().__init__()
        self.cfg, self.grid, self.ctx = cfg, grid, ctx
        p, pt, c, hid, f = cfg.patch_size, cfg.patch_size_t, cfg.in_channels, cfg.hidden_size, cfg.time_embed_dim
        self.patch_proj = nn.Linear(c * pt * p * p, hid)                 # = Conv3d(kernel = stride = (pt, p, p))
        if cfg.cond_embed:                                               # Open-Sora 2.0's cond_in
            self.cond_proj = nn.Linear((c + 1) * pt * p * p, hid)
        self.timestep_embedder = MLP(f, hid)
        if cfg.guidance_embed:
            self.guidance_embedder = MLP(f, hid)
        self.pooled_embedder = MLP(cfg.pooled_projection_dim, hid)
        if cfg.num_refiner_layers:
            self.refiner_timestep_embedder = MLP(f, hid)
            self.refiner_text_embedder = MLP(cfg.llama_dim, hid)
        self.refiner_proj_in = nn.Linear(cfg.llama_dim, hid)              # Open-Sora 2.0's txt_in
        self.refiner = nn.ModuleList(RefinerBlock(cfg) for _ in range(cfg.num_refiner_layers))

    def forward(self, inputs):
        latents, timesteps, text = inputs
        dtype, cfg = self.patch_proj.weight.dtype, self.cfg
        llama, pooled = text.to(dtype).split([cfg.llama_dim, cfg.pooled_projection_dim], dim=-1)
        t_freq = timestep_embedding(timesteps, cfg.time_embed_dim).to(dtype)              # [cos, sin], as Timesteps
        temb = self.timestep_embedder(t_freq)                                             # + guidance + pooled,
        if cfg.guidance_embed:                                                            # diffusers' order
            guidance = torch.full_like(timesteps, EMBEDDED_GUIDANCE * 1000.0, dtype=torch.float32)
            temb = temb + self.guidance_embedder(timestep_embedding(guidance, cfg.time_embed_dim).to(dtype))
        temb = temb + self.pooled_embedder(pooled[:, 0])
        keep = llama.ne(0).any(dim=-1) if cfg.text_mask else \
            torch.ones(llama.shape[:2], dtype=torch.bool, device=llama.device)            # (B, L) key rows
        y = self.refiner_proj_in(llama)                                                   # (B, L, H)
        if cfg.num_refiner_layers:
            real = keep.to(dtype)[..., None]
            mean = (llama * real).sum(dim=1) / real.sum(dim=1).clamp(min=1)               # caption with no row: 0
            r_temb = self.refiner_timestep_embedder(t_freq) + self.refiner_text_embedder(mean)
            pairs = keep[:, None, :, None] & keep[:, None, None, :]                      # (B, 1, L, L)
            pairs[..., 0] = True
            for block in self.refiner:
                y = block(y, r_temb, pairs)
        video = patchify(latents.to(dtype), cfg)                                          # (B, S_vid, C pt p q)
        x = self.patch_proj(video)                                                        # (B, S_vid, H)
        if cfg.cond_embed:
            # text-to-video: Open-Sora's zero condition (mask and latents), patched as the video: adds the bias,
            # and cond_proj.weight stays in the graph (a zero gradient, not none)
            x = x + self.cond_proj(video.new_zeros(*video.shape[:2], self.cond_proj.in_features))
        return split_sequence(torch.cat([y, x], dim=1), self.ctx), torch.cat([temb, keep.to(dtype)], dim=1)


class FinalStage(nn.Module):
    """Video tokens -> LayerNorm * (1 + scale) + shift (from temb) -> proj_out -> unpatchify [B, C, T, H, W];
    with sp, this rank's tokens as patches [B, S_pad/sp, C*pt*p*p] (`assemble` makes the full prediction)."""

    def __init__(self, cfg: HunyuanVideoConfig, grid, ctx=None):
        super().__init__()
        self.cfg, self.grid, self.ctx = cfg, grid, ctx
        hid, p, pt = cfg.hidden_size, cfg.patch_size, cfg.patch_size_t
        self.norm_out_linear = nn.Linear(hid, 2 * hid)                    # AdaLayerNormContinuous: scale, shift
        self.proj_out = nn.Linear(hid, cfg.in_channels * pt * p * p)     # rows in (c, pt, p, q) order, as patchify

    def forward(self, inputs):
        x, temb = inputs
        temb, sp = temb[:, :x.shape[-1]], sp_size_of(self.ctx)                          # the mask left out
        v = x[:, self.cfg.max_text_len:] if sp == 1 else x                # (B, S_vid, H)
        scale, shift = self.norm_out_linear(F.silu(temb))[:, None].chunk(2, dim=-1)
        out = self.proj_out(F.layer_norm(v, (v.shape[-1],), eps=EPS) * (1 + scale) + shift)
        return unpatchify(out, self.cfg, self.grid) if sp == 1 else out

    def assemble(self, out: torch.Tensor) -> torch.Tensor:
        """The full prediction [B, C, T, H, W] from forward's output on any sp rank (no gradient)."""
        if sp_size_of(self.ctx) == 1:
            return out
        tokens = self.cfg.max_text_len + math.prod(self.grid.value)
        return unpatchify(gather_sequence(out, self.ctx, total=tokens)[:, self.cfg.max_text_len:], self.cfg,
                          self.grid)
