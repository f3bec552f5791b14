"""The differentiable regions that move activations across the tensor-parallel group, and a counter for them.

The four Megatron regions, for a tp group of size p and a tensor x:

    copy_to_tp      forward: identity          backward: all-reduce(grad)
    reduce_from_tp  forward: all-reduce(x)     backward: identity
    gather_from_tp  forward: all-gather(x, -1) backward: split(grad, -1)[tp_rank]
    scatter_to_tp   forward: split(x, -1)[r]   backward: all-gather(grad, -1)

Every collective is recorded (`_record`: `_all_reduce`, `_all_gather_last`, reduce_from_tp's `vdp::all_reduce` and
float8's `all_reduce_max`), so `count_comm()` sees all of them.

No forward returns a tensor that a collective wrote in place, or one that another step of the forward also
returned (`.contiguous()` of a contiguous tensor is that tensor): torch 2.11's dynamo adds an autograd Function's
intermediates to its compiled forward's outputs, and when one is the returned tensor under another name the
backward gets zeros for it (pytorch/pytorch#180642, fixed in 2.12; compiled tp 2 and Ulysses runs trained to other
losses, tests/distributed/test_compile_layouts.py). So reduce_from_tp is one operator, `vdp::all_reduce` (a new
tensor, its identity backward declared with it), and a split is always a copy.

With p == 1 they are identities and communicate nothing. A context with p > 1 and no tp_group is a planning
context (parallel/plan/trace.py builds the model at the layout's tp size on the meta device): there each
region returns what the collective would, in shape (an all-reduce its input, an all-gather p copies along
the last dim), and communicates nothing. None of the four keeps a tensor for backward, so autograd saves
there what it saves on a real rank; and the model sees the tp size it was built for.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


@dataclass
class CommCounter:
    """Collectives issued inside `count_comm()`: a list of (op, numel) in call order, and their tensors' shapes."""

    calls: list[tuple[str, int]] = field(default_factory=list)
    shapes: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)

    def count(self, op: str) -> int:
        return sum(1 for name, _ in self.calls if name == op)

    def numels(self, op: str) -> list[int]:
        return [n for name, n in self.calls if name == op]


_counters: list[CommCounter] = []


@contextlib.contextmanager
def count_comm():
    counter = CommCounter()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def _record(op: str, x: torch.Tensor) -> None:
    for counter in _counters:
        counter.calls.append((op, x.numel()))
        counter.shapes.append((op, tuple(x.shape)))


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    _record("all_reduce", x)
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


@torch.library.custom_op("vdp::all_reduce", mutates_args=())
def _summed(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """x summed over the group, in a new contiguous tensor. An operator, so dynamo records one call instead of
    tracing an in-place all-reduce (module docstring); the group by name, as an operator takes no group object."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=c10d._resolve_process_group(group_name))
    return out


@_summed.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# reduce_from_tp's backward: every rank's output is the same sum, so each input's gradient is the output's
_summed.register_autograd(lambda ctx, grad: (grad, None))


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    """The elementwise MAX of `x` over `group`, in place on a contiguous copy (float8 amaxes, parallel/distributed/
    float8.py); counted as "all_reduce_max"."""
    _record("all_reduce_max", x)
    x = x.contiguous()
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def _all_gather_last(x: torch.Tensor, group, size: int) -> torch.Tensor:
    _record("all_gather", x)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def _split_last(x: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """This rank's slice of the last dim, always a copy (a contiguous slice's `.contiguous()` would be the slice)."""
    return x.chunk(size, dim=-1)[rank].clone(memory_format=torch.contiguous_format)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, rank):
        ctx.size, ctx.rank = size, rank
        return _all_gather_last(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.size, ctx.rank), None, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, rank):
        ctx.group, ctx.size = group, size
        return _split_last(x, size, rank)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last(grad, ctx.group, ctx.size), None, None, None


def _planning(ctx) -> bool:
    return ctx.tp_group is None          # tp_size > 1 here: a planning context (module docstring)


def copy_to_tp(x: torch.Tensor, ctx) -> torch.Tensor:
    if ctx.tp_size == 1 or _planning(ctx):
        return x
    return _CopyToTP.apply(x, ctx.tp_group)


def reduce_from_tp(x: torch.Tensor, ctx) -> torch.Tensor:
    if ctx.tp_size == 1 or _planning(ctx):
        return x
    _record("all_reduce", x)
    return _summed(x, ctx.tp_group.group_name)


def gather_from_tp(x: torch.Tensor, ctx) -> torch.Tensor:
    if ctx.tp_size == 1:
        return x
    if _planning(ctx):
        return torch.cat([x] * ctx.tp_size, dim=-1)
    return _GatherFromTP.apply(x, ctx.tp_group, ctx.tp_size, ctx.tp_rank)


def scatter_to_tp(x: torch.Tensor, ctx) -> torch.Tensor:
    if ctx.tp_size == 1:
        return x
    if _planning(ctx):
        return _split_last(x, ctx.tp_size, ctx.tp_rank)
    return _ScatterToTP.apply(x, ctx.tp_group, ctx.tp_size, ctx.tp_rank)


def gather_shards(shard: torch.Tensor, ctx, dim: int, parts: list[int] | None = None) -> torch.Tensor:
    """Reassemble a tp-sharded tensor (for export and tests, not the training path).

    `parts` lists the local sizes of fused outputs along `dim` ([q, k, v] shards): each part is
    concatenated over ranks separately, then the parts in order.
    """
    shards = [torch.empty_like(shard) for _ in range(ctx.tp_size)]
    dist.all_gather(shards, shard.contiguous(), group=ctx.tp_group)
    if not parts or len(parts) == 1:
        return torch.cat(shards, dim=dim)
    split = [s.split(parts, dim=dim) for s in shards]
    return torch.cat([torch.cat([pieces[i] for pieces in split], dim=dim) for i in range(len(parts))], dim=dim)
