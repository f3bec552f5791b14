"""Open-Sora STDiT3-style video DiT (Open-Sora 1.2/1.3) as a list of stages: embed -> layers -> final.

One pipeline layer (`STDiT3Layer`) is one spatial block followed by one temporal block, so
`model.num_layers: 28` is Open-Sora's depth 28 (28 spatial + 28 temporal blocks). Between stages flow

    x      [B, S, H]   video tokens, S = T*h*w in (t, h, w) order (no text tokens in the sequence)
    t      [B, H]      timestep embedding (the final layer's modulation)
    t_mlp  [B, 6H]     t_block(t), every block's modulation (Open-Sora's `t_mlp`)
    y      [B, L, H]   projected caption tokens, the keys and values of every cross-attention

and all four receive gradients, as DeepSpeed's pipeline requires. A block (names follow Open-Sora):

    shift, scale, gate (msa and mlp) = scale_shift_table [6, H] + t_mlp
    x = x + gate_msa * SelfAttn(LN(x) * (1 + scale_msa) + shift_msa)     spatial: within a frame
                                                                          temporal: one (h, w) across frames
    x = x + CrossAttn(x, y)                                               every token attends to the text
    x = x + gate_mlp * MLP(LN(x) * (1 + scale_mlp) + shift_mlp)           GELU (tanh), 4x

Positions: a fixed 2D sin-cos table added to every frame's tokens in the embed stage, and 1D rotary
positions over frames inside temporal attention (`model.pos_embed: sincos2d_rope1d`). Open-Sora's fps
embedding, caption dropout (its learned null caption) and zero initialisation of output layers are not
reproduced: unconditional sampling uses a zero text embedding, as for the CogVideoX family.

Tensor parallelism (ctx.tp_size = p): self-attention QKV, cross-attention Q and KV and the MLP input
are column-parallel (heads and MLP width split p ways); the three output projections are row-parallel.

Sequence parallelism: everything but self-attention works token by token, so it runs on any contiguous
chunk of x. Self-attention projects q, k, v to [B, S, n, d] and calls `SequenceAttention`, whose
`_attend` sees the full sequence (the whole token grid, any sp padding sliced off) for its heads and
regroups it into frames or into per-position time series itself (Ulysses). Under ring attention each ring
rank holds whole frames (the checker asks ring_size to divide the latent frames and sp the tokens):
spatial attention is local to the chunk, and temporal attention is ring attention over the frames with the
b x h x w positions as its batch (`_ring`).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from models.embeddings import apply_rope, rope_1d, sincos_2d, timestep_embedding
from models.geometry import PositionCache, frames_key, patchify, unpatchify
from models.stdit.config import STDiTConfig
from parallel.distributed.comm import copy_to_tp
from parallel.distributed.layers import ColumnParallelLinear, RowParallelLinear
from parallel.distributed.sequence import SequenceAttention, gather_sequence, sp_size_of, split_sequence

INPUT_SQ_SIZE = 512         # Open-Sora: sin-cos positions are scaled by sqrt(pixel height x width) / 512


def frame_positions(dim: int, h: int, w: int, scale: float) -> torch.Tensor:
    """Open-Sora's 2D sin-cos table of one frame's h x w patches, stretched to a square of the same area."""
    return sincos_2d(dim, h, w, scale, base_size=round(math.sqrt(h * w)))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Open-Sora's t2i_modulate: x (B, S, H), shift and scale (B, 1, H)."""
    return x * (1 + scale) + shift


class EmbedStage(nn.Module):
    """(latents [B,C,T,H,W], timesteps [B], text [B,L,text_dim]) -> (x [B,S,H], t [B,H], t_mlp [B,6H], y [B,L,H])."""

    def __init__(self, cfg: STDiTConfig, grid: tuple[int, int, int], ctx=None):
        super().__init__()
        self.cfg, self.grid, self.ctx = cfg, grid, ctx
        p, pt, c, hid = cfg.patch_size, cfg.patch_size_t, cfg.in_channels, cfg.hidden_size
        self.x_embedder = nn.Linear(c * pt * p * p, hid)               # = Conv3d(kernel = stride = (pt, p, p))
        self.t_embedder = nn.Sequential(nn.Linear(cfg.time_embed_dim, hid), nn.SiLU(), nn.Linear(hid, hid))
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(hid, 6 * hid))
        self.y_embedder = nn.Sequential(nn.Linear(cfg.text_embed_dim, hid), nn.GELU(approximate="tanh"),
                                        nn.Linear(hid, hid))
        self._pos = PositionCache(functools.partial(frame_positions, hid))

    def forward(self, inputs):
        latents, timesteps, text = inputs
        dtype = self.x_embedder.weight.dtype
        t_, h, w = self.grid
        tokens = patchify(latents.to(dtype), self.cfg)
        scale = math.sqrt(h * w) * self.cfg.patch_size * self.cfg.vae_scale_spatial / INPUT_SQ_SIZE  # pixel h x w
        pos = self._pos.get((h, w, scale), tokens.device).to(dtype)                # (h*w, H), every frame
        x = (self.x_embedder(tokens).unflatten(1, (t_, h * w)) + pos).flatten(1, 2)  # (B, S, H)
        x = split_sequence(x, self.ctx)                                             # sp: this rank's S / sp
        t = self.t_embedder(timestep_embedding(timesteps, self.cfg.time_embed_dim).to(dtype))  # (B, H)
        t_mlp = self.t_block(t)                                                     # (B, 6H)
        y = self.y_embedder(text.to(dtype))                                         # (B, L, H)
        return x, t, t_mlp, y


class SelfAttention(nn.Module):
    """Spatial (tokens of one frame) or temporal (one (h, w) position across frames) attention.

    Heads split over tp ranks; RMSNorm on q and k over head_dim; temporal attention rotates q and k by
    their frame index (1D rotary). `forward` is per token apart from `_attend`, which gets the full
    sequence [B, S, n, d] (through Ulysses when sp_size > 1).
    """

    def __init__(self, cfg: STDiTConfig, grid, ctx, temporal: bool):
        super().__init__()
        hid, self.head_dim, self.grid, self.ctx, self.temporal = cfg.hidden_size, cfg.head_dim, grid, ctx, temporal
        self.qkv = ColumnParallelLinear(hid, [hid, hid, hid], ctx=ctx)
        self.proj = RowParallelLinear(hid, hid, ctx=ctx)
        # Shared by all heads, so each tp rank's gradient is a partial sum: all-reduced by copy_to_tp.
        self.q_norm_weight = nn.Parameter(torch.ones(self.head_dim))
        self.k_norm_weight = nn.Parameter(torch.ones(self.head_dim))
        self._rope = PositionCache(functools.partial(rope_1d, self.head_dim), grid, frames_key) if temporal \
            else None
        self.core = SequenceAttention(self._attend, ctx, tokens=self.tokens, chunk=self._ring)

    def tokens(self) -> int:
        """Tokens of the step's grid, before any sp padding."""
        return math.prod(self.grid.value)

    def forward(self, x):
        q, k, v = rearrange(self.qkv(x), "b s (three n d) -> three b s n d", three=3, d=self.head_dim)
        o = self.core(q, k, v)                                                    # (B, S, heads/p, d)
        return self.proj(rearrange(o, "b s n d -> b s (n d)"))                    # (B, S, H)

    def _attend(self, q, k, v):
        """[B, S, n, d] over the whole (t, h, w) grid (exactly t*h*w tokens: no sp padding) -> [B, S, n, d]."""
        return self._regrouped(q, k, v, 0, F.scaled_dot_product_attention)

    def _ring(self, q, k, v, start: int, ring):
        """This ring rank's whole frames, tokens start.. of the grid, [B, f*h*w, n, d] -> same: spatial attention
        stays inside the chunk (a frame is never split), temporal attention runs `ring` (ring attention over
        every ring rank's frames, batch first) with each (h, w) position as a batch row."""
        hw = math.prod(self.grid.value[1:])
        if start % hw or q.shape[1] % hw:
            raise ValueError(f"STDiT under ring attention needs whole frames per ring chunk: tokens {start}.."
                             f"{start + q.shape[1]} of {hw}-token frames; set parallel.ring_size to a divisor of "
                             f"the latent frames with parallel.sp_size dividing the tokens (parallel/check.py)")
        if not self.temporal:
            return self._regrouped(q, k, v, 0, F.scaled_dot_product_attention)
        return self._regrouped(q, k, v, start // hw,
                               lambda *qkv: ring(*(z.transpose(1, 2) for z in qkv)).transpose(1, 2))

    def _regrouped(self, q, k, v, first: int, attention):
        """Frames first.. of the grid, [B, f*h*w, n, d] -> same: q/k RMSNorm, grouped per frame (spatial) or per
        (h, w) position (temporal: rotary by frame index), `attention` on (groups, n, len, d) heads first."""
        frames = q.shape[1] // math.prod(self.grid.value[1:])
        group = "b (t s) n d -> (b s) n t d" if self.temporal else "b (t s) n d -> (b t) n s d"
        back = "(b s) n t d -> b (t s) n d" if self.temporal else "(b t) n s d -> b (t s) n d"
        batch = q.shape[0]
        q, k, v = (rearrange(z, group, t=frames) for z in (q, k, v))              # (groups, n, len, d)
        norm = copy_to_tp(torch.stack([self.q_norm_weight, self.k_norm_weight]), self.ctx)
        q = F.rms_norm(q, (self.head_dim,), norm[0], eps=1e-6)
        k = F.rms_norm(k, (self.head_dim,), norm[1], eps=1e-6)
        if self._rope is not None:
            cos, sin = self._rope.get(frames_key(self.grid), q.device)            # (T, d)
            cos, sin = cos[first:first + frames], sin[first:first + frames]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return rearrange(attention(q, k, v), back, b=batch)


class CrossAttention(nn.Module):
    """Each video token attends to the caption tokens y; heads split over tp ranks (no mask: fixed-length text)."""

    def __init__(self, cfg: STDiTConfig, ctx):
        super().__init__()
        hid, self.head_dim = cfg.hidden_size, cfg.head_dim
        self.q_linear = ColumnParallelLinear(hid, hid, ctx=ctx)
        # No bias, unlike Open-Sora's, at no loss: a key bias adds q.b to every logit of a query, which
        # softmax ignores (its exact gradient is zero, so Adam would only turn round-off into updates),
        # and a value bias reaches the output as the constant W_proj b, which proj's bias already is.
        self.kv_linear = ColumnParallelLinear(hid, [hid, hid], ctx=ctx, bias=False)
        self.proj = RowParallelLinear(hid, hid, ctx=ctx)

    def forward(self, x, y):
        q = rearrange(self.q_linear(x), "b s (n d) -> b n s d", d=self.head_dim)
        k, v = rearrange(self.kv_linear(y), "b l (two n d) -> two b n l d", two=2, d=self.head_dim)
        o = F.scaled_dot_product_attention(q, k, v)                               # (B, heads/p, S, d)
        return self.proj(rearrange(o, "b n s d -> b s (n d)"))


class STDiT3Block(nn.Module):
    """Modulated self-attention (spatial or temporal), cross-attention to the text, modulated MLP."""

    def __init__(self, cfg: STDiTConfig, grid, ctx, temporal: bool):
        super().__init__()
        hid = cfg.hidden_size
        self.scale_shift_table = nn.Parameter(torch.randn(6, hid) / hid ** 0.5)
        self.attn = SelfAttention(cfg, grid, ctx, temporal)
        self.cross_attn = CrossAttention(cfg, ctx)
        self.mlp_fc1 = ColumnParallelLinear(hid, cfg.ffn_size, ctx=ctx)
        self.mlp_fc2 = RowParallelLinear(cfg.ffn_size, hid, ctx=ctx)

    def forward(self, x, y, t_mlp):
        hid = x.shape[-1]
        mod = self.scale_shift_table[None] + t_mlp.unflatten(1, (6, hid))         # (B, 6, H)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod.chunk(6, dim=1)
        h = modulate(F.layer_norm(x, (hid,), eps=1e-6), shift_msa, scale_msa)
        x = x + gate_msa * self.attn(h)
        x = x + self.cross_attn(x, y)
        h = modulate(F.layer_norm(x, (hid,), eps=1e-6), shift_mlp, scale_mlp)
        return x + gate_mlp * self.mlp(h)

    def mlp(self, h):
        """GELU MLP (B, S, H) -> (B, S, H); a method so that selective recomputation can wrap it."""
        return self.mlp_fc2(F.gelu(self.mlp_fc1(h), approximate="tanh"))


class STDiT3Layer(nn.Module):
    """One pipeline layer: a spatial block, then a temporal block. (x, t, t_mlp, y) -> same, x updated."""

    def __init__(self, cfg: STDiTConfig, grid, ctx):
        super().__init__()
        self.spatial = STDiT3Block(cfg, grid, ctx, temporal=False)
        self.temporal = STDiT3Block(cfg, grid, ctx, temporal=True)

    def forward(self, inputs):
        x, t, t_mlp, y = inputs
        x = self.temporal(self.spatial(x, y, t_mlp), y, t_mlp)
        return x, t, t_mlp, y


class FinalStage(nn.Module):
    """Open-Sora's T2IFinalLayer: LayerNorm -> shift, scale from scale_shift_table [2, H] + t -> linear ->
    unpatchify to [B, C, T, H, W]; with sp, this rank's tokens as patches [B, S_pad/sp, C*pt*p*p], padding
    rows included (the loss skips them; `assemble` makes the full prediction)."""

    def __init__(self, cfg: STDiTConfig, grid, ctx=None):
        super().__init__()
        self.cfg, self.grid, self.ctx = cfg, grid, ctx
        p, pt, hid = cfg.patch_size, cfg.patch_size_t, cfg.hidden_size
        self.scale_shift_table = nn.Parameter(torch.randn(2, hid) / hid ** 0.5)
        self.linear = nn.Linear(hid, cfg.in_channels * pt * p * p)

    def forward(self, inputs):
        x, t, _, _ = inputs
        shift, scale = (self.scale_shift_table[None] + t[:, None]).chunk(2, dim=1)   # (B, 1, H) each
        x = modulate(F.layer_norm(x, (x.shape[-1],), eps=1e-6), shift, scale)
        out = self.linear(x)
        return unpatchify(out, self.cfg, self.grid) if sp_size_of(self.ctx) == 1 else out

    def assemble(self, out: torch.Tensor) -> torch.Tensor:
        """The full prediction [B, C, T, H, W] from forward's output on any sp rank (no gradient)."""
        if sp_size_of(self.ctx) == 1:
            return out
        return unpatchify(gather_sequence(out, self.ctx, total=math.prod(self.grid.value)), self.cfg, self.grid)
