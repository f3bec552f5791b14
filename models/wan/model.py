"""Wan 2.1 text-to-video (diffusers' WanTransformer3DModel) as a list of stages: embed -> blocks -> final.

Between stages flow (all receive gradients, as DeepSpeed's pipeline requires)

    x      [B, S, H]    video tokens, S = t*h*w in (t, h, w) order (patch (1, 2, 2); no text in the sequence)
    temb   [B, H]       time embedding (the output head's modulation)
    tproj  [B, 6H]      time_proj(silu(temb)): every block's modulation
                        Wan 2.2 TI2V (model.expand_timesteps): one per token, temb [B, S, H] and tproj [B, S, 6H];
                        under sp each rank embeds its own tokens' timesteps only (S/sp rows, as x)
    y      [B, L, H]    projected UMT5 caption tokens, keys and values of every cross-attention; image-to-video
                        (model.image_dim): [B, I + L, H], the I projected CLIP image tokens first (as diffusers)

A block (names and order of operations as diffusers' WanTransformerBlock; norms and modulation in fp32):

    shift, scale, gate (msa), c_shift, c_scale, c_gate = scale_shift_table [6, H] + tproj
    x = x + gate * SelfAttn(LN(x) * (1 + scale) + shift)          3D rotary positions on q and k
    x = x + CrossAttn(LN_affine(x), y)                            every video token attends to the caption
    x = x + c_gate * FFN(LN(x) * (1 + c_scale) + c_shift)         GELU (tanh)

Image-to-video adds an image part to the cross-attention, summed before its output projection (diffusers'
WanAttnProcessor): CrossAttn(h, y) = W_o [softmax(q k_txt^T) v_txt + softmax(q k_img^T) v_img], k_img, v_img =
add_kv(y_img), k_img through its own RMSNorm (norm_added_k). The image tokens enter as CLIP's penultimate
states [B, I, image_dim], through LN -> Linear -> GELU -> Linear -> LN (diffusers' WanImageEmbedding, fp32 norms
with eps 1e-5). The first stage's latents are then [B, 36, T, H, W]: x_t, mask, image latents (models/wan/image.py).

q and k of both attentions (and the image keys) pass an RMSNorm over all heads' channels together (qk_norm
`rms_norm_across_heads`): y = x / sqrt(mean_{n*d channels} x^2 + eps) * w. The rotary positions split
head_dim into a time part (d - 4 (d // 6) channels) and height and width parts (2 (d // 6) each).

Tensor parallelism (ctx.tp_size = p): QKV, cross-attention Q, KV and image KV and the FFN input are column-parallel
(heads and FFN width split p ways), the three output projections row-parallel. A rank then holds n/p heads
of q and k, and the RMSNorm's weight for those channels (a sharded parameter); the statistic spans every
head, so each rank sums the squares of its channels and the sums are all-reduced (`HeadsRMSNorm`), in
backward too. Patch, text and time embeddings, the modulation tables, norm2 and the head are replicated.

Sequence parallelism: everything but self-attention works token by token (the RMSNorms normalise one
token's channels), so it runs on any chunk of x; self-attention's `_prepare` applies the rotary positions
to the tokens SequenceAttention gives it (the full sequence for its heads under Ulysses, a ring chunk under
ring attention, with that chunk's first position).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from models.embeddings import apply_rope_complex, rope_complex, timestep_embedding
from models.geometry import PositionCache, patchify, unpatchify
from models.wan.config import WanConfig
from models.wan.experts import ExpertEmbed, ExpertFinal, ExpertLayer, both, plain
from models.wan.ti2v import token_timesteps
from parallel.distributed.comm import copy_to_tp, reduce_from_tp
from parallel.distributed.layers import ColumnParallelLinear, RowParallelLinear, mark_tensor_parallel
from parallel.distributed.sequence import SequenceAttention, gather_sequence, sp_size_of, split_sequence

EPS = 1e-6                  # diffusers' eps: every LayerNorm and RMSNorm of the released models
IMAGE_EPS = 1e-5            # but the image embedding's two LayerNorms (FP32LayerNorm's default)
ROPE_THETA = 10000.0


def rope_dims(head_dim: int) -> tuple[int, int, int]:
    """Channels of head_dim rotated by frame, row and column position: 128 -> (44, 42, 42)."""
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def _rope_axis(dim: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, dim] of positions 0..n-1, computed in float64 (as diffusers does), each frequency repeated
    for its channel pair."""
    inv = 1.0 / ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv)                  # (n, dim/2)
    return freqs.cos().repeat_interleave(2, dim=1).float(), freqs.sin().repeat_interleave(2, dim=1).float()


def wan_rope(head_dim: int, t: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's 3D rotary table of a (t, h, w) token grid: cos, sin [t*h*w, head_dim] (WanRotaryPosEmbed)."""
    tables = [_rope_axis(d, n) for d, n in zip(rope_dims(head_dim), (t, h, w))]

    def combine(ft, fh, fw):
        return torch.cat([ft[:, None, None].expand(t, h, w, -1), fh[None, :, None].expand(t, h, w, -1),
                          fw[None, None].expand(t, h, w, -1)], dim=-1).reshape(t * h * w, head_dim)
    return combine(*(c for c, _ in tables)), combine(*(s for _, s in tables))


def wan_rope_complex(head_dim: int, t: int, h: int, w: int) -> torch.Tensor:
    """wan_rope as complex rotations [t*h*w, head_dim/2] (models.embeddings.rope_complex)."""
    return rope_complex(*wan_rope(head_dim, t, h, w))


class HeadsRMSNorm(nn.Module):
    """RMSNorm over the channels of all heads, of which this tp rank holds 1/p (and 1/p of the weight).

    sum of squares of the local channels -> all-reduce over tp -> mean over the full width. The all-reduce
    is reduce_from_tp(copy_to_tp(.)): forward sums over ranks, backward sums the gradients of every rank's
    use of the statistic (each rank's output depends on every rank's channels).
    """

    def __init__(self, width: int, ctx):
        super().__init__()
        self.width, self.ctx = width, ctx
        self.weight = nn.Parameter(torch.ones(width // ctx.tp_size))
        mark_tensor_parallel(self.weight, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:              # every channel here: torch's fused RMSNorm (as torch.nn.RMSNorm)
            return F.rms_norm(x, (self.width,), self.weight.to(x.dtype), EPS)
        sumsq = x.float().square().sum(-1, keepdim=True)                              # (B, S, 1)
        sumsq = reduce_from_tp(copy_to_tp(sumsq, self.ctx), self.ctx)
        return (x.float() * torch.rsqrt(sumsq / self.width + EPS)).to(x.dtype) * self.weight


class SelfAttention(nn.Module):
    """Self-attention over the video tokens with Wan's 3D rotary positions; heads split over tp ranks."""

    def __init__(self, cfg: WanConfig, grid, ctx):
        super().__init__()
        hid, self.head_dim, self.grid = cfg.hidden_size, cfg.head_dim, grid
        self.to_qkv = ColumnParallelLinear(hid, [hid, hid, hid], ctx=ctx)
        self.norm_q, self.norm_k = HeadsRMSNorm(hid, ctx), HeadsRMSNorm(hid, ctx)
        self.to_out = RowParallelLinear(hid, hid, ctx=ctx)
        self._rope = PositionCache(functools.partial(wan_rope_complex, self.head_dim), grid)
        self.core = SequenceAttention(ctx=ctx, tokens=self.tokens, prepare=self._prepare)

    def tokens(self) -> int:
        """Real tokens of the step's sequence (its bucket's video grid), before any sp padding."""
        return math.prod(self.grid.value)

    def forward(self, x):
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)                                     # (B, S, H/p) each
        q, k, v = (z.unflatten(-1, (-1, self.head_dim)) for z in (self.norm_q(q), self.norm_k(k), v))
        o = self.core(q, k, v)                                                        # (B, S, heads/p, d)
        return self.to_out(o.flatten(2))                                              # (B, S, H)

    def _prepare(self, q, k, v, start: int):
        """Rotary positions of tokens start.. of the token grid (no sp padding): [B, s, n, d] each -> same;
        SequenceAttention then attends (whole sequence, or ring chunks)."""
        q, k = (z.transpose(1, 2) for z in (q, k))                                    # (B, n, s, d)
        freqs = self._rope.get(self.grid, q.device)[start:start + q.shape[2]]         # (s, d/2) complex
        q, k = apply_rope_complex(q, freqs), apply_rope_complex(k, freqs)
        return q.transpose(1, 2), k.transpose(1, 2), v


class CrossAttention(nn.Module):
    """Each video token attends to the caption tokens y (no mask: the caption is padded to max_text_len)."""

    def __init__(self, cfg: WanConfig, ctx):
        super().__init__()
        hid, self.head_dim, self.text_len = cfg.hidden_size, cfg.head_dim, cfg.max_text_len
        self.to_q = ColumnParallelLinear(hid, hid, ctx=ctx)
        self.to_kv = ColumnParallelLinear(hid, [hid, hid], ctx=ctx)
        self.norm_q, self.norm_k = HeadsRMSNorm(hid, ctx), HeadsRMSNorm(hid, ctx)
        self.add_kv = None
        if cfg.added_kv_proj_dim is not None:       # image-to-video: the image tokens' own k and v
            self.add_kv = ColumnParallelLinear(cfg.added_kv_proj_dim, [hid, hid], ctx=ctx)
            self.norm_added_k = HeadsRMSNorm(hid, ctx)
        self.to_out = RowParallelLinear(hid, hid, ctx=ctx)

    def forward(self, x, y):
        y, image = y[:, -self.text_len:], y[:, :-self.text_len]                      # (B, L, H), (B, I, H)
        k, v = self.to_kv(y).chunk(2, dim=-1)                                         # (B, L, H/p) each
        q = rearrange(self.norm_q(self.to_q(x)), "b s (n d) -> b n s d", d=self.head_dim)
        o = F.scaled_dot_product_attention(q, *self._heads(self.norm_k(k), v))         # (B, heads/p, S, d)
        if self.add_kv is not None:
            k, v = self.add_kv(image).chunk(2, dim=-1)                                # (B, I, H/p) each
            o = o + F.scaled_dot_product_attention(q, *self._heads(self.norm_added_k(k), v))
        return self.to_out(rearrange(o, "b n s d -> b s (n d)"))

    def _heads(self, k, v):
        return (rearrange(z, "b l (n d) -> b n l d", d=self.head_dim) for z in (k, v))


class WanBlock(nn.Module):
    """One WanTransformerBlock; (x, temb, tproj, y) -> same, x updated. Both experts of a Wan 2.2 A14B model
    (model.experts.train both): an ExpertLayer of two (models/wan/experts.py)."""

    def __new__(cls, cfg, *args, **kwargs):
        return ExpertLayer(plain(cls), cfg, *args, **kwargs) if both(cfg) else super().__new__(cls)

    def __init__(self, cfg: WanConfig, grid, ctx):
        super().__init__()
        hid = cfg.hidden_size
        self.scale_shift_table = nn.Parameter(torch.randn(6, hid) / hid ** 0.5)
        self.attn1 = SelfAttention(cfg, grid, ctx)
        self.norm2 = nn.LayerNorm(hid, eps=EPS)                                       # cross_attn_norm: affine
        self.attn2 = CrossAttention(cfg, ctx)
        self.ffn_in = ColumnParallelLinear(hid, cfg.ffn_size, ctx=ctx)
        self.ffn_out = RowParallelLinear(cfg.ffn_size, hid, ctx=ctx)

    def forward(self, inputs):
        x, temb, tproj, y = inputs
        hid, dtype = x.shape[-1], x.dtype
        # per sample: tproj (B, 6H) -> (B, 1, 6, H); per token (TI2V): (B, S, 6H) -> (B, S, 6, H)
        mod = self.scale_shift_table.float() + tproj.float().unflatten(-1, (6, hid))
        mod = mod[:, None] if mod.dim() == 3 else mod
        shift, scale, gate, c_shift, c_scale, c_gate = mod.unbind(2)                # (B, 1 or S, H) each
        # addcmul: LN(x) (1 + scale) + shift and x + gate * update each in one pass over (B, S, H)
        h = torch.addcmul(shift, F.layer_norm(x.float(), (hid,), eps=EPS), 1 + scale).to(dtype)
        x = torch.addcmul(x.float(), self.attn1(h).float(), gate).to(dtype)
        h = F.layer_norm(x.float(), (hid,), self.norm2.weight.float(), self.norm2.bias.float(), EPS).to(dtype)
        x = x + self.attn2(h, y)
        h = torch.addcmul(c_shift, F.layer_norm(x.float(), (hid,), eps=EPS), 1 + c_scale).to(dtype)
        return torch.addcmul(x.float(), self.ffn(h).float(), c_gate).to(dtype), temb, tproj, y

    def ffn(self, h):
        """GELU FFN (B, S, H) -> (B, S, H); a method so that selective recomputation can wrap it."""
        return self.ffn_out(F.gelu(self.ffn_in(h), approximate="tanh"))


class EmbedStage(nn.Module):
    """(latents [B,C,T,H,W], timesteps [B], text [B,L,text_dim]) -> (x [B,S,H], temb [B,H], tproj [B,6H], y [B,L,H]);
    Wan 2.2 TI2V (model.expand_timesteps): timesteps [B], [B, S] or [B, T, H, W] -> temb [B,S,H], tproj [B,S,6H]
    (this rank's tokens under sp; models/wan/ti2v.py);
    image-to-video: (latents [B,36,T,H,W], timesteps, text, image [B,I,image_dim]) -> (..., y [B,I+L,H]).
    Both experts of a Wan 2.2 A14B model: an ExpertEmbed of two, the sample's expert appended."""

    def __new__(cls, cfg, *args, **kwargs):
        return ExpertEmbed(plain(cls), cfg, *args, **kwargs) if both(cfg) else super().__new__(cls)

    def __init__(self, cfg: WanConfig, grid: tuple[int, int, int], ctx=None):
        super().__init__()
        self.cfg, self.grid, self.ctx = cfg, grid, ctx
        p, pt, c, hid = cfg.patch_size, cfg.patch_size_t, cfg.transformer_in_channels, cfg.hidden_size
        self.patch_embedding = nn.Linear(c * pt * p * p, hid)          # = Conv3d(kernel = stride = (pt, p, p))
        self.time_linear_1 = nn.Linear(cfg.time_embed_dim, hid)
        self.time_linear_2 = nn.Linear(hid, hid)
        self.time_proj = nn.Linear(hid, 6 * hid)
        self.text_linear_1 = nn.Linear(cfg.text_embed_dim, hid)
        self.text_linear_2 = nn.Linear(hid, hid)
        if cfg.image_dim is not None:               # diffusers' WanImageEmbedding (FP32LayerNorm: eps 1e-5)
            self.image_norm1 = nn.LayerNorm(cfg.image_dim, eps=IMAGE_EPS)
            self.image_linear_1 = nn.Linear(cfg.image_dim, cfg.image_dim)
            self.image_linear_2 = nn.Linear(cfg.image_dim, hid)
            self.image_norm2 = nn.LayerNorm(hid, eps=IMAGE_EPS)

    def forward(self, inputs):
        latents, timesteps, text, *image = inputs
        if bool(image) != (self.cfg.image_dim is not None):     # else the cross-attention would split y wrongly
            raise ValueError(f"model {self.cfg.name}: {len(inputs)} inputs; (latents, timesteps, text"
                             f"{', CLIP states' if self.cfg.image_dim is not None else ''}) expected")
        dtype = self.patch_embedding.weight.dtype
        x = split_sequence(self.patch_embedding(patchify(latents.to(dtype), self.cfg)), self.ctx)   # (B, S/sp, H)
        if self.cfg.expand_timesteps:        # TI2V: a timestep per token; under sp this rank's tokens' only
            timesteps = split_sequence(token_timesteps(timesteps, self.cfg, tuple(self.grid)), self.ctx)   # (B, S/sp)
        t_freq = timestep_embedding(timesteps.flatten(), self.cfg.time_embed_dim).to(dtype)   # [cos, sin], as Timesteps
        t_freq = t_freq.unflatten(0, timesteps.shape)                               # (B, F) or (B, S, F)
        temb = self.time_linear_2(F.silu(self.time_linear_1(t_freq)))               # (B, H) or (B, S, H)
        tproj = self.time_proj(F.silu(temb))                                        # (B, 6H) or (B, S, 6H)
        y = self.text_linear_2(F.gelu(self.text_linear_1(text.to(dtype)), approximate="tanh"))   # (B, L, H)
        if image:
            y = torch.cat([self.image_tokens(image[0].to(dtype)), y], dim=1)                       # (B, I + L, H)
        return x, temb, tproj, y

    def image_tokens(self, image: torch.Tensor) -> torch.Tensor:
        """CLIP states [B, I, image_dim] -> [B, I, H]: LN -> Linear -> GELU -> Linear -> LN, norms in fp32."""
        def norm(z, ln):
            return F.layer_norm(z.float(), ln.normalized_shape, ln.weight.float(), ln.bias.float(), ln.eps).to(z.dtype)
        return norm(self.image_linear_2(F.gelu(self.image_linear_1(norm(image, self.image_norm1)))), self.image_norm2)


class FinalStage(nn.Module):
    """LayerNorm -> shift, scale from scale_shift_table [2, H] + temb -> proj_out -> unpatchify [B, C, T, H, W];
    with sp, this rank's tokens as patches [B, S_pad/sp, C*pt*p*p] (`assemble` makes the full prediction).
    Both experts of a Wan 2.2 A14B model: an ExpertFinal of two."""

    def __new__(cls, cfg, *args, **kwargs):
        return ExpertFinal(plain(cls), cfg, *args, **kwargs) if both(cfg) else super().__new__(cls)

    def __init__(self, cfg: WanConfig, grid, ctx=None):
        super().__init__()
        self.cfg, self.grid, self.ctx = cfg, grid, ctx
        hid, p, pt = cfg.hidden_size, cfg.patch_size, cfg.patch_size_t
        self.scale_shift_table = nn.Parameter(torch.randn(2, hid) / hid ** 0.5)
        self.proj_out = nn.Linear(hid, cfg.in_channels * pt * p * p)

    def forward(self, inputs):
        x, temb, _, _ = inputs
        # temb (B, H) per sample -> shift, scale (B, 1, H); (B, S, H) per token (TI2V) -> (B, S, H)
        temb = temb.float()[:, None] if temb.dim() == 2 else temb.float()
        shift, scale = (self.scale_shift_table.float() + temb[:, :, None]).unbind(2)
        h = (F.layer_norm(x.float(), (x.shape[-1],), eps=EPS) * (1 + scale) + shift).to(x.dtype)
        # proj_out's rows are diffusers' (pt, p, q, c) order; patchify's (and the loss's) is (c, pt, p, q).
        p, pt = self.cfg.patch_size, self.cfg.patch_size_t
        out = rearrange(self.proj_out(h), "b s (pt p q c) -> b s (c pt p q)", pt=pt, p=p, q=p)
        return unpatchify(out, self.cfg, self.grid) if sp_size_of(self.ctx) == 1 else out

    def assemble(self, out: torch.Tensor) -> torch.Tensor:
        """The full prediction [B, C, T, H, W] from forward's output on any sp rank (no gradient)."""
        if sp_size_of(self.ctx) == 1:
            return out
        return unpatchify(gather_sequence(out, self.ctx, total=math.prod(self.grid.value)), self.cfg, self.grid)
