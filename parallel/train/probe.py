"""What a training step really holds, measured, for comparison with the memory plan.

Independent of the planner's code: it walks the DeepSpeed engine's objects for the tensors they keep
(parameters, gradients, optimizer states, buckets) and records what autograd saves during each
micro-batch's forward. On CUDA/NPU the accelerator's peak adds the allocator's view; on CPU these two
are the only honest measure of what the device would hold.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from torch import nn

from parallel.distributed.deepspeed.accounting import ZERO_BUCKETS, checkpoint_saved_tensors
from parallel.distributed.deepspeed.optimizer import engine_optimizers

_WALKED_MODULES = ("deepspeed", "torch", "parallel", "models")


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def held_by(roots: dict, max_depth: int = 14) -> dict[int, tuple[int, str]]:
    """Every tensor storage reachable from `roots` through attributes, containers and tensor attributes
    (.grad, ds_tensor, _hp_mapping, ...), meta tensors skipped: {storage: (bytes, shortest path)}."""
    found, seen = {}, set()
    queue = deque((obj, name, 0) for name, obj in roots.items())     # breadth first: shortest paths
    while queue:
        obj, path, depth = queue.popleft()
        if id(obj) in seen or depth > max_depth:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta" and obj.untyped_storage().nbytes():
                found.setdefault(storage_key(obj), (obj.untyped_storage().nbytes(), path))
            if obj.is_leaf and obj.grad is not None:
                queue.append((obj.grad, path + ".grad", depth + 1))
            queue += [(v, f"{path}.{k}", depth + 1) for k, v in vars(obj).items()]
        elif isinstance(obj, dict):
            queue += [(v, f"{path}[{k if isinstance(k, (str, int)) else '.'}]", depth + 1) for k, v in obj.items()]
            queue += [(k, f"{path}<key>", depth + 1) for k in obj if isinstance(k, torch.Tensor)]
        elif isinstance(obj, (list, tuple)):
            queue += [(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in _WALKED_MODULES \
                and "ProcessGroup" not in type(obj).__name__:
            queue += [(v, f"{path}.{k}", depth + 1) for k, v in vars(obj).items()]
    return found


def held_kinds(found: dict[int, tuple[int, str]]) -> dict[str, int]:
    """Bytes by kind: ZeRO's gradient buckets, cached position tables and registered buffers ("buffers"),
    model states."""
    kinds = {"states": 0, "buckets": 0, "buffers": 0}
    for nbytes, path in found.values():
        buffer = ".tables" in path or "._buffers" in path
        kinds["buckets" if ZERO_BUCKETS in path else "buffers" if buffer else "states"] += nbytes
    return kinds


def graph_saved(outputs, into: dict[int, torch.Tensor]) -> None:
    """Tensors DeepSpeed's activation checkpoints keep as autograd-node attributes (not through
    save_for_backward, so saved-tensor hooks miss them), found by walking back from `outputs`."""
    tensors = [t for t in (outputs if isinstance(outputs, (tuple, list)) else (outputs,))
               if isinstance(t, torch.Tensor)]
    nodes, stack = set(), [t.grad_fn for t in tensors]
    while stack:
        node = stack.pop()
        if node is None or node in nodes:
            continue
        nodes.add(node)
        for t in checkpoint_saved_tensors(node):
            into.setdefault(storage_key(t), t)
        stack += [fn for fn, _ in node.next_functions]


@dataclass
class StepMeasurement:
    states: int = 0                   # parameters + gradients + optimizer states at the peak optimizer step
    buckets: int = 0
    buffers: int = 0
    activations: list[int] = field(default_factory=list)    # saved bytes of each micro-batch's forward
    held: dict[str, int] = field(default_factory=dict)      # the peak snapshot: {shortest path: bytes}


class StepProbe:
    """Measures one training step of a DeepSpeed engine (use as a context manager around it).

    Held tensors are snapshotted at every optimizer step call (the engine's and, for ZeRO, the wrapped
    torch optimizer's, which steps one parameter group at a time with its fp32 gradient built); the peak
    snapshot is kept. Saved activations are recorded between the module's forward pre-hook and hook, so
    the recomputation of checkpointed blocks in backward is not counted.
    """

    def __init__(self, engine):
        self.engine = engine
        self.result = StepMeasurement()
        self._stack = ExitStack()
        self._saved: dict[int, torch.Tensor] | None = None      # open while a micro-batch's forward runs
        self._last: tuple[dict[int, int], int] = ({}, 0)      # the last micro-batch's {storage: bytes}, total

    def _snapshot(self, step: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            found = held_by({"optimizer": self.engine.optimizer, "module": self.engine.module})
            swap = getattr(self.engine.module, "host_swap", None)      # train.block_swap: host tensors, copies
            for key in swap.storages() if swap is not None else ():
                found.pop(key, None)
            kinds = held_kinds(found)
            if kinds["states"] + kinds["buckets"] > self.result.states + self.result.buckets:
                self.result.states, self.result.buckets, self.result.buffers = \
                    kinds["states"], kinds["buckets"], kinds["buffers"]
                self.result.held = {}
                for nbytes, path in found.values():        # paths name tensor-keyed entries "[.]": summed
                    self.result.held[path] = self.result.held.get(path, 0) + nbytes
            return step(*args, **kwargs)
        return wrapped

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._saved is not None and not isinstance(t, nn.Parameter) and t.device.type != "meta":
            self._saved.setdefault(storage_key(t), t)
        return t

    def _forward_pre(self, module: nn.Module, args) -> None:
        self._saved = {}

    def _close(self, output) -> None:
        """End of a micro-batch's forward: keep the sizes only, so the probe holds no activation alive."""
        graph_saved(output, self._saved)
        module = self.engine.module            # its parameters and buffers are model state, not activations
        params = {storage_key(t) for t in (*module.parameters(), *module.buffers())}
        sizes = {k: v.untyped_storage().nbytes() if isinstance(v, torch.Tensor) else v
                 for k, v in self._saved.items() if k not in params}
        self._last = (sizes, sum(sizes.values()))
        self._saved = None

    def _forward_post(self, module: nn.Module, args, output) -> None:
        self._close(output)
        self.result.activations.append(self._last[1])

    def _loss(self, loss_fn: Callable) -> Callable:
        """The pipeline engine applies the module's loss_fn after its forward: count it with that micro-batch."""
        def wrapped(*args, **kwargs):
            self._saved = self._last[0]
            loss = loss_fn(*args, **kwargs)
            self._close(loss)
            self.result.activations[-1] = self._last[1]
            return loss
        return wrapped

    def __enter__(self) -> StepProbe:
        engine, stack = self.engine, self._stack
        for owner in engine_optimizers(engine):
            own = vars(owner).get("step")               # an instance attribute to put back, or none
            owner.step = self._snapshot(owner.step)
            stack.callback(lambda o=owner, s=own: setattr(o, "step", s) if s else delattr(o, "step"))
        stack.callback(engine.module.register_forward_pre_hook(self._forward_pre).remove)
        loss_fn = getattr(engine.module, "loss_fn", None)
        if loss_fn is not None:
            engine.module.loss_fn = self._loss(loss_fn)
            stack.callback(setattr, engine.module, "loss_fn", loss_fn)
        stack.callback(engine.module.register_forward_hook(self._forward_post).remove)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

