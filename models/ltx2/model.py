"""LTX-2's block (diffusers' LTX2VideoTransformerBlock): a video stream x [B, S, D] and an audio stream a [B, A, Da].

Between stages flow (models/ltx2/embed.py makes them; all receive gradients)

    x     [B, S, D]       video tokens (t, h, w order; patch 1)
    a     [B, A, Da]      audio tokens (latent frames)
    vmod  [B, 1, Mv D]    the video modulation rows, side by side: block AdaLN (6, or 9 with cross_attn_mod), a2v/v2a
                          scale-shift (4), a2v gate (1), caption key/value scale-shift (2, LTX-2.3), head (1);
                          image-to-video [B, 2, Mv D]: the second the conditioned first latent frame's (its tokens'
                          timestep 0), the first every later frame's (`modulate`, `gate`)
    amod  [B, 1, Ma Da]   the same for audio
    y     [B, L, D]       projected caption, video cross-attention keys and values
    ya    [B, L, Da]      projected caption, audio cross-attention keys and values

A block, per stream (names as diffusers'; RMSNorm without weight; p_k = table_k + mod_k):

    x = x + g_msa * SelfAttn(rms(x) (1 + sc_msa) + sh_msa)                      rotary positions on q, k
    x = x + [g_q *] CrossAttn(rms(x) [(1 + sc_q) + sh_q], y [(1 + sc_kv) + sh_kv])   [LTX-2.3 cross_attn_mod]
    x = x + g_a2v * Attn(rms(x) (1 + sc) + sh  ->  rms(a) (1 + sc') + sh')      video queries, audio keys (a2v)
    a = a + g_v2a * Attn(rms(a) (1 + ..) + ..  ->  rms(x) (1 + ..) + ..)        audio queries, video keys (v2a)
    x = x + g_mlp * FFN(rms(x) (1 + sc_mlp) + sh_mlp)                           GELU (tanh), 4 x width

(a2v and v2a both read the streams as they were before either.) Both cross-stream attentions have the audio
heads (Da = audio heads x audio head_dim) and turn q and k by time alone (models/ltx2/rope.py). Every attention
normalises q and k over all its heads (RMS with weight); LTX-2.3's gated attention multiplies each head's output
by 2 sigmoid(W_g h) before the output projection. Image-to-video (LTX2ImageToVideoPipeline's per-token timestep:
the clean first latent frame's h w tokens at 0, the rest at t) modulates the first frame's tokens with vmod's
second row and the others with its first, segment by segment (no per-token copy of the rows).

Tensor parallelism (ctx.tp_size = p): every q, k, v projection and gate is column-parallel (heads split p ways),
every output projection row-parallel, the FFNs column- then row-parallel: 6 attentions + 2 FFNs, 8 all-reduces of
the block outputs per block. The q/k RMSNorm spans every head: each rank sums its channels' squares and one
all-reduce adds them (`HeadsRMSNorm`: 12 per block, B x tokens numbers each). Modulation tables are replicated.

Sequence parallelism (ctx.sp_size = s): the video stream is split, each sp rank holding S_pad / s consecutive
tokens (x [B, S_pad/s, D], padded at the end, parallel/distributed/sequence.py), and the audio stream is kept
whole on every sp rank. Why: audio has 25 tokens a second, 126 for the release's 121 frames against 6,144 video
tokens, about 0.6% of a block's FLOPs and 1% of its activations; split it would be padded (126 -> 128 at s 4)
and its attentions would need Ulysses' all-to-alls (audio heads dividing tp x Ulysses) for a hundred tokens;
whole, its self-attention, caption cross-attention and FFN run on each rank without communicating. Then:
  - video self-attention: `SequenceAttention` (Ulysses, ring, or both), the rotary positions turned on the rows
    and heads it hands over (`VideoSelfAttention._prepare`);
  - video caption cross-attention, FFN, norms, modulation: per token, on the rank's chunk;
  - audio-to-video: the rank's video queries attend to the whole audio stream it holds: no communication;
  - video-to-audio: the audio queries need every rank's video keys: each rank attends to its own and the
    partial outputs merge by their log-sum-exps over the sp group (`split_keys_attention`: an all-gather of
    B x A x Da/p outputs, not of the B x S x Da/p keys and values, which every rank would keep for backward).
Each sp rank's audio stream is its own copy: training counts each rank's whole audio loss once and its video
share s times (SequenceLoss), so that the average over dp x sp is the serial loss and gradient.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from models.geometry import PositionCache
from models.ltx2.config import LTX2Config
from models.ltx2.rope import RopeParams, apply_rope, audio_rope, cross_ropes, local, rows, video_rope
from parallel.distributed.comm import copy_to_tp, reduce_from_tp
from parallel.distributed.layers import ColumnParallelLinear, RowParallelLinear, mark_tensor_parallel
from parallel.distributed.sequence import SequenceAttention, local_range, sp_size_of
from parallel.distributed.split_keys import split_keys_attention

EPS = 1e-6


def rms(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm without weight, in fp32 (diffusers' RMSNorm, elementwise_affine false)."""
    h = x.float()
    return (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + EPS)).to(x.dtype)


class HeadsRMSNorm(nn.Module):
    """RMSNorm over the channels of all heads, of which this tp rank holds 1/p (and 1/p of the weight): the local
    sum of squares, all-reduced over tp (forward and backward), over the full width."""

    def __init__(self, width: int, ctx):
        super().__init__()
        self.width, self.ctx = width, ctx
        self.weight = nn.Parameter(torch.ones(width // ctx.tp_size))
        mark_tensor_parallel(self.weight, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return F.rms_norm(x, (self.width,), self.weight.to(x.dtype), EPS)
        sumsq = reduce_from_tp(copy_to_tp(x.float().square().sum(-1, keepdim=True), self.ctx), self.ctx)
        return (x.float() * torch.rsqrt(sumsq / self.width + EPS)).to(x.dtype) * self.weight


class Attention(nn.Module):
    """One LTX2Attention: queries from h [B, N, query_dim], keys and values from h (self) or from c [B, M, kv_dim];
    heads split over tp ranks. Arguments positional: train.recompute's checkpoints pass them so."""

    def __init__(self, query_dim: int, kv_dim: int, heads: int, head_dim: int, ctx, gated: bool, self_attn: bool):
        super().__init__()
        inner, self.head_dim, self.ctx = heads * head_dim, head_dim, ctx
        if self_attn:
            self.to_qkv = ColumnParallelLinear(query_dim, [inner, inner, inner], ctx=ctx)
        else:
            self.to_q = ColumnParallelLinear(query_dim, inner, ctx=ctx)
            self.to_kv = ColumnParallelLinear(kv_dim, [inner, inner], ctx=ctx)
        self.norm_q, self.norm_k = HeadsRMSNorm(inner, ctx), HeadsRMSNorm(inner, ctx)
        self.to_out = RowParallelLinear(inner, query_dim, ctx=ctx)
        self.to_gate_logits = ColumnParallelLinear(query_dim, heads, ctx=ctx) if gated else None

    def forward(self, h, c=None, q_rope=None, k_rope=None, *extra):
        if c is None:
            q, k, v = self.to_qkv(h).chunk(3, dim=-1)                               # (B, N, inner/p) each
        else:
            q, (k, v) = self.to_q(h), self.to_kv(c).chunk(2, dim=-1)
        q, k = self.norm_q(q), self.norm_k(k)
        if q_rope is not None:
            rank, size = self.ctx.tp_rank, self.ctx.tp_size
            q = apply_rope(q, local(q_rope, rank, size))
            k = apply_rope(k, local(k_rope if k_rope is not None else q_rope, rank, size))
        o = self.attend(*(z.unflatten(-1, (-1, self.head_dim)) for z in (q, k, v)), *extra)   # (B, N, n/p, d)
        if self.to_gate_logits is not None:
            o = o * (2.0 * torch.sigmoid(self.to_gate_logits(h))).unsqueeze(-1)
        return self.to_out(o.flatten(2))

    def attend(self, q, k, v):
        """[B, N, n, d] queries, [B, M, n, d] keys and values -> [B, N, n, d]."""
        return F.scaled_dot_product_attention(*(z.transpose(1, 2) for z in (q, k, v))).transpose(1, 2)


class VideoSelfAttention(Attention):
    """The video self-attention over the whole sequence (`SequenceAttention`: Ulysses, ring or both under sp), its
    rotary positions turned on the tokens and heads SequenceAttention hands `_prepare`."""

    def __init__(self, cfg: LTX2Config, grid, ctx):
        super().__init__(cfg.hidden_size, cfg.hidden_size, cfg.num_heads, cfg.head_dim, ctx, cfg.gated_attn, True)
        self.grid = grid
        self._rope = PositionCache(functools.partial(video_rope, RopeParams.of(cfg)), grid)
        self.core = SequenceAttention(ctx=ctx, tokens=self.tokens, prepare=self._prepare)

    def tokens(self) -> int:
        """Video tokens of the step's grid, before any sp padding."""
        return math.prod(self.grid.value)

    def attend(self, q, k, v):
        return self.core(q, k, v)

    def _prepare(self, q, k, v, start: int):
        """Rotary positions of tokens start.. (no sp padding) for the heads given: [B, s, n, d] each -> same. The
        heads are this tp rank's, and under Ulysses this rank's consecutive part of them."""
        c = self.ctx
        table = local(local(self._rope.get(self.grid, q.device), c.tp_rank, c.tp_size), c.ulysses_rank,
                      c.ulysses_size)
        table = rows(table, start, start + q.shape[1])
        q, k = (apply_rope(z.flatten(2), table).unflatten(-1, (-1, self.head_dim)) for z in (q, k))
        return q, k, v


class VideoToAudioAttention(Attention):
    """The audio queries (whole on every sp rank) over the video keys and values (this rank's S_pad / sp tokens,
    `real` of them real): parallel/distributed/split_keys.py merges the ranks' partial attentions."""

    def attend(self, q, k, v, real: int):
        if sp_size_of(self.ctx) == 1:
            return super().attend(q, k, v)
        return split_keys_attention(q, k, v, real, self.ctx)


class FeedForward(nn.Module):
    """Linear -> GELU (tanh) -> Linear, 4 x width; column- then row-parallel."""

    def __init__(self, width: int, ctx):
        super().__init__()
        self.ff_in = ColumnParallelLinear(width, 4 * width, ctx=ctx)
        self.ff_out = RowParallelLinear(4 * width, width, ctx=ctx)

    def forward(self, h):
        return self.ff_out(F.gelu(self.ff_in(h), approximate="tanh"))


def mod_rows(m: LTX2Config, audio: bool) -> dict[str, int]:
    """The rows of vmod (amod: audio) in order, each `width` wide: name -> count."""
    adaln = m.audio_cross_attn_mod if audio else m.cross_attn_mod
    rows = {"block": 9 if adaln else 6, "cross": 4, "gate": 1}
    if m.cross_attn_adaln:
        rows["prompt"] = 2
    rows["head"] = 1
    return rows


def split_mod(mod: torch.Tensor, rows: dict[str, int]) -> dict[str, torch.Tensor]:
    """vmod [B, 1, M W] -> name -> [B, 1, count, W]."""
    parts = mod.unflatten(-1, (sum(rows.values()), -1)).split(list(rows.values()), dim=2)
    return dict(zip(rows, parts))


def modulate(h, scale, shift, k: int = 0):
    """h (1 + scale) + shift, the rows [B, 1, W] on every token of h [B, N, W]; image-to-video's [B, 2, W]: the
    second on the first k tokens (this rank's of the conditioned first frame), the first on the rest."""
    if scale.shape[1] == 1:
        return h * (1 + scale) + shift
    return torch.cat([h[:, :k] * (1 + scale[:, 1:]) + shift[:, 1:], h[:, k:] * (1 + scale[:, :1]) + shift[:, :1]], 1)


def gate(h, g, k: int = 0):
    """h g, the rows as `modulate`'s."""
    if g.shape[1] == 1:
        return h * g
    return torch.cat([h[:, :k] * g[:, 1:], h[:, k:] * g[:, :1]], 1)


def first_frame_tokens(grid, start: int, tokens: int) -> int:
    """Of the tokens start..start+tokens (this sp rank's), how many are latent frame 0's (h w of the (t, h, w)
    grid, patch 1): those image-to-video modulates as the conditioned frame."""
    return min(max(math.prod(tuple(grid)[1:]) - start, 0), tokens)


class LTX2Block(nn.Module):
    """One LTX2VideoTransformerBlock: (x, a, vmod, amod, y, ya) -> the same, x and a updated."""

    def __init__(self, cfg: LTX2Config, grid, ctx):
        super().__init__()
        self.cfg, self.grid, self.ctx = cfg, grid, ctx
        d, da, n, na = cfg.hidden_size, cfg.audio_hidden_size, cfg.num_heads, cfg.audio_num_heads
        hd, had = cfg.head_dim, cfg.audio_head_dim
        self.attn1 = VideoSelfAttention(cfg, grid, ctx)
        self.audio_attn1 = Attention(da, da, na, had, ctx, cfg.audio_gated_attn, True)
        self.attn2 = Attention(d, d, n, hd, ctx, cfg.gated_attn, False)
        self.audio_attn2 = Attention(da, da, na, had, ctx, cfg.audio_gated_attn, False)
        self.audio_to_video_attn = Attention(d, da, na, had, ctx, cfg.gated_attn, False)
        self.video_to_audio_attn = VideoToAudioAttention(da, d, na, had, ctx, cfg.audio_gated_attn, False)
        self.ff, self.audio_ff = FeedForward(d, ctx), FeedForward(da, ctx)
        self.scale_shift_table = nn.Parameter(torch.randn(mod_rows(cfg, False)["block"], d) / d ** 0.5)
        self.audio_scale_shift_table = nn.Parameter(torch.randn(mod_rows(cfg, True)["block"], da) / da ** 0.5)
        if cfg.cross_attn_adaln:
            self.prompt_scale_shift_table = nn.Parameter(torch.randn(2, d))
            self.audio_prompt_scale_shift_table = nn.Parameter(torch.randn(2, da))
        self.video_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.randn(5, d))
        self.audio_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.randn(5, da))
        m = RopeParams.of(cfg)
        # keyed by the audio stream's length, a.shape[1]: for `warm`, the clip's (LTX2Config.audio_tokens_at)
        self._audio_rope = PositionCache(functools.partial(audio_rope, m), grid,
                                         lambda g: (cfg.audio_tokens_at(g[0]),))
        self._cross_rope = PositionCache(functools.partial(cross_ropes, m), grid,
                                         lambda g: (*g, cfg.audio_tokens_at(g[0])))

    def forward(self, inputs):
        x, a, vmod, amod, y_in, ya_in = inputs
        y, ya = y_in, ya_in
        m, dev = self.cfg, x.device
        v, au = split_mod(vmod, mod_rows(m, False)), split_mod(amod, mod_rows(m, True))
        vp = (self.scale_shift_table + v["block"]).unbind(2)                 # (B, 1, D) each (image-to-video: 2)
        ap = (self.audio_scale_shift_table + au["block"]).unbind(2)
        grid, tokens = tuple(self.grid), a.shape[1]
        a_rope, cross = self._audio_rope.get((tokens,), dev), self._cross_rope.get((*grid, tokens), dev)
        video = math.prod(grid)
        start, stop = local_range(video, self.ctx)                  # this sp rank's video tokens (padding from S)
        cv_rope, ca_rope = rows(cross[:2], start, stop), cross[2:]
        k = first_frame_tokens(grid, start, x.shape[1])          # image-to-video: the conditioned frame's, here

        # 1. self-attention
        x = x + gate(self.attn1(modulate(rms(x), vp[1], vp[0], k)), vp[2], k)
        a = a + self.audio_attn1(modulate(rms(a), ap[1], ap[0]), None, a_rope) * ap[2]

        # 2. caption cross-attention (LTX-2.3: queries and caption modulated, output gated)
        if m.cross_attn_adaln:
            pv = (self.prompt_scale_shift_table + v["prompt"][:, :1]).unbind(2)        # one timestep a sample
            pa = (self.audio_prompt_scale_shift_table + au["prompt"]).unbind(2)
            y, ya = modulate(y, pv[1], pv[0]), modulate(ya, pa[1], pa[0])
        x = x + self._text(self.attn2, x, y, vp if m.cross_attn_mod else None, k)
        a = a + self._text(self.audio_attn2, a, ya, ap if m.audio_cross_attn_mod else None)

        # 3. audio-to-video and video-to-audio (both from the streams before either)
        nx, na = rms(x), rms(a)
        cv = (self.video_a2v_cross_attn_scale_shift_table[:4] + v["cross"]).unbind(2)    # a2v sc, sh, v2a sc, sh
        ca = (self.audio_a2v_cross_attn_scale_shift_table[:4] + au["cross"]).unbind(2)
        a2v_gate = (self.video_a2v_cross_attn_scale_shift_table[4:] + v["gate"])[:, :, 0]
        v2a_gate = (self.audio_a2v_cross_attn_scale_shift_table[4:] + au["gate"])[:, :, 0]
        x_new = x + gate(self.audio_to_video_attn(modulate(nx, cv[0], cv[1], k), modulate(na, ca[0], ca[1]),
                                                  cv_rope, ca_rope), a2v_gate, k)
        a = a + v2a_gate * self.video_to_audio_attn(modulate(na, ca[2], ca[3]), modulate(nx, cv[2], cv[3], k),
                                                    ca_rope, cv_rope, max(min(stop, video) - start, 0))
        x = x_new

        # 4. feed-forward
        x = x + gate(self.ff(modulate(rms(x), vp[4], vp[3], k)), vp[5], k)
        a = a + self.audio_ff(modulate(rms(a), ap[4], ap[3])) * ap[5]
        return x, a, vmod, amod, y_in, ya_in          # the caption's modulation is this block's own

    @staticmethod
    def _text(attn, h, c, p, k: int = 0):
        """Caption cross-attention of one stream; p: the block's modulation rows (LTX-2.3: queries at rows 6-8)."""
        q = rms(h) if p is None else modulate(rms(h), p[7], p[6], k)
        out = attn(q, c)
        return out if p is None else gate(out, p[8], k)
