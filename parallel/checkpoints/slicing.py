"""How a tensor-parallel shard sits in the full tensor, and how new shards are cut from old ones: the slice
arithmetic of the layout-free checkpoint copy (parallel/checkpoints/relayout.py), pure (no process group, no file;
tests/unit/test_relayout.py holds it against the layers' own slicing).

A tensor is split along one dim into fused parts ([q, k, v], or one part) of full sizes n_k, each cut alike:

    shard r of a part of full size n (tp size p) holds [r n/p, (r+1) n/p) of it, parts concatenated in
    order, so new shard r' of part k is the union of its overlaps with old shards r = 0..p_old-1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from parallel.distributed.deepspeed.zero3 import full_shape
from parallel.distributed.layers import own_marks


@dataclass(frozen=True)
class Slicing:
    """How a rank's tensor sits in the full one: split along `dim` (None: whole) into `parts` (full sizes
    of the fused parts along dim), this being shard `tp_rank` of `tp_size`."""

    dim: Optional[int]
    parts: tuple[int, ...]
    tp_size: int
    tp_rank: int

    @property
    def whole(self) -> bool:
        return self.dim is None or self.tp_size == 1

    def intervals(self) -> list[tuple[int, int, int]]:
        """(full start, length, local start) along dim of each part this shard holds, in local order."""
        out, local, base = [], 0, 0
        for n in self.parts:
            k = n // self.tp_size
            out.append((base + self.tp_rank * k, k, local))
            local, base = local + k, base + n
        return out

    def to_json(self) -> dict:
        return {"dim": self.dim, "parts": list(self.parts), "tp_size": self.tp_size, "tp_rank": self.tp_rank}

    @classmethod
    def from_json(cls, d: dict) -> "Slicing":
        return cls(d["dim"], tuple(d["parts"]), d["tp_size"], d["tp_rank"])


def local_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """The rank's (tp shard) shape, also under ZeRO-3 where `param` itself is an empty partition."""
    return tuple(full_shape(param))


def slicing_of(param: torch.Tensor, tp_size: int, tp_rank: int, marks: Optional[dict] = None) -> Slicing:
    """A tensor's Slicing from the marks parallel/distributed/layers.py sets (tensor_model_parallel,
    partition_dim, tp_parts = the local sizes of the fused parts): the tensor's own, or `marks` (a buffer's,
    layers.tp_marks)."""
    marks = own_marks(param) if marks is None else marks
    if not marks.get("tensor_model_parallel", False):
        return Slicing(None, (), tp_size, tp_rank)
    dim = marks["partition_dim"]
    local = marks.get("tp_parts") or [local_shape(param)[dim]]
    return Slicing(dim, tuple(n * tp_size for n in local), tp_size, tp_rank)


Reader = Callable[[Optional[int], int, int], torch.Tensor]     # (dim, start, length) -> slice; dim None: all


def assemble(target: Slicing, shape: tuple[int, ...], pieces: list[tuple[Slicing, Reader]]) -> torch.Tensor:
    """The tensor of `shape` that `target` describes, in the stored dtype, from stored shards (their Slicing and a
    reader of slices along their dim). A whole stored tensor is sliced directly; split ones are overlapped part by
    part. Several whole ones (a replicated tensor that differed between the tp ranks, each writing its own): the one
    of target's tp rank, at the tp size they were written at only."""
    whole = [read for s, read in pieces if s.whole]
    split = [(s, read) for s, read in pieces if not s.whole]
    if len(whole) > 1:
        whole = [read for s, read in pieces if (s.tp_size, s.tp_rank) == (target.tp_size, target.tp_rank)]
        if len(whole) != 1:
            sizes = sorted({s.tp_size for s, _ in pieces})
            raise ValueError(f"it differs between the tp ranks that wrote it at tp {sizes[0]} (an fp8 base scaled per "
                             f"tp shard, by a run started before the scale spanned the full weight), so it is read "
                             f"back at that tp only: resume at parallel.tp_size={sizes[0]}, not {target.tp_size}")
    dim = target.dim if not target.whole else (split[0][0].dim if split else None)
    if dim is None or (target.whole and whole):
        return whole[0](None, 0, 0).reshape(shape)
    wanted = target.intervals() if not target.whole else [(0, shape[dim], 0)]
    out = None

    def put(local: int, piece: torch.Tensor) -> None:
        nonlocal out
        out = torch.empty(shape, dtype=piece.dtype) if out is None else out
        out.narrow(dim, local, piece.shape[dim]).copy_(piece)
    if whole:
        for start, n, local in wanted:
            put(local, whole[0](dim, start, n))
        return out
    filled = 0
    for start, n, local in wanted:
        for old, read in split:
            for o_start, o_n, o_local in old.intervals():
                a, b = max(start, o_start), min(start + n, o_start + o_n)
                if a < b:
                    put(local + a - start, read(dim, o_local + a - o_start, b - a))
                    filled += b - a
    if filled != shape[dim]:
        raise ValueError(f"the stored shards cover {filled} of {shape[dim]} entries along dim {dim}")
    return out

