"""Idle experts: which experts of a several-expert model (Wan 2.2 A14B, models/wan/experts.py) no sample of the
step's global batch chose, so that the update leaves them as they were (parallel/train/optim.py).

The model's routing stage counts the samples it sent to each expert (`routed_samples`, a list per expert) on the
ranks that run it: under the pipeline the first stage only, and every tp and sp rank of a data-parallel replica
alike. One all-reduce (max) over every rank before the update gives each rank the experts some rank routed a
sample to; the rest are idle. The counts are cleared at the start of each step, so validation forwards between
steps do not count.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def routers(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if hasattr(m, "routed_samples")]


def clear_routed(module: nn.Module) -> None:
    for m in routers(module):
        m.routed_samples[:] = [0] * len(m.routed_samples)


def idle_experts(module: nn.Module, experts: int, device) -> frozenset[int]:
    """The experts (of `experts`) no rank routed a sample to since `clear_routed` (a collective of every rank)."""
    seen = torch.zeros(experts, dtype=torch.int64)
    for m in routers(module):
        seen += torch.tensor(m.routed_samples, dtype=torch.int64)
    seen = seen.to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return frozenset(e for e, n in enumerate(seen.tolist()) if n == 0)
