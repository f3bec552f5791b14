"""Turn models/'s stage list into what DeepSpeed runs: a sequential module (pp = 1) or pipeline stages.

The layer list is [embed, block_0 .. block_{L-1}, final]; layer i is built inside `init_rng(seed, name)`
so its weights depend on the seed and its name only, not on the stage that builds it. Canonical
parameter names are `embed.*`, `blocks.{i}.*`, `final.*` in both forms (`canonical_name`).
"""
from __future__ import annotations

import math
import re
from typing import Callable, Optional

import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn

from models.diffusion import mse_loss
from models.cogvideox.model import patchify, sequence_tokens, stage_classes, token_grid
from parallel.config import ExperimentConfig
from parallel.dist.seed import init_rng
from parallel.dist.sequence import local_range, sp_size_of


class SeededLayerSpec(LayerSpec):
    """A LayerSpec built under its own RNG stream (seed, name)."""

    def __init__(self, seed: int, name: str, typename, *args, **kwargs):
        super().__init__(typename, *args, **kwargs)
        self.seed, self.name = seed, name

    def build(self, log=False):
        with init_rng(self.seed, self.name):
            return super().build(log=log)


def layer_specs(cfg: ExperimentConfig, ctx) -> list[SeededLayerSpec]:
    embed, block, final = stage_classes(cfg.model)
    grid, seed = token_grid(cfg.model, cfg.data), cfg.train.seed
    return ([SeededLayerSpec(seed, "embed", embed, cfg.model, grid, ctx)]
            + [SeededLayerSpec(seed, f"blocks.{i}", block, cfg.model, grid, ctx) for i in range(cfg.model.num_layers)]
            + [SeededLayerSpec(seed, "final", final, cfg.model, grid, ctx)])


class SequenceLoss:
    """The diffusion MSE; with sequence parallelism, this rank's share of it, times sp.

    Each sp rank holds S / sp tokens of the prediction (text rows first on the ranks that have them;
    they are not predicted). The sum of its squared errors over the global element count, times sp,
    averages over the sp ranks (DeepSpeed's data axis) to the serial loss, and so do the gradients.
    """

    def __init__(self, cfg: ExperimentConfig, ctx):
        self.model, self.ctx, self.sp = cfg.model, ctx, sp_size_of(ctx)
        self.total = sequence_tokens(cfg.model, cfg.data)
        self.prefix = self.total - math.prod(token_grid(cfg.model, cfg.data))    # text tokens in the sequence

    def __call__(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.sp == 1:
            return mse_loss(prediction, target)
        start, stop = local_range(self.total, self.ctx)
        skip = min(max(self.prefix - start, 0), stop - start)               # local text rows
        first, last = start + skip - self.prefix, stop - self.prefix        # video tokens held here
        err = prediction[:, skip:].float() - patchify(target, self.model)[:, first:last].float()
        return err.square().sum() * (self.sp / target.numel())


def blocks_per_stage(cfg: ExperimentConfig) -> list[int]:
    pp, n = cfg.parallel.pp_size, cfg.model.num_layers
    return list(cfg.parallel.pp_partition or [n // pp] * pp)


def checkpoint_interval(ds: dict, num_blocks: int) -> int:
    """Blocks per checkpointed segment from the JSON's activation_checkpointing section (0 = off).

    Without the section nothing is recomputed; with it every block is checkpointed, or the blocks are
    grouped into `number_checkpoints` segments when that is set.
    """
    section = ds.get("activation_checkpointing")
    if section is None:
        return 0
    n = section.get("number_checkpoints")
    return max(1, math.ceil(num_blocks / n)) if n else 1


def checkpoint_x_only(checkpoint_fn: Callable) -> Callable:
    """Recompute a range of blocks for x; the other stage tensors (temb; STDiT: t, t_mlp, y), which
    blocks read but pass on unchanged, go around the checkpoint, not through it.

    Two DeepSpeed behaviours make this necessary: partition_activations and cpu_checkpointing free a
    checkpoint's inputs in place (`arg.data = empty`), so the checkpoint gets fresh views of them and
    the caller's tensors survive; and the 0.19 pipeline engine backpropagates each stage output
    separately, which a checkpoint node cannot serve twice, so they must not be among its outputs.
    """
    def run(fn, x, *rest):
        x = checkpoint_fn(lambda x_, *rest_: fn(x_, *rest_)[0], x, *(r.view_as(r) for r in rest))
        return (x, *rest)
    return run


class SequentialDiT(nn.Module):
    """pp = 1: the stages in order; forward(inputs, target) -> loss. Blocks checkpointed in segments."""

    def __init__(self, specs: list[SeededLayerSpec], checkpoint_every: int = 0,
                 checkpoint_fn: Optional[Callable] = None, loss_fn: Callable = mse_loss):
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


class DiTPipeline(PipelineModule):
    """pp > 1: stage s holds blocks_per_stage[s] blocks; embed on the first stage, final + loss on the last."""

    def __init__(self, specs, topology: PipeModelDataParallelTopology, blocks: list[int],
                 checkpoint_every: int = 0, checkpoint_fn: Optional[Callable] = None,
                 loss_fn: Callable = mse_loss):
        block_class = specs[1].typename.__name__          # the family's block: DiTBlock, STDiT3Layer
        bounds = [0] + [1 + sum(blocks[:s + 1]) for s in range(len(blocks))]
        bounds[-1] = len(specs)
        self._explicit_parts = bounds
        extra = {"activation_checkpoint_func": checkpoint_fn} if checkpoint_fn else {}
        super().__init__(layers=specs, topology=topology, loss_fn=loss_fn, partition_method="explicit",
                         activation_checkpoint_interval=checkpoint_every, checkpointable_layers=[block_class],
                         **extra)

    def _partition_layers(self, method="explicit"):
        self.parts = self._explicit_parts
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


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


def build_model(cfg: ExperimentConfig, ds: dict, ctx, checkpoint_fn: Optional[Callable] = None) -> nn.Module:
    """The module to hand to deepspeed.initialize for this layout."""
    specs = layer_specs(cfg, ctx)
    every = checkpoint_interval(ds, cfg.model.num_layers)
    checkpoint_fn = checkpoint_x_only(checkpoint_fn) if checkpoint_fn else None
    loss_fn = SequenceLoss(cfg, ctx)
    if cfg.parallel.pp_size == 1:
        return SequentialDiT(specs, every, checkpoint_fn, loss_fn)
    # DeepSpeed's data axis holds dp x sp ranks (parallel.dist.topology).
    topo = PipeModelDataParallelTopology(num_pp=ctx.pp_size, num_mp=ctx.tp_size, num_dp=ctx.dp_size * ctx.sp_size)
    return DiTPipeline(specs, topo, blocks_per_stage(cfg), every, checkpoint_fn, loss_fn)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@torch.no_grad()
def full_state(module: nn.Module, ctx, num_blocks: int, value=None) -> dict[str, torch.Tensor]:
    """This rank's parameters (or `value(param)`, e.g. their EMA) and buffers as full fp32 tensors, canonical
    names (what load_state_dict of the one-process model takes).

    Tensor-parallel shards are gathered over the tp group, so call on every rank of it. Under ZeRO-3
    wrap the call in `deepspeed.zero.GatheredParameters(module.parameters())` (parameters) or pass a
    `value` that gathers (parallel.train.ema.full_ema).
    """
    from parallel.dist.comm import gather_shards
    out = {}
    for name, p in module.named_parameters():
        t = (p if value is None else value(p)).detach().float()
        if getattr(p, "tensor_model_parallel", False) and ctx.tp_size > 1:
            t = gather_shards(t, ctx, p.partition_dim, getattr(p, "tp_parts", None))
        out[canonical_name(name, num_blocks)] = t.cpu().clone()
    for name, b in module.named_buffers():                # replicated, never sharded
        out[canonical_name(name, num_blocks)] = b.detach().float().cpu().clone()
    return out
