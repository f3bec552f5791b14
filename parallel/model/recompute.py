"""Selective activation checkpointing and activation compression of a built model's blocks.

`apply_recompute(model, cfg)` (called by parallel/model/build.py after the model is built, pp = 1 or pipeline
stages alike) changes the family's layer modules in place, found by class, numbered by their canonical
name `blocks.{i}`:

- `train.recompute: {granularity, every}`: in blocks i with i % every == 0, wrap either the whole block
  (it keeps only its input x, LTX-2's x and audio stream; the side tensors go around the checkpoint as in
  checkpoint_x_only) or the
  parts the family names in `FamilySpec.network.recompute_parts` ("attention": the attention core, whose inputs
  q, k, v are kept and whose scores / softmax statistics and rotary are recomputed, with the q/k norms where
  the family's core holds them (CogVideoX, STDiT; Wan normalises q, k before its core); "mlp": the
  feed-forward network, which keeps its input and recomputes the S x F hidden activations).
  The checkpoint is torch's non-reentrant one with the RNG state restored, so any dropout would draw the
  same mask; the tp / sp collectives inside a region run again in backward, in the same order on every
  rank of their group, so their results are identical.
- `train.activation_compression: {dtype}`: every block's forward runs under
  `torch.autograd.graph.saved_tensors_hooks` that store each saved activation at lower precision (fp32 ->
  bf16; fp8: fp32 / bf16 -> float8 e4m3 with one fp32 scale, amax / 448) and cast it back in backward.
  Parameters (and their views), buffers and cached tables are not activations and are left alone.
- `train.offload_activations`: each checkpoint's kept activations (a block's x, the core's q, k, v, the MLP's
  input) go to pinned host memory and come back ahead of the backward (parallel/distributed/offload.py).

The inputs a checkpoint keeps are not saved through autograd by torch's checkpoint, so saved-tensor hooks
(the planner's tracer, parallel/train/probe.py) would not see them: `_Keep` saves them explicitly, which
costs nothing (they are held anyway) and makes every byte a block keeps visible to one instrument.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.registry import family
from parallel.experiment.config import ConfigError, ExperimentConfig
from parallel.distributed.offload import HostOffload

FP8_MAX = 448.0                 # largest finite float8 e4m3fn value
TARGETS = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
_kept: set[int] = set()         # storages `_Keep` is saving right now: compression must leave them as they are


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Keep(torch.autograd.Function):
    """Identity that saves its inputs for backward: what a checkpoint keeps, made visible to saved-tensor hooks."""

    @staticmethod
    def forward(ctx, *xs):
        ctx.save_for_backward(*xs)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        return grads


def keep(*xs: torch.Tensor) -> tuple:
    keys = {_storage(x) for x in xs}
    _kept.update(keys)
    try:
        return _Keep.apply(*xs)
    finally:
        _kept.difference_update(keys)


def checkpointed(fn: Callable, offload: Optional[HostOffload] = None, moved: Optional[int] = None) -> Callable:
    """fn(*args) recomputed in backward; floating tensor arguments are kept (`_Keep`), the rest passed as is.
    `offload` (train.offload_activations): the kept activations go to host memory, all of them or the first
    `moved` arguments."""
    @functools.wraps(fn)
    def run(*args):
        where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        chosen = [args[i] for i in where[:moved] if is_activation(args[i])] if offload is not None else []
        with offload.scope(chosen) if chosen else contextlib.nullcontext():
            args = list(args)
            for i, kept in zip(where, keep(*(args[i] for i in where)) if where else ()):
                args[i] = kept
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
    return run


def checkpointed_block(forward: Callable, offload: Optional[HostOffload] = None, streams: int = 1) -> Callable:
    """A stage-tuple block recomputed for x only (its first `streams` tensors: LTX-2's x and audio stream); the
    side tensors pass around it (see checkpoint_x_only) and, shared by the stage's blocks, stay on the device
    under `offload`."""
    def run(inputs):
        hidden, rest = inputs[:streams], inputs[streams:]
        out = checkpointed(lambda *h: forward(h)[:streams], offload, moved=streams)(*hidden, *rest)
        return (*out, *rest)
    return run


def is_activation(t: torch.Tensor) -> bool:
    """A saved tensor produced by the forward (or a leaf activation such as a pipeline stage's received
    input): not a parameter, a view of one, a buffer or a cached table (leaves without grad)."""
    base = t._base if t._base is not None else t
    return not (base.is_leaf and (isinstance(base, nn.Parameter) or not base.requires_grad))


def compressed_dtype(t: torch.Tensor, dtype: str) -> Optional[torch.dtype]:
    """The dtype `t` is stored in under compression `dtype`, or None when it stays as it is."""
    if not t.is_floating_point() or not is_activation(t):
        return None
    target = TARGETS[dtype]
    return target if t.element_size() > target.itemsize else None


def packed_nbytes(t: torch.Tensor, dtype: str) -> int:
    """Bytes `t`'s storage takes once saved under compression `dtype` (the planner counts with this)."""
    target = compressed_dtype(t, dtype)
    whole = t.untyped_storage().nbytes()
    if target is None:
        return whole
    return t.numel() * target.itemsize + (4 if target == torch.float8_e4m3fn else 0)


class Compression:
    """saved_tensors_hooks pack / unpack storing activations as `dtype`. `on_pack(original, packed)` (tests,
    bench) sees each saved tensor and what is stored for it."""

    def __init__(self, dtype: str, on_pack: Optional[Callable] = None):
        self.dtype, self.on_pack = dtype, on_pack

    def pack(self, t: torch.Tensor):
        target = None if _storage(t) in _kept else compressed_dtype(t, self.dtype)
        if target is None:
            packed = t
        elif target == torch.float8_e4m3fn:
            # Per-tensor scale: e4m3 keeps 3 mantissa bits over [2^-9, 448]; amax -> 448.
            scale = (t.detach().abs().amax().float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
            packed = ((t.detach().float() / scale).to(target), scale, t.dtype)
        else:
            packed = (t.detach().to(target), None, t.dtype)
        if self.on_pack is not None:
            self.on_pack(t, packed)
        return packed

    @staticmethod
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        data, scale, dtype = packed
        return data.to(dtype) if scale is None else (data.float() * scale).to(dtype)

    def wrap(self, forward: Callable) -> Callable:
        @functools.wraps(forward)
        def run(*args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                return forward(*args, **kwargs)
        return run


def _resolve(root: nn.Module, path: str) -> tuple[object, str]:
    *parents, name = path.split(".")
    for p in parents:
        root = getattr(root, p)
    return root, name


def layers_of(model: nn.Module, cfg: ExperimentConfig) -> list[tuple[int, nn.Module]]:
    """(block index, module) of the family's layers this process holds (pp: its stage's), in order."""
    layer = family(cfg.model).network.layer
    found = []
    for name, module in model.named_modules():
        if isinstance(module, layer):
            # SequentialDiT: `blocks.{i}`; DiTPipeline: `{i + 1}` (the pipeline layer index, embed being 0); a
            # layer of several experts (FamilySpec.experts) holds one per expert (`blocks.{i}.experts.{e}`).
            parts = name.split(".")
            found.append((int(parts[1]) if parts[0] == "blocks" else int(parts[0]) - 1, module))
    return found


def wrap_layer(layer: nn.Module, parts: dict, granularity: Optional[str], compression: Optional[str],
               on_pack: Optional[Callable] = None, offload: Optional[HostOffload] = None,
               streams: int = 1) -> nn.Module:
    """Checkpoint `granularity` (None: nothing) of one family layer and/or compress what it saves; `offload`:
    the checkpoint's kept inputs in host memory; `streams`: the family's (Network.streams)."""
    if granularity == "block":
        layer.forward = checkpointed_block(layer.forward, offload, streams)
    elif granularity is not None:
        if granularity not in parts:
            raise ConfigError(f"train.recompute.granularity={granularity}: this family names no such part; use "
                              f"block or one of {sorted(parts)}")
        # A stage of several experts' layers (`expert_layers`, models/wan/experts.py): each expert's parts.
        for unit, path in ((u, p) for u in getattr(layer, "expert_layers", (layer,)) for p in parts[granularity]):
            owner, name = _resolve(unit, path)
            target = getattr(owner, name)
            if isinstance(target, nn.Module):
                target.forward = checkpointed(target.forward, offload)
            else:
                setattr(owner, name, checkpointed(target, offload))
    if compression is not None:
        layer.forward = Compression(compression, on_pack).wrap(layer.forward)
    return layer


def checkpointed_blocks(num_blocks: int, every: int, start: int = 0, stop: Optional[int] = None) -> int:
    """How many of blocks [start, stop) train.recompute.every checkpoints (blocks 0, k, 2k, ...)."""
    stop = num_blocks if stop is None else stop
    return sum(1 for i in range(start, stop) if i % every == 0)


def apply_recompute(model: nn.Module, cfg: ExperimentConfig, on_pack: Optional[Callable] = None,
                    offload: Optional[HostOffload] = None) -> nn.Module:
    """Wrap the layers for train.recompute and train.activation_compression (both null: unchanged); `offload`
    (train.offload_activations): the checkpoints' kept inputs in host memory."""
    rc, comp = cfg.train.recompute, cfg.train.activation_compression
    if rc is None and comp is None:
        return model
    parts, streams = family(cfg.model).network.recompute_parts, family(cfg.model).network.streams
    for i, layer in layers_of(model, cfg):
        wrap_layer(layer, parts, rc.granularity if rc is not None and i % rc.every == 0 else None,
                   comp.dtype if comp is not None else None, on_pack, offload, streams)
    return model
