"""Check that replicated (not tensor-parallel) parameters are bitwise equal on every tp rank.

Norms, adaLN modulation and embeddings are replicated across tp ranks; they stay equal only if every
rank sees identical gradients. A drift here means a missing all-reduce, so training checks it every
`train.check_replicas_every` steps and stops with the names of the parameters that differ.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.distributed.deepspeed.zero3 import local_data


@torch.no_grad()
def replica_mismatches(module: torch.nn.Module, ctx) -> list[str]:
    """Names of replicated parameters that differ from the tp group's first rank (same list on every rank)."""
    if ctx.tp_size == 1:
        return []
    src = ctx.get_tensor_model_parallel_src_rank()
    names, flags = [], []
    for name, p in module.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            continue
        local = local_data(p)                      # ZeRO-3: this rank's partition (same slice on tp peers)
        ref = local.clone()
        dist.broadcast(ref, src=src, group=ctx.tp_group)
        names.append(name)
        flags.append(float(not torch.equal(ref, local)))
    if not names:
        return []
    bad = torch.tensor(flags)
    dist.all_reduce(bad, group=ctx.tp_group)
    return [n for n, f in zip(names, bad.tolist()) if f > 0]
