"""HunyuanVideo's layers: dual-stream blocks, then single-stream blocks, one class (`HunyuanBlock`) so that
pipeline stages, recomputation and compilation treat the 60 as one list; and their adaLN-continuous head
(`FinalStage`). Shared: HunyuanVideo (models/hunyuanvideo/) and HunyuanVideo 1.5 (models/hunyuanvideo15/, every
block dual-stream) build their layers and head from here; `cfg` is either family's config
(models/hunyuanvideo/config.py, models/hunyuanvideo15/config.py).

Between layers flow x [B, L + S_vid, H] (text tokens first, then video tokens in (t, h, w) order; diffusers
orders them video first, which changes nothing: attention masks keys, not positions, and everything else is per
token) and temb [B, H + L] (the time embedding, then the text mask: 1.0 for a real row; the family's embed.py).
Attention skips the padding rows of the text as keys (HunyuanVideoPipeline's prompt_attention_mask).

Dual-stream block (HunyuanVideoTransformerBlock): text (c) and video tokens have their own weights:

    shift, scale, gate, shift_m, scale_m, gate_m = Linear(silu(temb))      (norm1 video, norm1_context text)
    q, k, v = qkv(LN(x) (1 + scale) + shift)  per stream;  RMSNorm_d(q), RMSNorm_d(k) per stream; rotary on video
    o = Attention(q, k, v) over all L + S_vid tokens;     x += gate * out(o)  per stream
    x += gate_m * FFN_gelu(LN(x) (1 + scale_m) + shift_m)  per stream

Single-stream block (HunyuanVideoSingleTransformerBlock): one set of weights, attention and MLP in parallel:

    shift, scale, gate = Linear(silu(temb));  h = LN(x) (1 + scale) + shift
    [q, k, v, m] = h W_in^T   (diffusers' to_q, to_k, to_v, proj_mlp);  RMSNorm_d on q, k; rotary on video
    x += gate * W_out [Attention(q, k, v); gelu(m)]

Tensor parallelism (p ranks): every q/k/v projection is column-parallel by heads, the FFN inputs by width,
the single block's fused [q, k, v, m] so that each rank holds its heads' q, k, v and 1/p of the MLP; every
output is row-parallel, the single block's W_out over its two input parts ([attention; MLP], split per part:
one all-reduce). The RMSNorms normalise one head's d channels with a weight all heads share (replicated:
copy_to_tp sums its gradient over the ranks' heads); the modulation linears are replicated.

Sequence parallelism: a rank holds S_pad / sp consecutive tokens; the dual block sends its text rows (the first
`n_txt` of the chunk) and video rows through their own weights; attention gathers the heads' full sequence
(Ulysses) or passes key/value chunks round the ring, rotating each token by its place in the sequence (the rotary
table has L rows of 1 + 0i in front); the text mask leaves the padding text rows out as keys on every path.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from models.embeddings import apply_rope_complex, rope_complex
from models.config import ModelConfig
from models.geometry import PositionCache, unpatchify
from parallel.distributed.comm import copy_to_tp
from parallel.distributed.layers import ColumnParallelLinear, RowParallelLinear
from parallel.distributed.sequence import SequenceAttention, gather_sequence, local_range, sp_size_of

EPS = 1e-6


def hunyuan_rope(axes: tuple[int, int, int], theta: float, lead: int, t: int, h: int, w: int) -> torch.Tensor:
    """HunyuanVideoRotaryPosEmbed as complex rotations [lead + t*h*w, d/2]: axis i rotates axes[i] channels
    by its integer position at theta^(-2j/axes[i]) (fp32, as get_1d_rotary_pos_embed); `lead` text rows 1 + 0i."""
    cos, sin = [], []
    for dim, n, shape in zip(axes, (t, h, w), ((t, 1, 1), (1, h, 1), (1, 1, w))):
        inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        f = torch.outer(torch.arange(n, dtype=torch.float32), inv).repeat_interleave(2, dim=1)   # (n, dim)
        f = f.reshape(*shape, dim).expand(t, h, w, dim).reshape(t * h * w, dim)
        cos.append(f.cos())
        sin.append(f.sin())
    return rope_complex(torch.cat(cos, dim=1), torch.cat(sin, dim=1), lead=lead)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm over each head's d channels, [B, S, n, d] (diffusers' RMSNorm(d): fp32 statistic)."""
    return (x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + EPS)).to(x.dtype) * weight


class JointAttention(nn.Module):
    """Attention over text + video tokens; q, k RMS-normalised per head (one weight per stream)."""

    def __init__(self, cfg: ModelConfig, grid, ctx, dual: bool):
        super().__init__()
        self.head_dim, self.ctx, self.grid, self.n_txt = cfg.head_dim, ctx, grid, cfg.max_text_len
        self.text_mask = cfg.text_mask                   # false (Open-Sora 2.0): every text row is a key
        self.norm_q, self.norm_k = nn.Parameter(torch.ones(self.head_dim)), nn.Parameter(torch.ones(self.head_dim))
        if dual:
            self.norm_added_q = nn.Parameter(torch.ones(self.head_dim))
            self.norm_added_k = nn.Parameter(torch.ones(self.head_dim))
        self._rope = PositionCache(functools.partial(hunyuan_rope, tuple(cfg.rope_axes_dim), cfg.rope_theta,
                                                     cfg.max_text_len), grid)
        self.core = SequenceAttention(ctx=ctx, tokens=self.tokens, prepare=self._prepare)

    def tokens(self) -> int:
        return self.n_txt + math.prod(self.grid.value)

    def qk_norm(self, q, k, n_txt: int):
        """RMSNorm q, k [B, S, n, d]: the text rows (the first n_txt) with norm_added_* in the dual block."""
        if not hasattr(self, "norm_added_q"):
            w = copy_to_tp(torch.stack([self.norm_q, self.norm_k]), self.ctx)
            return head_rms_norm(q, w[0]), head_rms_norm(k, w[1])
        w = copy_to_tp(torch.stack([self.norm_q, self.norm_k, self.norm_added_q, self.norm_added_k]), self.ctx)
        q = torch.cat([head_rms_norm(q[:, :n_txt], w[2]), head_rms_norm(q[:, n_txt:], w[0])], dim=1)
        k = torch.cat([head_rms_norm(k[:, :n_txt], w[3]), head_rms_norm(k[:, n_txt:], w[1])], dim=1)
        return q, k

    def forward(self, q, k, v, n_txt: int, keep: torch.Tensor):
        """q, k, v [B, S/sp, H/tp], keep [B, L] bool (real text rows) -> [B, S/sp, H/tp]."""
        q, k, v = (z.unflatten(-1, (-1, self.head_dim)) for z in (q, k, v))
        q, k = self.qk_norm(q, k, n_txt)
        return self.core(q, k, v, keep if self.text_mask else None).flatten(2)

    def _prepare(self, q, k, v, start: int):
        """Rotary positions of tokens start.. of text + video (the table's text rows are 1 + 0i): [B, s, n, d]
        each -> same. SequenceAttention then attends over the whole sequence or ring chunks, the padding text
        rows no key (`keep`; their own queries still attend, as diffusers')."""
        q, k = (z.transpose(1, 2) for z in (q, k))                                       # (B, n, s, d)
        freqs = self._rope.get(self.grid, q.device)[start:start + q.shape[2]]            # (s, d/2) complex
        q, k = apply_rope_complex(q, freqs), apply_rope_complex(k, freqs)
        return q.transpose(1, 2), k.transpose(1, 2), v


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """LN(x) (1 + scale) + shift, LayerNorm without affine (eps 1e-6); x [B, S, H], shift, scale [B, 1, H]."""
    return F.layer_norm(x, (x.shape[-1],), eps=EPS) * (1 + scale) + shift


class HunyuanBlock(nn.Module):
    """Block `index` of the list: dual-stream below cfg.num_dual_layers, single-stream from there on.
    (x [B, S, H], temb [B, H]) -> same, x updated."""

    indexed = True                           # parallel/model/build.py passes the block's index

    def __init__(self, cfg: ModelConfig, grid, ctx, index: int):
        super().__init__()
        self.cfg, self.grid, self.ctx = cfg, grid, ctx
        self.dual = index < cfg.num_dual_layers
        hid, ffn = cfg.hidden_size, cfg.ffn_size
        self.attn = JointAttention(cfg, grid, ctx, self.dual)
        if self.dual:
            self.norm1 = nn.Linear(hid, 6 * hid)
            self.norm1_context = nn.Linear(hid, 6 * hid)
            self.to_qkv = ColumnParallelLinear(hid, [hid, hid, hid], ctx=ctx)
            self.add_qkv = ColumnParallelLinear(hid, [hid, hid, hid], ctx=ctx)
            self.to_out = RowParallelLinear(hid, hid, ctx=ctx)
            self.to_add_out = RowParallelLinear(hid, hid, ctx=ctx)
            self.ff_in, self.ff_out = ColumnParallelLinear(hid, ffn, ctx=ctx), RowParallelLinear(ffn, hid, ctx=ctx)
            self.ff_context_in = ColumnParallelLinear(hid, ffn, ctx=ctx)
            self.ff_context_out = RowParallelLinear(ffn, hid, ctx=ctx)
        else:
            self.norm = nn.Linear(hid, 3 * hid)
            self.proj_in = ColumnParallelLinear(hid, [hid, hid, hid, ffn], ctx=ctx)     # q, k, v, MLP
            self.proj_out = RowParallelLinear([hid, ffn], hid, ctx=ctx)                # [attention; MLP]

    @property
    def n_txt(self) -> int:
        """Text tokens in this rank's chunk (all of them without sp; sp: text first, any padding last)."""
        start, stop = local_range(self.cfg.max_text_len + math.prod(self.grid.value), self.ctx)
        return min(max(self.cfg.max_text_len - start, 0), stop - start)

    def forward(self, inputs):
        x, side = inputs
        temb, keep = side[:, :x.shape[-1]], side[:, x.shape[-1]:] > 0.5                  # (B, H), (B, L)
        return (self._dual(x, temb, keep) if self.dual else self._single(x, temb, keep)), side

    def _dual(self, x, temb, keep):
        n, e = self.n_txt, F.silu(temb)
        txt, vid = x[:, :n], x[:, n:]
        mv = self.norm1(e)[:, None].chunk(6, dim=-1)                                     # (B, 1, H) each
        mc = self.norm1_context(e)[:, None].chunk(6, dim=-1)
        qv, kv, vv = self.to_qkv(modulate(vid, mv[0], mv[1])).chunk(3, dim=-1)            # (B, S_v, H/tp)
        qc, kc, vc = self.add_qkv(modulate(txt, mc[0], mc[1])).chunk(3, dim=-1)           # (B, n, H/tp)
        o = self.attn(*(torch.cat(pair, dim=1) for pair in ((qc, qv), (kc, kv), (vc, vv))), n, keep)
        txt = txt + self.to_add_out(o[:, :n]) * mc[2]
        vid = vid + self.to_out(o[:, n:]) * mv[2]
        txt = txt + self.ffn(modulate(txt, mc[3], mc[4]), self.ff_context_in, self.ff_context_out) * mc[5]
        vid = vid + self.ffn(modulate(vid, mv[3], mv[4]), self.ff_in, self.ff_out) * mv[5]
        return torch.cat([txt, vid], dim=1)

    def _single(self, x, temb, keep):
        shift, scale, gate = self.norm(F.silu(temb))[:, None].chunk(3, dim=-1)
        local = self.proj_in.local_parts                                                 # [H, H, H, F] / tp
        q, k, v, m = self.proj_in(modulate(x, shift, scale)).split(local, dim=-1)
        o = self.attn(q, k, v, 0, keep)
        return x + self.proj_out(torch.cat([o, self.mlp(m)], dim=-1)) * gate

    def ffn(self, h, ff_in, ff_out):
        """GELU (tanh) FFN (B, S, H) -> (B, S, H); a method so that selective recomputation can wrap it."""
        return ff_out(F.gelu(ff_in(h), approximate="tanh"))

    def mlp(self, m):
        """The single block's MLP activation gelu(m) (B, S, F/tp); recomputation's `mlp` part."""
        return F.gelu(m, approximate="tanh")


class FinalStage(nn.Module):
    """Video tokens -> LayerNorm * (1 + scale) + shift (from temb) -> proj_out -> unpatchify [B, C, T, H, W];
    with sp, this rank's tokens as patches [B, S_pad/sp, C*pt*p*p] (`assemble` makes the full prediction)."""

    def __init__(self, cfg: ModelConfig, grid, ctx=None):
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
