"""HunyuanVideo's first stage: patch, time / guidance / CLIP and token-refined text embeddings in (the
adaLN-continuous head out is models/shared/mmdit.py's FinalStage; the refiner block and the MLP,
models/shared/refiner.py). Names follow diffusers' HunyuanVideoTransformer3DModel.

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

import torch
from torch import nn

from models.embeddings import timestep_embedding
from models.geometry import patchify
from models.hunyuanvideo.config import EMBEDDED_GUIDANCE, HunyuanVideoConfig
from models.shared.refiner import MLP, RefinerBlock
from parallel.distributed.sequence import split_sequence


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
