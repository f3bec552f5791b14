"""Checkpoint inputs in host memory (train.offload_activations): saved-tensor hooks that copy the tensors a
checkpoint keeps to pinned host memory on a side stream in forward, and back ahead of their use in backward.

Under activation checkpointing what a stage holds between forward and backward is each checkpoint's inputs
(a block's x [b, S/sp, H]; the attention core's q, k, v; the MLP's input). `HostOffload.scope(tensors)`
wraps one checkpoint call: inside it, every save of those tensors (torch's checkpoint saves its inputs,
parallel/model/recompute.py's `_Keep` saves them again, DeepSpeed's CheckpointFunction saves its arguments) is
packed as one host copy per view, and the device storage is released once nothing else holds it. Other saves
in the window (the side tensors, shared by the stage's blocks and kept on the device anyway) pass as they are.

Order on an accelerator (s: the side stream, c: the compute stream):

    forward, checkpoint i    s waits for c, copies x_i into pinned host memory; x_i's device memory returns
                             to the allocator when that copy is done (record_stream)
    backward, checkpoint i   c waits for x_i's copy back (started when checkpoint i + 1 was unpacked, or now),
                             then x_{i-1}'s copy back starts on s: it runs during block i's recompute and backward

so the device holds at most two checkpoint inputs during backward. `chain(forward)` starts a new sequence
for each forward call (a pipeline stage runs several micro-batches' forwards before their backwards); the
link to the previous entry is weak, so a consumed entry's host copy is freed with its graph.
On CPU there is no stream: the copy is a plain one and unpack hands the host tensor back (the host is the
device), so the same code runs and is tested there.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable, Iterator, Optional

import torch

from parallel.distributed import accelerator


def _view_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class _Entry:
    """One offloaded view: its host copy, and its device copy between prefetch and use."""

    def __init__(self, host: torch.Tensor, device: torch.device, prev: Optional["_Entry"]):
        self.host, self.device = host, device
        self.prev = weakref.ref(prev) if prev is not None else None
        self.fetched: Optional[tuple] = None
        self.used = False

    def fetch(self, stream, ahead: bool = False) -> None:
        """Start the copy back (`ahead`: a prefetch, skipped once the entry was used)."""
        if self.fetched is None and not (ahead and self.used):
            self.fetched = accelerator.copy_to_device(self.host, self.device, stream)


class HostOffload:
    """Pack / unpack hooks moving chosen checkpoint inputs to the host. `on_pack(tensor, host)` (tests, the
    planner's tracer) sees each view moved and its host copy."""

    def __init__(self, on_pack: Optional[Callable] = None):
        self.on_pack = on_pack
        self._stream = None
        self._chosen: set[int] = set()            # storages the open scope moves
        self._packed: dict[tuple, _Entry] = {}    # the open scope's entries, one per view
        self._last: Optional[_Entry] = None

    @property
    def stream(self):
        if self._stream is None:
            self._stream = accelerator.side_stream()
        return self._stream

    def pack(self, t: torch.Tensor):
        if t.untyped_storage()._cdata not in self._chosen:
            return t
        key = _view_key(t)
        if key not in self._packed:
            # meta (the planner's trace): shapes only, nothing to copy
            host = t.detach() if t.device.type == "meta" else accelerator.copy_to_host(t, self.stream)
            self._packed[key] = self._last = _Entry(host, t.device, self._last)
            if self.on_pack is not None:
                self.on_pack(t, host)
        return self._packed[key]

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.device.type == "meta":
            return packed.host
        packed.fetch(self.stream)
        out, event = packed.fetched
        accelerator.wait_for(event)
        packed.fetched, packed.used = None, True
        prev = packed.prev() if packed.prev is not None else None
        if prev is not None:                      # the checkpoint backward reaches next: its input on the way
            prev.fetch(self.stream, ahead=True)
        return out

    @contextlib.contextmanager
    def scope(self, tensors) -> Iterator[None]:
        """Inside: saves of `tensors`' storages go to the host (one checkpoint call)."""
        self._chosen = {t.untyped_storage()._cdata for t in tensors}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._chosen, self._packed = set(), {}

    def chain(self, forward: Callable) -> Callable:
        """forward, each call starting a new sequence of checkpoints (one micro-batch's)."""
        @functools.wraps(forward)
        def run(*args, **kwargs):
            self._last = None
            return forward(*args, **kwargs)
        return run
