"""How an experiment's model splits: the tp sizes its dimensions take, the sp sizes and (Ulysses, ring) pairs
its heads and frames take, and the ring size a run uses. Pure arithmetic on the config, below every command:
the checker (parallel/check.py) reports against it, the planner's search (parallel/plan/search.py) enumerates
with it."""
from __future__ import annotations

import math
from typing import Optional

from models.config import ModelConfig
from models.registry import ring_fits as _ring_fits
from models.registry import ring_frames as _ring_frames
from parallel.experiment.config import ExperimentConfig
from parallel.distributed.sequence import sp_pairs as _sp_pairs


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_split_dims(model: ModelConfig) -> dict[str, int]:
    """Dimensions tensor parallelism splits: heads (QKV columns, attention-out rows) and the FFN width.

    hidden_size = num_heads x head_dim is split through the heads; norms, adaLN modulation, the time
    embedding and the text projection are replicated, so they impose nothing. The stdit family splits
    the same three: its spatial and temporal self-attention (QKV, out) and cross-attention (Q from the
    video tokens, K and V from the text, out) by heads, each num_heads x head_dim wide, and its MLP
    by ffn_hidden_size; scale_shift_tables, t_block, the caption MLP and the final layer are replicated.
    A family with a second stream adds its own (`ModelConfig.tp_splits`: LTX-2's audio heads and width).
    """
    return {"model.num_heads": model.num_heads, "model.hidden_size": model.hidden_size,
            "model.ffn_hidden_size": model.ffn_size, **model.tp_splits()}


def valid_tp_sizes(model: ModelConfig) -> list[int]:
    return divisors(math.gcd(*tp_split_dims(model).values()))


def valid_sp_sizes(cfg: ExperimentConfig) -> list[int]:
    """sp sizes that divide the heads of one tp rank (any token count works: it is padded); with ring attention
    (a family whose attention takes it) any sp size works: `sp_pairs`. A family whose ring splits whole frames
    adds the Ulysses x ring sizes its frames and tokens allow (up to heads x frames)."""
    heads, tp = cfg.model.num_heads, cfg.parallel.tp_size
    if heads % tp:
        return [1]
    frames = ring_frames(cfg)
    if frames is None:
        return divisors(heads // tp)
    return [s for s in range(1, heads // tp * frames[0] + 1) if sp_pairs(cfg, s)]


def ring_capable(cfg: ExperimentConfig) -> bool:
    """Whether the family's self-attention runs under ring attention (full attention over the sequence, or
    attention within frames and positions: `ring_fits`)."""
    return getattr(type(cfg.model), "RING_ATTENTION", True)


def ring_frames(cfg: ExperimentConfig) -> Optional[tuple[int, int]]:
    """(latent frames, tokens) for a family whose ring splits whole frames (STDiT), else None."""
    return _ring_frames(cfg.model, cfg.data)


def ring_fits(cfg: ExperimentConfig, sp: int, ring: int) -> bool:
    """Whether ring attention of `ring` ranks (of sp) runs on this model (models.registry.ring_fits)."""
    return _ring_fits(cfg.model, cfg.data, sp, ring)


def sp_pairs(cfg: ExperimentConfig, sp: Optional[int] = None, tp: Optional[int] = None) -> list[tuple[int, int]]:
    """Every (ulysses, ring) with ulysses x ring = sp (parallel.sp_size) that this model takes at tp
    (parallel.tp_size): Ulysses must divide the heads of a tp rank; ring takes any head count, and any token
    count (padded) where the attention is full attention (whole frames for STDiT: `ring_fits`)."""
    sp = cfg.parallel.sp_size if sp is None else sp
    heads, tp = cfg.model.num_heads, cfg.parallel.tp_size if tp is None else tp
    return [] if heads % tp else [(u, r) for u, r in _sp_pairs(heads // tp, sp, ring_capable(cfg))
                                  if ring_fits(cfg, sp, r)]


def ring_size(cfg: ExperimentConfig) -> int:
    """parallel.ring_size, or when null all Ulysses where it divides the heads of a tp rank, ring for the rest."""
    p = cfg.parallel
    if p.ring_size is not None:
        return p.ring_size
    return min((r for _, r in sp_pairs(cfg)), default=1) if p.sp_size > 1 else 1
