"""CogVideoX-style video DiT (1.0 and 1.5, text- and image-to-video) as a list of stages: embed -> blocks ->
final (names follow the paper/diffusers).

Each stage takes and returns a tuple so the same list runs sequentially (pp = 1) or split into DeepSpeed
pipeline stages (pp > 1). Between stages flow x [B, S_txt + S_vid, H] (text tokens first) and the time
embedding temb [B, D]; both receive gradients, as DeepSpeed's pipeline requires.

Tensor parallelism (ctx.tp_size = p): Q, K, V and the FFN input are column-parallel (heads and FFN
width split p ways), the attention output and FFN output are row-parallel. Everything else (patch and
text projections, time embedding, adaLN modulation, norms) is replicated and stays bitwise equal
across tp ranks, because its inputs and gradients are.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from models.cogvideox.config import CogVideoXConfig
from models.embeddings import apply_rope_complex, rope_3d_complex, sincos_3d, timestep_embedding
from models.geometry import PositionCache, patchify, unpatchify
from parallel.distributed.comm import copy_to_tp
from parallel.distributed.layers import ColumnParallelLinear, RowParallelLinear
from parallel.distributed.sequence import SequenceAttention, gather_sequence, local_range, sp_size_of, split_sequence


class EmbedStage(nn.Module):
    """(latents [B,C,T,H,W], timesteps [B], text [B,S_txt,text_dim]) -> (x [B,S,H], temb [B,D])."""

    def __init__(self, cfg: CogVideoXConfig, grid: tuple[int, int, int], ctx=None):
        super().__init__()
        self.cfg, self.grid, self.ctx = cfg, grid, ctx
        p, pt, c, hid = cfg.patch_size, cfg.patch_size_t, cfg.transformer_in_channels, cfg.hidden_size
        # = Conv3d(kernel = stride = (pt, p, p)); diffusers' temporal (1.5) patch embedding is an nn.Linear
        # that always has a bias, whatever patch_bias says (CogVideoXPatchEmbed).
        self.patch_proj = nn.Linear(c * pt * p * p, hid, bias=cfg.patch_bias or pt > 1)
        self.text_proj = nn.Linear(cfg.text_embed_dim, hid)
        self.time_linear_1 = nn.Linear(hid, cfg.time_embed_dim)
        self.time_linear_2 = nn.Linear(cfg.time_embed_dim, cfg.time_embed_dim)
        if cfg.ofs_embed_dim:                      # 1.5-I2V: emb = time embedding + MLP(sinusoid(ofs))
            self.ofs_linear_1 = nn.Linear(cfg.ofs_embed_dim, cfg.ofs_embed_dim)
            self.ofs_linear_2 = nn.Linear(cfg.ofs_embed_dim, cfg.ofs_embed_dim)
        sincos = functools.partial(sincos_3d, hid, spatial_scale=cfg.spatial_interpolation_scale,
                                   temporal_scale=cfg.temporal_interpolation_scale)
        self._pos = PositionCache(sincos) if cfg.pos_embed == "sincos" else None
        if cfg.learned_positions:
            # 5B-I2V: a stored table [1, S_txt + S_vid, H] for the sample size (text rows zero at
            # initialisation, as diffusers builds it); diffusers keeps it a (persistent) buffer, so do we.
            sample = ((cfg.sample_frames - 1) // cfg.vae_scale_temporal + 1, cfg.sample_height // p,
                      cfg.sample_width // p)
            table = torch.zeros(1, cfg.max_text_len + math.prod(sample), hid)
            table[0, cfg.max_text_len:] = sincos(*sample)
            self.register_buffer("pos_embedding", table)
            if tuple(grid) != sample:          # diffusers refuses other sizes too
                self.mismatch = (f"model.learned_positions=true holds positions for a {sample} patch grid "
                                 f"(model.sample_frames/height/width), the data gives {tuple(grid)}: set data."
                                 f"num_frames/height/width to {cfg.sample_frames} x "
                                 f"{cfg.sample_height * cfg.vae_scale_spatial} x "
                                 f"{cfg.sample_width * cfg.vae_scale_spatial}")

    def forward(self, inputs):
        latents, timesteps, text = inputs          # latents [B, C_in, T, H, W], T a multiple of patch_size_t
        dtype = self.patch_proj.weight.dtype
        video = self.patch_proj(patchify(latents.to(dtype), self.cfg))   # (B, S_vid, H)
        if self._pos is not None:
            video = video + self._pos.get(self.grid, video.device).to(dtype)
        x = torch.cat([self.text_proj(text.to(dtype)), video], dim=1)     # (B, S_txt + S_vid, H)
        if self.cfg.learned_positions:
            if hasattr(self, "mismatch"):
                raise ValueError(self.mismatch)
            x = x + self.pos_embedding.to(dtype)
        x = split_sequence(x, self.ctx)                                   # sp: this rank's S / sp tokens
        t_freq = timestep_embedding(timesteps, self.cfg.hidden_size, self.cfg.flip_sin_to_cos,
                                    self.cfg.freq_shift).to(dtype)
        temb = self.time_linear_2(F.silu(self.time_linear_1(t_freq)))    # (B, D)
        if self.cfg.ofs_embed_dim:
            # ofs = 2.0: what CogVideoXImageToVideoPipeline and CogVideo's I2V fine-tuning feed ([1], broadcast)
            ofs = timestep_embedding(torch.full((1,), 2.0, device=temb.device), self.cfg.ofs_embed_dim,
                                     self.cfg.flip_sin_to_cos, self.cfg.freq_shift).to(dtype)
            temb = temb + self.ofs_linear_2(F.silu(self.ofs_linear_1(ofs)))
        return x, temb


class AdaLayerNormZero(nn.Module):
    """LayerNorm modulated by temb separately for text and video tokens; returns gates for the residual."""

    def __init__(self, time_dim: int, hidden: int):
        super().__init__()
        self.linear = nn.Linear(time_dim, 6 * hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-5)

    def forward(self, x, temb, n_txt):
        shift, scale, gate, shift_txt, scale_txt, gate_txt = self.linear(F.silu(temb)).chunk(6, dim=1)
        h = self.norm(x)                                                   # (B, S, H)
        txt = h[:, :n_txt] * (1 + scale_txt[:, None]) + shift_txt[:, None]
        vid = h[:, n_txt:] * (1 + scale[:, None]) + shift[:, None]
        return torch.cat([txt, vid], dim=1), gate[:, None], gate_txt[:, None]


def gated(update, gate, gate_txt, n_txt):
    """Residual update with separate gates for text and video tokens."""
    return torch.cat([gate_txt * update[:, :n_txt], gate * update[:, n_txt:]], dim=1)


class Attention(nn.Module):
    """Full 3D attention over text + video tokens; heads split over tp ranks (and, inside attention, over
    sp ranks: parallel.distributed.sequence); LayerNorm on q and k."""

    def __init__(self, cfg: CogVideoXConfig, grid, ctx):
        super().__init__()
        hid, self.head_dim, self.ctx, self.grid = cfg.hidden_size, cfg.head_dim, ctx, grid
        self.n_txt = cfg.max_text_len
        self.to_qkv = ColumnParallelLinear(hid, [hid, hid, hid], ctx=ctx)
        self.to_out = RowParallelLinear(hid, hid, ctx=ctx)
        # q/k LayerNorm over head_dim, shared by all heads: each tp rank sees only its heads, so the
        # gradients of these replicated parameters are partial sums, all-reduced by copy_to_tp below.
        # k's norm bias b: without rotary positions it adds q.b to every logit of a query, which softmax
        # ignores (its exact gradient is zero and Adam would only turn round-off into updates), so it is a
        # buffer, kept for released weights. With rope3d the keys rotate after the norm and q_i.R_j b depends
        # on the key's position j: then it is a trained parameter.
        self.norm_q_weight = nn.Parameter(torch.ones(self.head_dim))
        self.norm_q_bias = nn.Parameter(torch.zeros(self.head_dim))
        self.norm_k_weight = nn.Parameter(torch.ones(self.head_dim))
        if cfg.pos_embed == "rope3d":
            self.norm_k_bias = nn.Parameter(torch.zeros(self.head_dim))
        else:
            self.register_buffer("norm_k_bias", torch.zeros(self.head_dim))
        base = (cfg.sample_height // cfg.patch_size, cfg.sample_width // cfg.patch_size)
        # complex rotations for text + video tokens, text rows 1 + 0i: one multiply rotates the whole sequence
        self._rope = PositionCache(functools.partial(rope_3d_complex, self.head_dim, base=base, grid=cfg.rope_grid,
                                                     lead=self.n_txt), grid) if cfg.pos_embed == "rope3d" else None
        self.core = SequenceAttention(ctx=ctx, tokens=self.tokens, prepare=self._prepare)

    def tokens(self) -> int:
        """Real tokens of the step's sequence (text + video), before any sp padding."""
        return self.n_txt + math.prod(self.grid.value)

    def forward(self, x):
        q, k, v = rearrange(self.to_qkv(x), "b s (three n d) -> three b s n d", three=3, d=self.head_dim)
        o = self.core(q, k, v)                                             # (B, S/sp, heads/tp, d)
        return self.to_out(o.flatten(2))                                   # (B, S/sp, H)

    def _prepare(self, q, k, v, start: int):
        """q/k LayerNorms and 3D rotary positions of tokens start.. of the sequence (text + video, no sp padding):
        [B, s, n, d] each -> [B, s, n, d] each; SequenceAttention then attends (whole sequence, or ring chunks)."""
        q, k = (t.transpose(1, 2) for t in (q, k))                       # (B, n, s, d)
        d = self.head_dim
        qk = [self.norm_q_weight, self.norm_q_bias, self.norm_k_weight]
        k_trained = isinstance(self.norm_k_bias, nn.Parameter)
        norm = copy_to_tp(torch.stack(qk + [self.norm_k_bias] if k_trained else qk), self.ctx)
        q = F.layer_norm(q, (d,), norm[0], norm[1], eps=1e-6)
        k_bias = norm[3] if k_trained else self.norm_k_bias.to(k.dtype)   # buffers stay fp32 under bf16 ZeRO
        k = F.layer_norm(k, (d,), norm[2], k_bias, eps=1e-6)
        if self._rope is not None:                                         # video tokens only (text: 1 + 0i)
            freqs = self._rope.get(self.grid, q.device)[start:start + q.shape[2]]  # (s, d/2) complex
            q, k = apply_rope_complex(q, freqs), apply_rope_complex(k, freqs)
        return q.transpose(1, 2), k.transpose(1, 2), v


class DiTBlock(nn.Module):
    """adaLN-zero -> attention -> gated residual; adaLN-zero -> GELU FFN -> gated residual."""

    def __init__(self, cfg: CogVideoXConfig, grid, ctx):
        super().__init__()
        self.cfg, self.grid, self.ctx = cfg, grid, ctx
        self.norm1 = AdaLayerNormZero(cfg.time_embed_dim, cfg.hidden_size)
        self.attn = Attention(cfg, grid, ctx)
        self.norm2 = AdaLayerNormZero(cfg.time_embed_dim, cfg.hidden_size)
        self.ff_in = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_size, ctx=ctx)
        self.ff_out = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, ctx=ctx)

    @property
    def n_txt(self) -> int:
        """Text tokens in this rank's part of the sequence (all of them without sp; sp: text comes first,
        any padding last); the grid is the step's (buckets)."""
        start, stop = local_range(self.cfg.max_text_len + math.prod(self.grid.value), self.ctx)
        return min(max(self.cfg.max_text_len - start, 0), stop - start)

    def forward(self, inputs):
        x, temb = inputs
        h, gate, gate_txt = self.norm1(x, temb, self.n_txt)
        x = x + gated(self.attn(h), gate, gate_txt, self.n_txt)
        h, gate, gate_txt = self.norm2(x, temb, self.n_txt)
        return x + gated(self.mlp(h), gate, gate_txt, self.n_txt), temb

    def mlp(self, h):
        """GELU FFN (B, S, H) -> (B, S, H); a method so that selective recomputation can wrap it."""
        return self.ff_out(F.gelu(self.ff_in(h), approximate="tanh"))


class FinalStage(nn.Module):
    """Video tokens -> LayerNorm -> adaLN (shift, scale) -> linear -> unpatchify to [B, C, T, H, W]."""

    def __init__(self, cfg: CogVideoXConfig, grid, ctx=None):
        super().__init__()
        self.cfg, self.grid, self.ctx = cfg, grid, ctx
        p, pt = cfg.patch_size, cfg.patch_size_t
        self.norm_final = nn.LayerNorm(cfg.hidden_size, eps=1e-5)
        self.norm_out_linear = nn.Linear(cfg.time_embed_dim, 2 * cfg.hidden_size)
        self.norm_out = nn.LayerNorm(cfg.hidden_size, eps=1e-5)
        self.proj_out = nn.Linear(cfg.hidden_size, cfg.in_channels * pt * p * p)

    def forward(self, inputs):
        """[B, C, T, H, W]; with sp, this rank's S_pad / sp tokens as patches [B, S_pad/sp, C*pt*p*p], text
        and padding rows included (the loss skips them; `assemble` makes the full prediction)."""
        x, temb = inputs
        sp = sp_size_of(self.ctx)
        v = self.norm_final(x[:, self.cfg.max_text_len:] if sp == 1 else x)   # (B, S_vid, H)
        shift, scale = self.norm_out_linear(F.silu(temb)).chunk(2, dim=1)
        v = self.norm_out(v) * (1 + scale[:, None]) + shift[:, None]
        out = self.proj_out(v)
        return unpatchify(out, self.cfg, self.grid) if sp == 1 else out

    def assemble(self, out: torch.Tensor) -> torch.Tensor:
        """The full prediction [B, C, T, H, W] from forward's output on any sp rank (no gradient)."""
        if sp_size_of(self.ctx) == 1:
            return out
        tokens = self.cfg.max_text_len + math.prod(self.grid.value)                 # the padding left out
        return unpatchify(gather_sequence(out, self.ctx, total=tokens)[:, self.cfg.max_text_len:], self.cfg,
                          self.grid)
