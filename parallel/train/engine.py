"""Set up DeepSpeed for a checked experiment and run one optimizer step at a time.

`prepare_ds_config` derives what DeepSpeed reads from the experiment (batch keys, learning rate, the
pipeline partitioning flags), `build_trainer` calls `deepspeed.initialize` for the layout, and
`TrainingEngine.train_step` runs one global batch on either engine and returns the layout-independent loss.
"""
from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from dataclasses import dataclass
from typing import Iterator, Optional

import deepspeed
import torch
import torch.distributed as dist

from parallel.distributed import accelerator
from parallel.distributed.deepspeed.bf16 import lighter_bf16_step
from parallel.distributed.deepspeed.checkpoint import use_weights_only_checkpoints, written_checksums
from parallel.distributed.deepspeed.clipping import clip_with_replica_norm
from parallel.distributed.deepspeed.skip import before_pipeline_update, guard_pipeline_updates, skipped_update
from parallel.distributed.deepspeed.version import check_deepspeed_version
from parallel.distributed.layers import skip_init
from parallel.checkpoints import lora_base
from parallel.distributed.seed import seed_training_rng
from parallel.experiment import ds_config as dsc
from parallel.experiment.config import ExperimentConfig
from parallel.train.experts import clear_routed, idle_experts
from parallel.model.build import apply_block_swap, blocks_per_stage, build_model, checkpoint_interval, expert_count
from parallel.train.optim import build_optimizer
from parallel.train.schedule import build_schedule, lr_factor, schedule_factor  # noqa: F401  (lr_factor: bench/)


def prepare_ds_config(ds: dict, cfg: ExperimentConfig, dp_size: int) -> dict:
    """The dict given to DeepSpeed: batch keys from the experiment; the optimizer and the lr schedule
    (parallel/train/schedule.py) are built by the toolkit.

    `dp_size` is DeepSpeed's data-parallel size, dp x sp (its train_batch_size then counts each sample
    once per sp rank; the toolkit's own figures count samples).

    Inter-stage tensors are not partitioned over tp ranks (DeepSpeed's pipe_partitioned lets only the
    first of several stage outputs carry a gradient; ours pass two).
    """
    out = dsc.with_batch_keys(ds, cfg, dp_size)
    out.pop("optimizer", None)
    out.pop("scheduler", None)
    out.setdefault("zero_allow_untested_optimizer", True)     # EmaAdamW: an AdamW subclass, tested under ZeRO here
    out.setdefault("pipeline", {})
    out["pipeline"].setdefault("pipe_partitioned", False)
    out["pipeline"].setdefault("grad_partitioned", False)
    if (out.get("zero_optimization") or {}).get("offload_optimizer"):
        out.setdefault("zero_force_ds_cpu_optimizer", False)
    return out


@dataclass
class StepResult:
    loss: float
    grad_norm: Optional[float]
    lr: float
    skipped: Optional[str] = None       # why the update was not applied (train.anomaly), else None
    expert_lrs: Optional[list[float]] = None    # several experts: each one's lr (its own schedule count), else None


class TrainingEngine:
    """The DeepSpeed engine with the toolkit's optimizer step over the global batch (pipeline or plain engine),
    save and load; parallel/train/trainer.py's Trainer runs the loop around it."""

    def __init__(self, engine, cfg: ExperimentConfig, ctx, optimizer, release: Optional[str] = None):
        self.engine, self.cfg, self.ctx = engine, cfg, ctx
        self.optimizer = optimizer          # the toolkit-built (base) optimizer that DeepSpeed wraps
        self.release = release              # the release its checkpoints leave a LoRA base in (lora_base.release_of)
        self.pipeline = cfg.parallel.pp_size > 1
        self.pipeline_guard = None        # guard_pipeline_updates' state, once a guarded step installed it
        self.experts = expert_count(engine.module)    # several: an expert no sample chose sits out the update
        if self.experts and self.pipeline:
            before_pipeline_update(engine, self._skip_idle_experts)

    def _skip_idle_experts(self) -> None:
        """Leave the experts no sample of this global batch chose out of the coming update (a collective)."""
        self.optimizer.idle = idle_experts(self.engine.module, self.experts, self.engine.device)

    def train_step(self, batches: Iterator, guard=None) -> StepResult:
        """One global batch. With `guard` (parallel/train/anomaly.py's AnomalyGuard) the step's loss (and,
        plain engine at ZeRO-0, gradient norm) is judged after the last backward, before the update, and
        the update skipped on every rank when the guard says so (the pipeline engine: inside train_batch)."""
        lr = self.engine.get_lr()[0]
        by_expert = {g["expert"]: g["lr"] for g in self.optimizer.param_groups if g.get("expert") is not None}
        expert_lrs = [by_expert[e] for e in sorted(by_expert)] or None
        grid, shape = getattr(self.engine.module, "step_grid", None), getattr(batches, "step_latent_shape", None)
        shape = shape() if shape is not None else None
        if grid is not None and shape is not None:      # every rank: this step's bucket (parallel/train/buckets.py)
            grid.set_latent(shape)
        if self.experts:
            clear_routed(self.engine.module)
        if self.pipeline:
            if guard is not None and self.pipeline_guard is None:
                self.pipeline_guard = guard_pipeline_updates(self.engine, guard.decide)
            loss = float(self.engine.train_batch(data_iter=batches))
            reason = self.pipeline_guard["reason"] if self.pipeline_guard else None
            if reason is not None:
                return StepResult(loss=loss, grad_norm=None, lr=lr, skipped=reason, expert_lrs=expert_lrs)
        else:
            device, losses = self.engine.device, []
            for micro in range(self.cfg.train.grad_accum_steps):
                inputs, target = next(batches)
                target = tuple(y.to(device) for y in target) if isinstance(target, tuple) else target.to(device)
                loss = self.engine(tuple(x.to(device) for x in inputs), target)
                self.engine.backward(loss)
                if micro < self.cfg.train.grad_accum_steps - 1:    # not the boundary: no update; the last is below
                    self.engine.step()
                losses.append(loss.detach())          # read once, after the last backward: no host wait per micro-batch
            if self.experts:
                self._skip_idle_experts()
            if guard is None:           # the update queued before the loss is read: no host wait in between
                self.engine.step()
                loss = self._mean_loss(losses)
            else:
                loss = self._mean_loss(losses)
                skipped = self._guarded_update(loss, guard)
                if skipped is not None:
                    return StepResult(loss=loss, grad_norm=self.engine.get_global_grad_norm(), lr=lr,
                                      skipped=skipped, expert_lrs=expert_lrs)
        norm = self.engine.get_global_grad_norm()
        return StepResult(loss=loss, grad_norm=None if norm is None else float(norm), lr=lr,
                          expert_lrs=expert_lrs)

    def _mean_loss(self, losses: list[torch.Tensor]) -> float:
        """The global batch's loss from this rank's micro-batch losses (device scalars, read in one copy): summed
        in float64 on the host in micro-batch order, averaged, then over the dp replicas and the sp ranks' shares
        (SequenceLoss) through the group's host-side (gloo) backend: the figures do not depend on the device's
        float64 support."""
        total = torch.zeros((), dtype=torch.float64)
        for value in torch.stack(losses).double().cpu():
            total += value
        total /= len(losses)
        if self.ctx.data_size > 1:
            dist.all_reduce(total, group=self.ctx.data_group)
            total /= self.ctx.data_size
        return float(total)

    def _guarded_update(self, loss: float, guard) -> Optional[str]:
        """The boundary step(): applied, or (the guard's verdict, the same on every rank) skipped; the reason."""
        if guard is None:
            self.engine.step()
            return None
        norm = None
        if self.engine.zero_optimization_stage() == 0:      # gradients whole and all-reduced on every rank
            params = [p for p in self.engine.module.parameters() if p.grad is not None]
            norm = float(grad_norm(params, self.ctx))
        reason = guard.decide(loss, norm)
        if reason is None:
            before = self.engine.skipped_steps
            self.engine.step()
            if self.engine.skipped_steps > before:        # DeepSpeed's own overflow check (ZeRO-1/2, fp16)
                return "gradient norm not finite (DeepSpeed skipped the update)"
            return None
        with skipped_update(self.engine):
            self.engine.step()
        return reason

    def save(self, directory, step: int) -> dict[str, str]:
        """Model, optimizer (with the EMA), LR schedule and step, in DeepSpeed's format, tag `step{N}`; returns
        the CRC-32s of the files this rank wrote ({name under step{N}: crc32}), taken as they were written:
        DeepSpeed's (parallel/distributed/deepspeed/checkpoint.py) and its part of the layout-free copy.

        Beside it every rank writes its part of the layout-free copy (parallel/checkpoints/relayout.py) that a
        resume on another layout reads, and its generator states (parallel/checkpoints/rng.py: LoRA's dropout masks)
        that a resume at this layout restores. Publishing it (marker, `latest`) is
        parallel.checkpoints.checkpoint.save's job, once every rank has written. A LoRA run with model.init_from
        leaves its frozen base out of both (parallel/checkpoints/lora_base.py).
        """
        from parallel.checkpoints import relayout, rng

        omit = self.release is not None
        # its collectives before any disk write that could fail; ckpt.layout_free=false: DeepSpeed's files only
        part = relayout.collect(self, base=not omit) if self.cfg.ckpt.layout_free else None
        sums = written_checksums(self.engine)    # the CRC-32s of what DeepSpeed writes, taken as it writes
        if sums is not None:
            sums.clear()
        with lora_base.without_base(self.engine.module, omit):
            self.engine.save_checkpoint(str(directory), tag=f"step{step}", client_state={"step": step},
                                        save_latest=False, exclude_frozen_parameters=omit)
        folder = (Path(directory) / f"step{step}").resolve()
        written = {str(p.relative_to(folder)): crc for p, crc in ((Path(k).resolve(), v) for k, v in (sums or {}).items())
                   if p.is_relative_to(folder)}
        if part is not None:
            written.update(relayout.write(part, folder, step, self.layout()))
        written.update(rng.write(folder, self.rng_stream()))
        return written

    def rng_stream(self) -> torch.Tensor:
        """What this rank's generators draw for (parallel/checkpoints/rng.py stream_of)."""
        from parallel.checkpoints import rng
        return rng.stream_of(self.ctx, blocks_per_stage(self.cfg))

    def layout(self) -> dict:
        """This run's sizes and ZeRO stage, as a checkpoint records them."""
        return {**self.ctx.dims.as_dict(), "zero_stage": self.engine.zero_optimization_stage()}

    def load(self, directory, tag=None) -> int:
        """Restore everything `save` wrote (the newest tag by default); returns the step to continue from.
        A checkpoint written at another layout is read from its layout-free copy, and the generator states are the
        writer's where its streams are this run's (another tp size or ZeRO stage: parallel/checkpoints/rng.py). Either way every parameter and buffer is written (a LoRA base the
        checkpoint left in its release: by build_trainer's read), which a resume's model, built without the
        tensor-parallel layers' init, relies on (overwrites_init)."""
        from parallel.checkpoints import checkpoint, relayout, rng

        saved = checkpoint.saved_layout(Path(directory) / tag) if tag else None
        if saved is not None and not checkpoint.same_layout(saved, self.layout()):
            step = relayout.load(self, Path(directory) / tag)
            rng.restore(Path(directory) / tag, saved, self.ctx, self.rng_stream())
            return step
        # a checkpoint without the base: the one build_trainer read from model.init_from stays
        with lora_base.over_base(self.engine.module, tag is not None and lora_base.record(Path(directory) / tag)):
            path, client = self.engine.load_checkpoint(str(directory), tag=tag)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {directory}")
        rng.restore(Path(directory) / tag if tag else Path(path).parent)      # path: a file of step{N}/
        return int(client["step"])


def swap_dtype(ds: dict) -> Optional[torch.dtype]:
    """The dtype DeepSpeed will cast the parameters to (bf16, fp16), for block swap to pin its host copies in at
    once; None (pinned as they are, converted at DeepSpeed's cast) for fp32, or where the JSON's data_types choose
    a parameter dtype or modules kept in fp32 themselves."""
    types = ds.get("data_types") or {}
    if "param_dtype" in types or types.get("keep_in_fp32_modules"):
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dsc.precision(ds))


def overwrites_init(init_from: bool, source: Optional[str]) -> bool:
    """Whether what follows the build writes every tensor the tensor-parallel layers' random init draws (their
    weights and biases), so that build_trainer skips it (layers.skip_init):

    - a release read (`source`: model.init_from, or the release a LoRA checkpoint left its base in): load_released
      refuses a release that lacks any parameter or buffer but the adapters, before reading one;
    - a checkpoint loaded (init_from False: the caller loads one next, TrainingEngine.load), whose every path writes
      every parameter and buffer: DeepSpeed's files at the same layout (a strict load_state_dict of the module
      states or the pipeline's layer files; under ZeRO-3 the fp32 partitions and frozen fragments; a checkpoint
      without its LoRA base lets only that base through, lora_base.over_base, and it is `source`'s), the layout-free
      copy at another layout (relayout.load reads each tensor the model has). The fp8 base is quantised from the
      skipped weights, then its codes and scales (buffers) are loaded over; block swap's host copies are the
      parameters loaded.

    Nothing else is the init's: the adapters draw from their own generator, the optimizer's states are the
    checkpoint's, and building draws nothing from the global generators (init_rng forks them), so a resume continues
    as the init-then-load one did, bit for bit (tests/distributed/test_resume_init_skip.py)."""
    return bool(source) or not init_from


def build_trainer(cfg: ExperimentConfig, ds: dict, ctx, init_from: bool = True,
                  model: Optional[torch.nn.Module] = None, base: Optional[str] = None) -> TrainingEngine:
    """Configure activation checkpointing, build the model for the layout, and initialise DeepSpeed.

    The model is built without the random init of its tensor-parallel layers (skip_init) wherever what comes next
    overwrites it (overwrites_init): the release read, or the checkpoint loaded. init_from=False says a checkpoint
    will be loaded (a resume, parallel.export, parallel.sample): the caller must load one (TrainingEngine.load)
    before the engine is used. With model.init_from (and init_from=True) every rank reads its part of the
    released weights into it before deepspeed.initialize, when parameters are still whole local tensors under
    every ZeRO stage (ZeRO-3 partitions them in initialize); then
    model.lora.init_from's adapters the same way. With model.lora the base is frozen (requires_grad False)
    and the optimizer, its EMA and DeepSpeed's master weights hold the adapters only; with model.lora.base_dtype
    its tensor-parallel linear weights then become fp8 buffers (parallel/model/lora.py apply_fp8_base), and with
    train.block_swap the last blocks' go to host memory (parallel/model/build.py apply_block_swap).
    `model`: a module the caller built for the layout (bench: the network with plain nn.Linear), used
    instead of building one. `base` (with init_from=False): the checkpoint to be loaded holds a LoRA run's adapters
    without its frozen base (parallel/checkpoints/lora_base.py), so the base is read from this release (lora_base.
    source: model.init_from, or the one the run read) as a fresh run reads it, model.lora.init_from not (the
    checkpoint's adapters replace it). The engine's `release` is where its own checkpoints leave the base.

    Last, the global generators are seeded for this rank's (stage, dp, sp) coordinate (seed.py seed_training_rng), so
    LoRA's dropout masks differ between replicas and token shards and agree between tp ranks; a resume at the same
    layout then sets them to the checkpoint's states (TrainingEngine.load).
    """
    deepspeed.init_distributed(dist_backend=accelerator.backend())   # no-op when run.py already did it
    check_deepspeed_version()
    ds_final = prepare_ds_config(ds, cfg, ctx.data_size)
    checkpoint_fn = None
    if checkpoint_interval(ds_final, cfg.model.num_layers):
        deepspeed.checkpointing.configure(ctx, deepspeed_config=copy.deepcopy(ds_final))
        checkpoint_fn = deepspeed.checkpointing.checkpoint
    source = cfg.model.init_from if init_from else base
    released = bool(source)
    if model is None:
        # the release or the checkpoint to be loaded overwrites every tensor the random init of the tensor-parallel
        # layers would draw (overwrites_init), so it is skipped; the global RNG is unchanged (each stage is built
        # in its own forked stream: parallel/distributed/seed.py init_rng)
        with skip_init() if overwrites_init(init_from, source) else contextlib.nullcontext():
            model = build_model(cfg, ds_final, ctx, checkpoint_fn)
    if released:
        from parallel.weights.diffusers import load_released
        load_released(model, ctx, cfg.model, source)
    if init_from and cfg.model.lora is not None and cfg.model.lora.init_from:
        from parallel.model.lora import load_lora
        load_lora(model, ctx, cfg.model, cfg.model.lora.init_from)
    if cfg.model.lora is not None and cfg.model.lora.base_dtype:     # fp8 base: after loading, before DeepSpeed
        from parallel.model.lora import apply_fp8_base
        apply_fp8_base(model, cfg.model)
    apply_block_swap(model, cfg, swap_dtype(ds_final))   # train.block_swap: swapped bases in host memory, before DeepSpeed
    optimizer = build_optimizer(model, ds, cfg.train)
    factor = schedule_factor(ds, cfg.train)
    schedule = lambda opt: build_schedule(opt, factor)
    mpu = None if cfg.parallel.pp_size > 1 else ctx      # the pipeline engine takes its grid from the module
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule,
                                           config=ds_final, mpu=mpu)
    use_weights_only_checkpoints(engine)
    clip_with_replica_norm(engine, lambda params: grad_norm(params, ctx))
    lighter_bf16_step(engine)       # BF16_Optimizer: the same numbers, fewer bytes and kernels per step
    # LoRA's dropout draws from the global generators: one stream per (stage, dp, sp), shared by its tp ranks
    seed_training_rng(cfg.train.seed, pp=ctx.pp_rank, dp=ctx.dp_rank, sp=ctx.sp_rank)
    return TrainingEngine(engine, cfg, ctx, optimizer, lora_base.release_of(cfg, source))


def grad_norm(params, ctx) -> torch.Tensor:
    """L2 norm of the gradients of one model replica: tp shards counted on every tp rank, replicated
    parameters once (tp rank 0), summed over the replica's pipeline stages and tp ranks."""
    sq = torch.zeros((), dtype=torch.float32, device=params[0].device if params else None)
    for p in params:
        if p.grad is not None and (getattr(p, "tensor_model_parallel", False) or ctx.tp_rank == 0):
            sq += p.grad.detach().float().norm() ** 2
    if ctx.model_group is not None:
        dist.all_reduce(sq, group=ctx.model_group)
    return sq.sqrt()
