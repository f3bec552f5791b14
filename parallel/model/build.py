"""The model of an experiment for a layout: its family's stages (models/registry.py) as DeepSpeed runs them.

`layer_specs` lists the family's stages; `build_model` makes the sequential module (pp = 1) or the
pipeline stages (parallel/distributed/pipeline.py) with the loss `SequenceLoss`.
"""
from __future__ import annotations

import functools
import math
import re
from typing import Callable, Optional

import torch
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn

from models.diffusion import mse_loss
from models.geometry import StepGrid, patchify, position_caches, token_grid
from models.registry import family, sequence_tokens
from parallel.experiment.config import ExperimentConfig
from parallel.distributed.block_swap import BlockSwap
from parallel.distributed.compile import compile_layers
from parallel.distributed.offload import HostOffload
from parallel.distributed.pipeline import DiTPipeline, SeededLayerSpec, SequentialDiT, checkpoint_x_only
from parallel.distributed.sequence import local_range, sp_size_of
from parallel.model.recompute import apply_recompute, checkpointed, layers_of


def layer_specs(cfg: ExperimentConfig, ctx, grid: Optional[StepGrid] = None) -> list[SeededLayerSpec]:
    """The stages, all reading one `StepGrid` (the config's grid until a bucketed run sets the step's)."""
    spec = family(cfg.model)
    grid, seed = grid or StepGrid(token_grid(cfg.model, cfg.data), cfg.model), cfg.train.seed
    return ([SeededLayerSpec(seed, "embed", spec.network.embed, cfg.model, grid, ctx)]
            + [SeededLayerSpec(seed, f"blocks.{i}", spec.network.layer, cfg.model, grid, ctx,
                               **({"index": i} if getattr(spec.network.layer, "indexed", False) else {}))
               for i in range(cfg.model.num_layers)]
            + [SeededLayerSpec(seed, "final", spec.network.final, cfg.model, grid, ctx)])


class SequenceLoss:
    """The diffusion MSE; with sequence parallelism, this rank's share of it, times sp.

    Each sp rank holds S_pad / sp tokens of the prediction (text rows first on the ranks that have them,
    padding rows last when sp does not divide S; neither is predicted, so both are skipped and get no
    gradient). The sum of its squared errors over the global element count, times sp, averages over
    the sp ranks (DeepSpeed's data axis) to the serial loss, and so do the gradients. Latent frames the family's
    condition marks as inputs (`loss_skip_frames`: Wan 2.2 TI2V's clean first frame) are left out, as rows of
    every sp layout and from the element count; where the condition is drawn per sample (LTX-2's
    model.image_dropout), only from the samples the batch's `keep` [B] (last in the target) marks, and the video loss
    is each sample's mean over its own elements, averaged over the batch (ltx-trainer's masked loss; the plain mean
    when every sample keeps). A family with a second stream (LTX-2's audio, whole on every sp rank) adds that
    stream's loss (FamilySpec.second_stream), counted once on every sp rank.
    """

    def __init__(self, cfg: ExperimentConfig, ctx, grid: Optional[StepGrid] = None):
        self.model, self.ctx, self.sp = cfg.model, ctx, sp_size_of(ctx)
        self.grid = grid or StepGrid(token_grid(cfg.model, cfg.data), cfg.model)       # the step's grid (buckets)
        self.prefix = sequence_tokens(cfg.model, cfg.data) - math.prod(token_grid(cfg.model, cfg.data))   # text
        # Latent frames that are inputs, not predictions (Wan 2.2 TI2V's clean first frame): left out of the loss.
        condition = family(cfg.model).training_condition(cfg.model, cfg.data)
        self.clean = getattr(condition, "loss_skip_frames", 0)
        # a second stream (LTX-2's audio, whole on every sp rank): its loss beside the video's (its `loss`)
        self.stream = family(cfg.model).training_stream(cfg.model, cfg.data)

    def __call__(self, prediction, target) -> torch.Tensor:
        if self.stream is not None:        # prediction and target: (video, second stream[, keep]) tuples
            return self.stream.loss(self.video, prediction, target, self.sp)
        return self.video(prediction, *target) if isinstance(target, tuple) else self.video(prediction, target)

    def _local(self) -> tuple[int, int, int]:
        """(local text rows, first, last): the prediction rows after the text rows hold video tokens [first, last)."""
        total = self.prefix + math.prod(self.grid)
        start, stop = local_range(total, self.ctx)
        stop = max(min(stop, total), start)                                 # padding rows from total on
        skip = min(max(self.prefix - start, 0), stop - start)               # local text rows
        return skip, start + skip - self.prefix, stop - self.prefix

    def video(self, prediction: torch.Tensor, target: torch.Tensor, keep=None) -> torch.Tensor:
        if keep is not None:
            return self._per_sample(prediction, target, keep)
        if self.sp == 1:
            return mse_loss(prediction[:, :, self.clean:], target[:, :, self.clean:])
        skip, first, last = self._local()
        clean = self.clean // self.model.patch_size_t * math.prod(self.grid.value[1:])    # clean frames' tokens
        skip, first = skip + min(max(clean - first, 0), last - first), max(first, min(clean, last))
        err = prediction[:, skip:skip + last - first].float() - patchify(target, self.model)[:, first:last].float()
        return err.square().sum() * (self.sp / target[:, :, self.clean:].numel())

    def _per_sample(self, prediction: torch.Tensor, target: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """(1 / B) sum_b (squared errors of sample b outside its inputs) / (its element count outside them), the
        inputs the first self.clean latent frames where keep[b]; under sp this rank's tokens' share, times sp."""
        if self.sp == 1:          # per latent frame: [B, T]
            err = (prediction.float() - target.float()).square().sum((1, 3, 4))
            inputs = torch.arange(err.shape[1], device=err.device) < self.clean
        else:                     # per video token held here: [B, last - first]
            skip, first, last = self._local()
            err = (prediction[:, skip:skip + last - first].float() -
                   patchify(target, self.model)[:, first:last].float()).square().sum(-1)
            clean = self.clean // self.model.patch_size_t * math.prod(self.grid.value[1:])
            inputs = torch.arange(first, last, device=err.device) < clean
        kept = keep.to(err.device, torch.float32)
        weight = 1 - kept[:, None] * inputs.float()
        count = target[0].numel() - kept * target[0, :, :self.clean].numel()
        return ((err * weight).sum(1) / count).mean() * self.sp


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


def _offloaded_checkpoint(offload: HostOffload, fn: Callable, x: torch.Tensor, *rest):
    return checkpointed(fn, offload, moved=1)(x, *rest)


def _torch_checkpoint(fn: Callable, *args):
    return checkpointed(fn)(*args)


def build_model(cfg: ExperimentConfig, ds: dict, ctx, checkpoint_fn: Optional[Callable] = None) -> nn.Module:
    """The module to hand to deepspeed.initialize for this layout."""
    grid = StepGrid(token_grid(cfg.model, cfg.data), cfg.model)
    specs = layer_specs(cfg, ctx, grid)
    every = checkpoint_interval(ds, cfg.model.num_layers)
    # train.offload_activations: what the checkpoints keep goes to host memory (parallel/distributed/offload.py)
    offload = HostOffload() if cfg.train.offload_activations else None
    if offload is not None and checkpoint_fn is not None:
        # DeepSpeed 0.19's CheckpointFunction keeps its inputs as attributes of its ctx, out of saved-tensor hooks'
        # reach: the JSON's segments then run through torch's checkpoint (parallel/model/recompute.py), the same math.
        checkpoint_fn = functools.partial(_offloaded_checkpoint, offload)
    streams = family(cfg.model).network.streams
    if checkpoint_fn is not None and offload is None and streams > 1 and cfg.parallel.pp_size > 1:
        # The 0.19 pipeline engine backpropagates each stage output on its own (retain_graph between them): a
        # DeepSpeed CheckpointFunction among the producers of two streams is asked for its backward twice and has
        # freed its inputs after the first. torch's non-reentrant checkpoint recomputes for each (the same math).
        checkpoint_fn = _torch_checkpoint
    checkpoint_fn = checkpoint_x_only(checkpoint_fn, streams) if checkpoint_fn else None
    loss_fn = SequenceLoss(cfg, ctx, grid)
    if cfg.parallel.pp_size == 1:
        model = SequentialDiT(specs, every, checkpoint_fn, loss_fn)
    else:
        # DeepSpeed's data axis holds dp x sp ranks (parallel.distributed.topology). A directory dataset may hold
        # several shapes (buckets): then the stages exchange tensors whose shape changes from step to step.
        topo = PipeModelDataParallelTopology(num_pp=ctx.pp_size, num_mp=ctx.tp_size,
                                             num_dp=ctx.dp_size * ctx.sp_size)
        model = DiTPipeline(specs, topo, blocks_per_stage(cfg), loss_fn, every, checkpoint_fn,
                            dynamic_shape=cfg.data.kind == "directory")
    model.step_grid = grid            # the training loop sets each step's bucket here (parallel/train/engine.py)
    if cfg.train.compile:                         # regional: one graph per block class (parallel/distributed/compile.py)
        compile_layers(model, specs[1].typename, cfg.train.compile_backend, tables=position_caches)
    # after compiling: a checkpointed or compressed block wraps the compiled forward (compile_layers sets
    # every block's forward to the shared compiled one, which would drop wrappers set before it)
    apply_recompute(model, cfg, offload=offload)    # train.recompute / train.activation_compression (parallel/model/recompute.py)
    if offload is not None:                       # each micro-batch's forward starts its own sequence of copies
        model.forward = offload.chain(model.forward)
    if cfg.train.float8 is not None:              # float8 matmuls in the blocks (parallel/model/float8.py)
        from parallel.model.float8 import apply_float8
        model.float8_layers = apply_float8(model, cfg)
    if cfg.model.lora is not None:                # frozen base + adapters (parallel/model/lora.py)
        from parallel.model.lora import apply_lora
        apply_lora(model, cfg.model, cfg.train.seed)
    return model


def apply_block_swap(model: nn.Module, cfg: ExperimentConfig, dtype: Optional[torch.dtype] = None) -> Optional[BlockSwap]:
    """train.block_swap = N: the frozen base of this stage's last N blocks in host memory, fetched for each use
    (parallel/distributed/block_swap.py); None when 0. After the weights are loaded and the fp8 base made, before
    deepspeed.initialize (whose `.to(device)` then leaves them on the host).

    The last N: the first swapped block's copy starts with each forward and arrives while the stage's embed and
    unswapped blocks compute, and backward begins with the last one, still on the device from the forward."""
    n = cfg.train.block_swap
    if not n:
        return None
    swap = BlockSwap([block for _, block in layers_of(model, cfg)][-n:], dtype=dtype)    # dtype: the run's
    model.forward = swap.chain(model.forward)
    model.host_swap = swap            # the stage module's .to(device) leaves them on the host (HostResident)
    return swap


EXPERT_NAME = re.compile(r"(?:^|\.)experts\.(\d+)\.")


def expert_of_parameter(name: str) -> Optional[int]:
    """The expert a parameter belongs to (`blocks.3.experts.1.ffn_out.weight` -> 1; pipeline `5.experts.0.x`), None
    for a parameter of no expert."""
    found = EXPERT_NAME.search(name)
    return None if found is None else int(found.group(1))


def expert_count(model: torch.nn.Module) -> int:
    """How many experts the model's parameters (frozen ones included) belong to; 0 for a model of none. Every
    pipeline stage of a several-expert model holds each expert's part, so every rank finds the same count."""
    found = [expert_of_parameter(n) for n, _ in model.named_parameters()]
    return 1 + max((e for e in found if e is not None), default=-1)
