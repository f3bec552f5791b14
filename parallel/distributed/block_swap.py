"""Block swap (train.block_swap: N): the frozen base of N blocks kept in host memory and copied to the device for
each use, the next block's on a side stream while the current one computes.

What moves: the weights of each swapped block's linear layers, tensor-parallel ones (this tp rank's shard; the fp8
base's weight and its scale) and plain ones (adaLN modulation: HunyuanVideo's and Open-Sora 2.0's norm1 linears,
CogVideoX's): over 99% of a block's bytes (`swappable_bytes`; with LoRA rank 32 Wan 2.1 14B 99.2%, HunyuanVideo
99.7%, CogVideoX-5B 99.4%).
Biases, norms, modulation tables and LoRA's adapters stay on the device: the optimizer steps the adapters there,
and the rest are vectors. A swapped layer's `weight` is the host tensor itself (pinned where the accelerator pins),
so state dicts, checkpoints and exports read it there.

Use: a swapped layer computes y = x W^T + b through `_HostLinear`, which fetches W for the call and saves no W:
its backward, dx = dy W, fetches W again. Neither the autograd graph nor a checkpoint then holds a swapped
weight, with or without recomputation, and the device holds copies of at most two swapped blocks:

    fetch(i)     the copy of block i started ahead (or now); the compute stream waits for it; every other
                 copy is released (its memory reused by work queued after it: stream order), then block i + d's
                 copy starts on the side stream (d = +1 forward, -1 backward)
    direction    a backward call says -1; a forward call of a block before the one fetched last is a recompute
                 in backward (-1), after it a forward (+1); `chain(forward)` starts each forward at block 0,
                 fetching it while the stage's embed and unswapped blocks compute

So a block's copy arrives while the block before it (forward) or after it (backward, and its recompute) computes;
a micro-batch copies 2N - 1 blocks (the last one serves its forward and its backward).

Layouts: each tp rank swaps its own shards; N counts per pipeline stage (parallel/model/build.py swaps each stage's last
N blocks, a pipeline's micro-batches each starting with `chain`); ZeRO 0-2 (ZeRO-3 owns every parameter, the
frozen base too: the checker refuses the pair and points at its offload_param).

The stage module's `.to(device)` (deepspeed.initialize) leaves the moved tensors on the host, in the dtype it asks
for (`keep_on_host`, called by parallel/distributed/pipeline.py's HostResident); a load_state_dict into a swapped
layer drops the device copies.
On CPU the host is the device: the host tensor is a storage of its own and each fetch copies it again
(accelerator.copy_to_device(fresh=True)), so the same code runs, and is tested, there.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallel.distributed import accelerator
from parallel.distributed.layers import ColumnParallelLinear, RowParallelLinear, dequantise_fp8

MOVED = ("weight", "weight_scale")          # a tensor-parallel linear layer's base: W (fp8: W8) and its scale


def base_layers(block: nn.Module) -> list[nn.Module]:
    """The linear layers of `block` (tensor-parallel or plain) whose weight is frozen: what block swap moves."""
    return [m for m in block.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear, nn.Linear))
            and not m.weight.requires_grad]


def moved_tensors(layer: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, getattr(layer, name)) for name in MOVED if getattr(layer, name, None) is not None]


def swappable_bytes(block: nn.Module) -> int:
    """Bytes block swap moves to the host for `block` (the planner's per-block figure; meta or real)."""
    return sum(t.numel() * t.element_size() for layer in base_layers(block) for _, t in moved_tensors(layer))


@dataclass
class _Copy:
    """One block's device copy: per layer (W, scale or None), the event recorded after its last copy."""

    tensors: list
    event: object
    ready: bool = False


class _HostLinear(torch.autograd.Function):
    """y = x W^T + b with W fetched from the host for the call, again in backward (dx = dy W); saves no W."""

    @staticmethod
    def forward(ctx, x, bias, swap, pos, slot):
        ctx.swap, ctx.where, ctx.dtype = swap, (pos, slot), x.dtype
        return F.linear(x, swap.weight(pos, slot, x.dtype), bias)

    @staticmethod
    def backward(ctx, dy):
        dx = dy.matmul(ctx.swap.weight(*ctx.where, ctx.dtype, backward=True)) if ctx.needs_input_grad[0] else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return dx, db, None, None, None


class BlockSwap:
    """The swapped blocks of one stage, in forward order: their bases moved to host memory on construction.
    `in_place` (the planner's meta trace): nothing moves, a fetch hands the layers' own tensors, so a traced block
    saves what a swapped one does. `dtype`: the run's parameter dtype (bf16), which the moved fp32 parameters take
    before they are pinned, as DeepSpeed's cast would give them later (the same rounding): an fp32 pinned copy
    beside the bf16 one, 1.5x the swapped bytes for the 14B, would stay in torch's pinned-memory cache."""

    def __init__(self, blocks: Sequence[nn.Module], in_place: bool = False, dtype: Optional[torch.dtype] = None):
        self.units, self.in_place = [base_layers(block) for block in blocks], in_place
        for pos, layers in enumerate(self.units):
            for slot, layer in enumerate(layers):
                for _, t in moved_tensors(layer) if not in_place else ():
                    cast = dtype is not None and isinstance(t, nn.Parameter) and t.dtype == torch.float32
                    t.data = accelerator.host_copy(t.data.to(dtype) if cast else t.data)
                if isinstance(layer, nn.Linear):          # torch's layer: its forward, for this instance
                    layer.forward = functools.partial(self._plain_linear, layer, pos, slot)
                else:                                     # the toolkit's: base_linear asks
                    layer.host_base = (self, pos, slot)
                layer.register_load_state_dict_post_hook(self._loaded)
        self._stream = None
        self._copies: dict[int, _Copy] = {}
        self._current: Optional[int] = None
        self._direction = 1

    @property
    def stream(self):
        if self._stream is None:
            self._stream = accelerator.side_stream()
        return self._stream

    def _copy(self, pos: int) -> _Copy:
        if self.in_place:
            return _Copy([(layer.weight, getattr(layer, "weight_scale", None)) for layer in self.units[pos]], None)
        device, event, tensors = accelerator.current_device(), None, []
        for layer in self.units[pos]:
            pair = []
            for name in MOVED:
                t = getattr(layer, name, None)
                if t is not None:
                    t, event = accelerator.copy_to_device(t, device, self.stream, fresh=True)
                pair.append(t)
            tensors.append(tuple(pair))
        return _Copy(tensors, event)

    def _keep(self, pos: int, ahead: int) -> None:
        """Copies of `pos` and `ahead`: every other one released first, then those not under way started."""
        wanted = [p for p in (pos, ahead) if 0 <= p < len(self.units)]
        self._copies = {p: self._copies[p] for p in wanted if p in self._copies}
        for p in wanted:
            if p not in self._copies:
                self._copies[p] = self._copy(p)

    def fetch(self, pos: int, backward: bool = False) -> list:
        """Block `pos`'s device tensors, per layer (W, scale or None); the next block's copy started."""
        current = self._current
        direction = -1 if backward else self._direction if current is None or pos == current else \
            (1 if pos > current else -1)
        if pos != current or direction != self._direction:
            self._current, self._direction = pos, direction
            self._keep(pos, pos + direction)
        copy = self._copies[pos]
        if not copy.ready:
            accelerator.wait_for(copy.event)
            copy.ready = True
        return copy.tensors

    def weight(self, pos: int, slot: int, dtype: torch.dtype, backward: bool = False) -> torch.Tensor:
        """One layer's W on the device, in `dtype` when it is the fp8 base (dequantised)."""
        w, scale = self.fetch(pos, backward)[slot]
        return w if scale is None else dequantise_fp8(w, scale, dtype)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor], pos: int, slot: int) -> torch.Tensor:
        return _HostLinear.apply(x, bias, self, pos, slot)

    def storages(self) -> set[int]:
        """Storage keys of what block swap holds: the host tensors and the device copies under way (the memory
        probe leaves them out of the device's model states; the plan has them on the host and their own line)."""
        moved = [t for layers in self.units for layer in layers for _, t in moved_tensors(layer)]
        copies = [t for copy in self._copies.values() for pair in copy.tensors for t in pair if t is not None]
        return {t.untyped_storage()._cdata for t in moved + copies}

    def _plain_linear(self, layer: nn.Linear, pos: int, slot: int, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, layer.bias, pos, slot)

    def start(self) -> None:
        """A forward begins: block 0's copy started (kept if under way), every other one released."""
        self._current, self._direction = None, 1
        self._keep(0, -1)

    def chain(self, forward: Callable) -> Callable:
        """forward, each call starting at block 0 (`start`)."""
        @functools.wraps(forward)
        def run(*args, **kwargs):
            self.start()
            return forward(*args, **kwargs)
        return run

    def forget_copies(self) -> None:
        """The host tensors were written (a checkpoint read into them): the device copies are stale, dropped."""
        self._copies, self._current = {}, None

    def _loaded(self, module, incompatible_keys) -> None:
        """A state dict was loaded into a swapped layer (DeepSpeed's own checkpoint load)."""
        self.forget_copies()

    def keep_on_host(self, fn: Callable, apply: Callable, module: nn.Module) -> nn.Module:
        """`module._apply(fn)` (`apply`: torch's) with the moved tensors held out of it: each stands in as an empty
        tensor meanwhile, and takes back its data in host memory, converted to the dtype `fn` gave the stand-in
        (deepspeed.initialize's `.to(device)` moves none of them; its bf16 cast, made before, is pinned again here)."""
        held = []
        for layer in (layer for layers in self.units for layer in layers):
            for name, t in moved_tensors(layer):
                held.append((layer, name, t.data))
                t.data = t.data.new_empty(0)
        try:
            apply()
        finally:
            while held:                            # each old copy let go as its new one is made
                layer, name, data = held.pop()
                t = getattr(layer, name)           # the same tensor, or the one fn made (overwrite on conversion)
                t.data = data if t.dtype == data.dtype and accelerator.is_host_copy(data) \
                    else accelerator.host_copy(data.to(t.dtype))
                del data
            self._copies, self._current = {}, None
        return module
