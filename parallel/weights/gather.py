"""Full tensors from any layout: the one gather every exporter and every equivalence test uses.

A rank holds its pipeline stage's parameters, tensor-parallel ones as shards, and under ZeRO-3 a
partition of each. `full_tensors` yields (canonical name, full fp32 CPU tensor) one at a time, so an
exporter never holds more than one full tensor beyond what it writes; `full_state` collects them.
"""
from __future__ import annotations

import sys
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from parallel.distributed.comm import gather_shards
from parallel.distributed.layers import marked_buffers, own_marks
from parallel.distributed.pipeline import canonical_name


def model_tensors(module: nn.Module, num_blocks: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) of every parameter and persistent buffer this rank holds, as they are: what the
    readers of released weights fill in place (parallel/weights/diffusers.py, opensora.py)."""
    yield from ((canonical_name(n, num_blocks), p) for n, p in module.named_parameters())
    yield from ((canonical_name(n, num_blocks), b) for n, b in module.named_buffers())


def format_shapes(m, shapes: Callable) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a weights format with its shape for model section `m`: `shapes(canonical name, full
    shape, m)` -> {its name: shape} over the model's tensors (the model built on the meta device)."""
    from parallel.model.build import layer_specs
    from parallel.experiment.config import ExperimentConfig
    from parallel.distributed.pipeline import SequentialDiT
    from parallel.distributed.topology import ParallelContext
    with torch.device("meta"):
        model = SequentialDiT(layer_specs(ExperimentConfig(model=m), ParallelContext.single()))
    out = {}
    for name, t in model_tensors(model, m.num_layers):
        out.update(shapes(name, tuple(t.shape), m))
    return out


@torch.no_grad()
def full_tensors(module: nn.Module, ctx, num_blocks: int, value: Optional[Callable] = None, zero3: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's parameters (or `value(param)`, e.g. their EMA: parallel.weights.ema.full_ema) and buffers as
    full fp32 CPU tensors with canonical names, one at a time (the fp8 base's weight: its fp8 codes, as fp32).

    Tensor-parallel shards are gathered over the tp group, so every rank of it calls. `zero3`: each
    parameter is gathered from its ZeRO-3 partitions while it is read (a `value` gathers by itself).
    """
    for name, p in module.named_parameters():
        if zero3 and value is None:
            import deepspeed
            with deepspeed.zero.GatheredParameters([p]):
                t = p.detach().float().clone()
        else:
            t = (p if value is None else value(p)).detach().float()
        yield canonical_name(name, num_blocks), _full(t, own_marks(p), ctx)
    for name, b, marks in marked_buffers(module):         # replicated, but the fp8 base's weights (layers.tp_marks)
        yield canonical_name(name, num_blocks), _full(b.detach().float(), marks, ctx)


def _full(t: torch.Tensor, marks: dict, ctx) -> torch.Tensor:
    """`t` whole on the host: a tensor-parallel shard (its TP_MARKS) gathered over the tp group first."""
    if marks.get("tensor_model_parallel") and ctx.tp_size > 1:
        t = gather_shards(t, ctx, marks["partition_dim"], marks.get("tp_parts"))
    return t.cpu().clone()


def exporting(tensors: Iterator[tuple[str, torch.Tensor]], module: nn.Module, show: bool
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """`full_tensors` with a progress bar on stderr where `show` (one rank: the gathers are collective, so every
    rank advances together)."""
    from tqdm import tqdm
    total = sum(1 for _ in module.parameters()) + sum(1 for _ in module.buffers())
    return tqdm(tensors, total=total, desc="exporting", unit="tensor", file=sys.stderr, dynamic_ncols=True,
                disable=not show)


def full_state(module: nn.Module, ctx, num_blocks: int, value: Optional[Callable] = None, zero3: bool = False
               ) -> dict[str, torch.Tensor]:
    """`full_tensors` as a dict: what load_state_dict of the one-process model takes."""
    return dict(full_tensors(module, ctx, num_blocks, value, zero3))
