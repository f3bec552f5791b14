"""Check that replicated (not tensor-parallel) tensors are equal on every tp rank.

Norms, adaLN modulation and embeddings are replicated across tp ranks; they stay equal only if every
rank sees identical gradients. A drift here means a missing all-reduce, so training checks it every
`train.check_replicas_every` steps (`replica_mismatches`, bitwise) and stops with the names of the parameters
that differ. The layout-free checkpoint copy asks the same of the replicated buffers (`checksum_mismatches`, by
CRC-32: parallel/checkpoints/relayout.py writes each tp rank's copy of one that differs).
"""
from __future__ import annotations

import zlib
from typing import Iterable

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


def checksum_mismatches(named: Iterable[tuple[str, torch.Tensor]], ctx) -> set[str]:
    """Names of the (replicated) tensors in `named` whose bytes differ between the ranks of the tp group, by CRC-32
    (same set on every rank): one all_gather_object of the digests, where replica_mismatches broadcasts each tensor,
    so any dtype (an fp8 base's codes, which gloo does not broadcast) on any device, copied to the host."""
    if ctx.tp_size == 1:
        return set()
    mine = {name: zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()) for name, t in named}
    everyone = [None] * ctx.tp_size
    dist.all_gather_object(everyone, mine, group=ctx.tp_group)
    return {name for name, crc in mine.items() if any(other.get(name) != crc for other in everyone)}
