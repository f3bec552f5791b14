"""A list of stages as what DeepSpeed runs: one sequential module (pp = 1) or pipeline stages (pp > 1).

The layer list is [embed, layer_0 .. layer_{L-1}, final], each a `SeededLayerSpec` built inside
`init_rng(seed, name)`, so its weights depend on the seed and its name only, not on the stage that
builds it. Canonical parameter names are `embed.*`, `blocks.{i}.*`, `final.*` in both forms
(`canonical_name`). Nothing here knows a model family: parallel/model/build.py makes the list from one.
"""
from __future__ import annotations

import re
from typing import Callable, Optional

from deepspeed.pipe import LayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn

from parallel.distributed.deepspeed.pipeline import (ExplicitPipelineModule, set_checkpointable_layers,
                                                     stage_layer_range, stage_layers)
from parallel.distributed.seed import init_rng


class SeededLayerSpec(LayerSpec):
    """A LayerSpec built under its own RNG stream (seed, name)."""

    def __init__(self, seed: int, name: str, typename, *args, **kwargs):
        super().__init__(typename, *args, **kwargs)
        self.seed, self.name = seed, name

    def build(self, log=False):
        with init_rng(self.seed, self.name):
            return super().build(log=log)


def checkpoint_x_only(checkpoint_fn: Callable, streams: int = 1) -> Callable:
    """Recompute a range of blocks for x (the stage tuple's first `streams` tensors: LTX-2's x and audio
    stream); the other stage tensors (temb; STDiT: t, t_mlp, y), which blocks read but pass on unchanged, go
    around the checkpoint, not through it.

    Two DeepSpeed behaviours make this necessary: partition_activations and cpu_checkpointing free a
    checkpoint's inputs in place (`arg.data = empty`), so the checkpoint gets fresh views of them and
    the caller's tensors survive; and the 0.19 pipeline engine backpropagates each stage output
    separately, which a checkpoint node cannot serve twice, so they must not be among its outputs.
    Two streams (LTX-2) are two outputs of one checkpoint, each backpropagated on its own by the pipeline engine:
    parallel/model/build.py then hands in torch's non-reentrant checkpoint, which recomputes for each.
    """
    def run(fn, *h):
        hidden, rest = h[:streams], h[streams:]
        views = tuple(r.view_as(r) for r in rest)
        if streams == 1:
            return (checkpoint_fn(lambda x_, *rest_: fn(x_, *rest_)[0], *hidden, *views), *rest)
        return (*checkpoint_fn(lambda *h_: fn(*h_)[:streams], *hidden, *views), *rest)
    return run


class HostResident:
    """Stage modules' `module.to(device)` (deepspeed.initialize's) and casts leave what block swap keeps in host
    memory there: `host_swap` (a parallel/distributed/block_swap.py BlockSwap, or None) converts it in place."""

    host_swap = None

    def _apply(self, fn, recurse=True):
        if self.host_swap is None:
            return super()._apply(fn, recurse)
        return self.host_swap.keep_on_host(fn, lambda: super(HostResident, self)._apply(fn, recurse), self)


class SequentialDiT(HostResident, nn.Module):
    """pp = 1: the stages in order; forward(inputs, target) -> loss. Blocks checkpointed in segments."""

    def __init__(self, specs: list[SeededLayerSpec], checkpoint_every: int = 0,
                 checkpoint_fn: Optional[Callable] = None, loss_fn: Optional[Callable] = None):
        super().__init__()
        self.sequence_loss = loss_fn       # not `loss_fn`: that name marks a pipeline module's external loss
        self.embed = specs[0].build()
        self.blocks = nn.ModuleList(spec.build() for spec in specs[1:-1])
        self.final = specs[-1].build()
        self.checkpoint_every, self.checkpoint_fn = checkpoint_every, checkpoint_fn

    def _segment(self, start: int, stop: int):
        def run(*h):
            for block in self.blocks[start:stop]:
                h = block(h)
            return h
        return run

    def predict(self, inputs):
        h = self.embed(inputs)
        k = self.checkpoint_every
        for start in range(0, len(self.blocks), k or len(self.blocks)):
            stop = start + (k or len(self.blocks))
            run = self._segment(start, stop)
            h = self.checkpoint_fn(run, *h) if k else run(*h)
        return self.final(h)

    def forward(self, inputs, target):
        return self.sequence_loss(self.predict(inputs), target)


class DiTPipeline(HostResident, ExplicitPipelineModule):
    """pp > 1: stage s holds blocks_per_stage[s] blocks; embed on the first stage, final + loss on the last.

    `dynamic_shape`: the tensors between stages may change shape from one micro-batch to the next (a
    bucketed dataset): DeepSpeed then sends each activation's shape before it and re-allocates its receive
    and gradient buffers every time, instead of caching the first micro-batch's."""

    def __init__(self, specs, topology: PipeModelDataParallelTopology, blocks: list[int],
                 loss_fn: Callable, checkpoint_every: int = 0, checkpoint_fn: Optional[Callable] = None,
                 dynamic_shape: bool = False):
        block_class = specs[1].typename.__name__          # the family's layer: DiTBlock, STDiT3Layer
        bounds = [0] + [1 + sum(blocks[:s + 1]) for s in range(len(blocks))]
        bounds[-1] = len(specs)
        extra = {"activation_checkpoint_func": checkpoint_fn} if checkpoint_fn else {}
        super().__init__(layers=specs, topology=topology, loss_fn=loss_fn, parts=bounds,
                         activation_checkpoint_interval=checkpoint_every, checkpointable_layers=[block_class],
                         dynamic_shape=dynamic_shape, **extra)
        # A block's spec may build another class (Wan 2.2 A14B: WanBlock builds an ExpertLayer of both experts'
        # blocks), which DeepSpeed would not checkpoint: name the classes the blocks of this stage were built as.
        built = {type(layer).__name__ for i, layer in zip(stage_layer_range(self), stage_layers(self))
                 if 0 < i < len(specs) - 1}
        set_checkpointable_layers(self, built | {block_class})


_PIPE_NAME = re.compile(r"^(\d+)\.(.*)$")


def canonical_name(name: str, num_blocks: int) -> str:
    """`3.attn.to_qkv.weight` (pipeline layer index) -> `blocks.2.attn.to_qkv.weight`; others unchanged."""
    m = _PIPE_NAME.match(name)
    if not m:
        return name
    idx, rest = int(m.group(1)), m.group(2)
    if idx == 0:
        return f"embed.{rest}"
    if idx == num_blocks + 1:
        return f"final.{rest}"
    return f"blocks.{idx - 1}.{rest}"
