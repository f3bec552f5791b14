"""HunyuanVideo 1.5's first stage: patch and time embeddings, and the three text encoders' rows as context tokens.
Names follow diffusers' HunyuanVideo15Transformer3DModel; the layers and the last stage are HunyuanVideo's
(models/shared/mmdit.py: every block dual-stream, the same adaLN-continuous head).

    temb  = MLP_t(sinusoid(t))                                                        [B, H]
    qwen  = refiner(proj_in(qwen), MLP_t'(sinusoid(t)) + MLP_txt(mean_real qwen)) + e_0   [B, Lq, H]
    glyph = Lin GELU Lin GELU Lin (LN(byt5)) + e_1           (hidden 2048, diffusers' fixed width)
    image = LN(Lin GELU Lin (LN(siglip))) + e_2                                       [B, I, H]
    x     = [image; glyph; qwen; patch([noisy; condition; mask])]                   [B, L + S_vid, H]

e_k: cond_type_embed row k. Padding rows (all-zero input channels, as the pipelines' masks) are zero and no key
in the blocks' attention (the mask travels as temb's last L channels, models/shared/mmdit.py); diffusers
moves them behind the real rows, which changes nothing, since text tokens carry no position. Diffusers decides
text-to-video (image rows masked) for the whole batch when every image state is zero; here a sample whose image
rows are zero: the same for any batch the pipelines make (one kind per call).

Latents of in_channels channels (text-to-video training) get the pipeline's zero condition and mask appended.
The refiner runs on the Qwen rows before the sequence is split, replicated over tp and sp ranks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.embeddings import timestep_embedding
from models.geometry import patchify
from models.hunyuanvideo15.config import HunyuanVideo15Config
from models.shared.refiner import MLP, RefinerBlock
from parallel.distributed.sequence import split_sequence

GLYPH_HIDDEN = 2048                 # HunyuanVideo15ByT5TextProjection's hidden width, fixed in diffusers


class EmbedStage(nn.Module):
    """(latents [B, C or 2C+1, T, H, W], timesteps [B], text [B, L, D]) -> (x [B, L + S_vid, H] (sp: this rank's
    chunk), temb [B, H + L]: the time embedding, then the text mask)."""

    def __init__(self, cfg: HunyuanVideo15Config, grid, ctx=None):
        super().__init__()
        self.cfg, self.grid, self.ctx = cfg, grid, ctx
        p, pt, hid, f = cfg.patch_size, cfg.patch_size_t, cfg.hidden_size, cfg.time_embed_dim
        self.patch_proj = nn.Linear(cfg.transformer_in_channels * pt * p * p, hid)   # = Conv3d(kernel = stride)
        self.timestep_embedder = MLP(f, hid)
        self.refiner_timestep_embedder = MLP(f, hid)
        self.refiner_text_embedder = MLP(cfg.text_embed_dim, hid)
        self.refiner_proj_in = nn.Linear(cfg.text_embed_dim, hid)
        self.refiner = nn.ModuleList(RefinerBlock(cfg) for _ in range(cfg.num_refiner_layers))
        self.glyph_norm = nn.LayerNorm(cfg.glyph_dim)                    # eps 1e-5, as nn.LayerNorm's default
        self.glyph_linear_1 = nn.Linear(cfg.glyph_dim, GLYPH_HIDDEN)
        self.glyph_linear_2 = nn.Linear(GLYPH_HIDDEN, GLYPH_HIDDEN)
        self.glyph_linear_3 = nn.Linear(GLYPH_HIDDEN, hid)
        self.image_norm_in = nn.LayerNorm(cfg.image_dim)
        self.image_linear_1 = nn.Linear(cfg.image_dim, cfg.image_dim)
        self.image_linear_2 = nn.Linear(cfg.image_dim, hid)
        self.image_norm_out = nn.LayerNorm(hid)
        self.cond_type_embed = nn.Embedding(3, hid)                      # rows: Qwen, byT5, image

    def forward(self, inputs):
        latents, timesteps, text = inputs
        dtype, cfg = self.patch_proj.weight.dtype, self.cfg
        if latents.shape[1] == cfg.in_channels:                          # text-to-video: zero condition and mask
            b, c, t, h, w = latents.shape
            latents = torch.cat([latents, latents.new_zeros(b, c + 1, t, h, w)], dim=1)
        image, glyph, qwen = text.to(dtype).split([cfg.image_len, cfg.glyph_len, cfg.qwen_len], dim=1)
        image, glyph = image[..., :cfg.image_dim], glyph[..., :cfg.glyph_dim]
        keep = torch.cat([rows.ne(0).any(dim=-1) for rows in (image, glyph, qwen)], dim=1)   # (B, L) real rows
        t_freq = timestep_embedding(timesteps, cfg.time_embed_dim).to(dtype)              # [cos, sin], as Timesteps
        temb = self.timestep_embedder(t_freq)
        real_qwen = keep[:, cfg.image_len + cfg.glyph_len:]                               # (B, Lq)
        real = real_qwen.to(dtype)[..., None]
        mean = (qwen * real).sum(dim=1) / real.sum(dim=1).clamp(min=1)                    # caption with no row: 0
        r_temb = self.refiner_timestep_embedder(t_freq) + self.refiner_text_embedder(mean)
        # A real row attends to the real rows (diffusers' mask AND its transpose: a padding row's own output is
        # zeroed below); a caption with no real row attends to all, so that no row is fully masked.
        keys = (real_qwen | ~real_qwen.any(dim=-1, keepdim=True))[:, None, None, :]       # (B, 1, 1, Lq)
        y = self.refiner_proj_in(qwen)                                                    # (B, Lq, H)
        for block in self.refiner:
            y = block(y, r_temb, keys)
        e = self.cond_type_embed.weight                                                   # (3, H)
        context = torch.cat([self.image_proj(image) + e[2], self.glyph_proj(glyph) + e[1], y + e[0]], dim=1)
        context = torch.where(keep[..., None], context, torch.zeros((), dtype=context.dtype, device=context.device))
        video = self.patch_proj(patchify(latents.to(dtype), cfg))                        # (B, S_vid, H)
        return split_sequence(torch.cat([context, video], dim=1), self.ctx), torch.cat([temb, keep.to(dtype)], dim=1)

    def glyph_proj(self, glyph):
        """byT5 states [B, G, glyph_dim] -> [B, G, H] (diffusers' HunyuanVideo15ByT5TextProjection, exact GELU)."""
        h = F.gelu(self.glyph_linear_1(self.glyph_norm(glyph)))
        return self.glyph_linear_3(F.gelu(self.glyph_linear_2(h)))

    def image_proj(self, image):
        """SigLIP states [B, I, image_dim] -> [B, I, H] (diffusers' HunyuanVideo15ImageProjection)."""
        return self.image_norm_out(self.image_linear_2(F.gelu(self.image_linear_1(self.image_norm_in(image)))))
