"""The training run behind train.py: process groups, data, DeepSpeed engine, loop, metrics."""
from __future__ import annotations

import datetime
import json
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from tqdm import tqdm

from parallel.train.data import DiffusionBatches, DirectoryLatents, IndexRange, SyntheticLatents
from models.diffusion import Objective
from models.geometry import latent_grid, latent_shape, token_grid
from models.registry import family, sequence_tokens
from parallel.distributed import accelerator
from parallel.train import checkpoint
from parallel.check import Layout
from parallel.config import ExperimentConfig
from parallel.train.engine import build_trainer
from parallel.plan.probe import StepMeasurement, StepProbe
from parallel.distributed.deepspeed_compat import unlink_shm_buffer, write_monitor_events
from parallel.distributed.replicas import replica_mismatches
from parallel.distributed.seed import seed_all
from parallel.distributed.topology import LaunchEnv, ParallelContext
from parallel.train.validate import Validator, check_outputs
from parallel.train.watchdog import peer_failure, start_heartbeat
from parallel.units import format_size


class StopSignal:
    """SIGTERM / SIGUSR1 (slurm preemption) ask for a checkpoint and a clean stop after the current step."""

    def __init__(self, device):
        self.flag = torch.zeros(1, device=device)
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, lambda *_: self.flag.fill_(1))

    def requested(self) -> bool:
        """True on every rank if any rank was signalled (one scalar all-reduce per step)."""
        flag = self.flag.clone()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def export_launch_env(env: LaunchEnv) -> None:
    """Give torch.distributed the RANK/WORLD_SIZE/LOCAL_RANK it reads, whatever launcher set ours."""
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(env.local_world_size))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if env.world_size > 1:
            raise RuntimeError(f"{env.launcher} launcher: MASTER_ADDR/MASTER_PORT are not set; export them "
                               "(the first node's address and a free port) or launch with launch.sh")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


STATE_LINES = ("parameters", "gradients", "adam_moments", "master_weights", "ema_shadow")


def run_plan(cfg: ExperimentConfig, ds: dict, layout: Layout, device_memory: int, tokens: int | None = None):
    """The memory planner's prediction for this run's own layout (parallel/plan/cli.py prints the table):
    at the longest bucket of a directory of several shapes, or at a bucket of `tokens` tokens (a step's:
    the memory check compares a step with the plan of its own shape; shapes of equal tokens plan alike)."""
    from parallel.plan.memory import EngineSettings, plan_memory
    from parallel.plan.trace import ActivationTracer

    from parallel.train.bucket_check import bucket_configs

    shaped = [c for _, _, c in bucket_configs(cfg)]
    cfg = next((c for c in shaped if tokens == sequence_tokens(c.model, c.data)), shaped[0])
    tracer = ActivationTracer(cfg, EngineSettings.from_ds(ds, 1).dtype)
    return plan_memory(cfg, ds, layout.dp_size, device_memory, tracer)


def plan_line(plan) -> str:
    """The plan's verdict in one line."""
    w = plan.worst
    states = sum(w.lines[k] for k in STATE_LINES)
    return (f"memory plan: worst rank (stage {w.stage}) {format_size(w.total)} of "
            f"{format_size(plan.device_memory)} ({'fits' if plan.fits else 'DOES NOT FIT'}; activations "
            f"{format_size(w.lines['activations'])}, model states {format_size(states)}, margin "
            f"{format_size(w.lines['margin'])}); python -m parallel.plan for the breakdown")


def memory_check(plan, measured: list[dict]) -> dict:
    """Measured (every rank's StepProbe, plus the device peak where the accelerator has one) against the
    plan, for the worst rank of each pipeline stage."""
    stages = []
    for s in plan.stages:
        ranks = [m for m in measured if m["stage"] == s.stage]
        predicted_states = sum(s.lines[k] for k in STATE_LINES)
        row = {"stage": s.stage, "model_states": {"predicted": predicted_states,
                                                   "measured": max(m["states"] for m in ranks)},
               "activations_per_micro_batch": {"predicted": s.lines["activations"] // s.in_flight,
                                               "measured": max(m["activations"] for m in ranks)}}
        peaks = [m["device_peak"] for m in ranks if m["device_peak"] is not None]
        if peaks:                     # the allocator's peak against everything but the margin
            row["device_peak"] = {"predicted": s.total - s.lines["margin"], "measured": max(peaks)}
        stages.append(row)
    return {"stages": stages}


def memory_check_lines(report: dict, step: int) -> list[str]:
    out = []
    for row in report["stages"]:
        parts = []
        for key, label in (("model_states", "model states"), ("activations_per_micro_batch",
                                                             "saved activations per micro-batch"),
                           ("device_peak", "device peak")):
            if key in row:
                p, m = row[key]["predicted"], row[key]["measured"]
                parts.append(f"{label} {format_size(m)} vs {format_size(p)} ({m / p - 1:+.1%})" if p
                             else f"{label} {format_size(m)}")
        out.append(f"memory measured at step {step} vs plan, stage {row['stage']}: " + "; ".join(parts))
    return out


def _text_encoder(cfg: ExperimentConfig):
    if not cfg.data.text_encoder:
        return None
    from models.text_encoder import T5TextEncoder
    return T5TextEncoder(cfg.data.text_encoder, cfg.model.max_text_len, cfg.model.text_embed_dim,
                         expected_class=family(cfg.model).text_encoder)


def build_dataset(cfg: ExperimentConfig):
    if cfg.data.kind == "directory":
        return DirectoryLatents(cfg.data.path, _text_encoder(cfg))
    m = cfg.model
    return SyntheticLatents(cfg.data.num_samples, m.in_channels, latent_shape(m, cfg.data), m.max_text_len,
                            m.text_embed_dim, cfg.train.seed)


def training_batches(cfg: ExperimentConfig, ctx, dataset=None, start_step: int = 0) -> DiffusionBatches:
    """This rank's micro-batches of the run (dataset: build_dataset(cfg) unless given), from `start_step`."""
    return DiffusionBatches(dataset if dataset is not None else build_dataset(cfg), Objective.of(cfg.model),
                            seed=cfg.train.seed, micro_batch=cfg.train.micro_batch_size,
                            grad_accum=cfg.train.grad_accum_steps, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size,
                            start_step=start_step, caption_dropout=cfg.data.caption_dropout,
                            condition=family(cfg.model).training_condition(cfg.model, cfg.data))


def build_val_dataset(cfg: ExperimentConfig):
    """The validation set: `val.path`'s manifest, or synthetic samples after the training set's."""
    if cfg.val.path:
        return DirectoryLatents(cfg.val.path, _text_encoder(cfg))
    m = cfg.model
    base = SyntheticLatents(cfg.data.num_samples + cfg.val.num_samples, m.in_channels, latent_shape(m, cfg.data),
                            m.max_text_len, m.text_embed_dim, cfg.train.seed)
    return IndexRange(base, cfg.data.num_samples, cfg.val.num_samples)


def step_tokens(cfg: ExperimentConfig, batches: DiffusionBatches) -> int:
    """Sequence length of the next step (its bucket's, in a directory of several shapes)."""
    tokens, shape = sequence_tokens(cfg.model, cfg.data), batches.step_latent_shape()
    if shape is None:
        return tokens
    return tokens - math.prod(token_grid(cfg.model, cfg.data)) + math.prod(latent_grid(cfg.model, shape))


def checkpoint_layout(layout: Layout) -> dict:
    """What a checkpoint must match to be resumed as it is."""
    return {**layout.as_dict(), "zero_stage": layout.zero_stage}


def init_process_groups(timeout_s: int) -> None:
    """torch.distributed with one timeout for every collective, so a dead or stuck rank fails the run
    instead of hanging it. new_group() ignores init's timeout (gloo subgroups, DeepSpeed's pipeline groups
    among them, would wait 30 minutes), so the default for the groups created later is set too."""
    timeout = datetime.timedelta(seconds=timeout_s)
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    deepspeed.init_distributed(dist_backend=accelerator.backend(), timeout=timeout)
    dist.barrier()                  # every rank has mapped its peers' shared-memory buffers: drop the names
    unlink_shm_buffer()


def start_engine(cfg: ExperimentConfig, ds: dict, layout: Layout, env: LaunchEnv, init_from: bool = True):
    """Process groups, the (pp, dp, tp) context and the DeepSpeed engine for a checked layout
    (init_from=False: do not read model.init_from, a checkpoint will be loaded)."""
    export_launch_env(env)
    accelerator.set_device(env.local_rank)
    init_process_groups(cfg.train.collective_timeout_s)
    ctx = ParallelContext.build(layout.dims)
    seed_all(cfg.train.seed)
    return ctx, build_trainer(cfg, ds, ctx, init_from)


def report_memory(plan, measured: StepMeasurement, ctx, out_dir, step: int) -> None:
    """Gather every rank's measurement; the logger writes memory_check.json and prints the comparison."""
    mine = {"stage": ctx.pp_rank, "states": measured.states, "activations": max(measured.activations, default=0),
            "device_peak": accelerator.peak_allocated()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if out_dir is None:
        return
    report = {"step": step, **memory_check(plan, everyone)}
    (out_dir / "memory_check.json").write_text(json.dumps(report, indent=1) + "\n")
    for line in memory_check_lines(report, step):
        tqdm.write(line)


def run_training(cfg: ExperimentConfig, ds: dict, layout: Layout, env: LaunchEnv, resume: bool = True) -> int:
    if layout.precision == "bf16" and not accelerator.is_bf16_supported():
        print(f"refusing to start: bf16.enabled=true but the {accelerator.name()} device here has no bf16; "
              f"use ds_configs/zero0_fp32.json", file=sys.stderr)
        return 1
    dataset = build_dataset(cfg)               # a missing data file stops us before any process group
    val_dataset = build_val_dataset(cfg) if cfg.val.every else None
    try:
        check_outputs(cfg)
    except ValueError as e:
        print(f"refusing to start: {e}", file=sys.stderr)
        return 1

    ckpt_dir, ckpt_layout = Path(cfg.ckpt_dir), checkpoint_layout(layout)
    ckpt_layout["global_batch"] = layout.global_batch        # a resume must keep it (find_resume)
    try:
        tag = checkpoint.find_resume(ckpt_dir, ckpt_layout) if resume else None
    except ValueError as e:                    # a checkpoint this run cannot continue, said before any group
        if env.local_rank == 0:
            print(f"refusing to start: {e}", file=sys.stderr)
        return 1
    # The plan traces the model on the meta device: no process group needed, so a layout it cannot plan
    # stops here, before any rank waits on another.
    plan = run_plan(cfg, ds, layout, accelerator.total_memory(env.local_rank))
    ctx, trainer = start_engine(cfg, ds, layout, env, init_from=tag is None)   # a checkpoint wins over init_from
    heartbeat = start_heartbeat(cfg, ctx, ckpt_dir)
    start = trainer.load(ckpt_dir, tag) if tag else 0
    batches = training_batches(cfg, ctx, dataset, start)
    stop = StopSignal(accelerator.device(env.local_rank))

    is_logger = ctx.rank == 0
    out_dir = Path(cfg.train.output_dir)
    validator = Validator(cfg, trainer, ctx, val_dataset, out_dir if is_logger else None) if val_dataset else None
    if is_logger:
        print(plan_line(plan), flush=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        print(f"training {cfg.model.name}: {ctx.describe()} ZeRO-{layout.zero_stage} {layout.precision}, "
              f"global batch {layout.global_batch}, {cfg.train.max_steps} steps -> {out_dir}/metrics.jsonl",
              flush=True)
        print(f"optimizer: {trainer.optimizer.implementation}", flush=True)
        if cfg.model.init_from:
            print("initial weights: the checkpoint's (model.init_from is not read when resuming)" if tag else
                  f"initial weights: {cfg.model.init_from} (model.init_from)", flush=True)
        if tag:
            done = "; train.max_steps reached, nothing to do (raise it, or --resume never)" \
                if start >= cfg.train.max_steps else ""
            saved = checkpoint.saved_layout(ckpt_dir / tag)
            moved = "" if checkpoint.same_layout(saved, ckpt_layout) else \
                f" (written at {checkpoint.describe(saved)}, read from its layout-free copy)"
            print(f"resumed from {ckpt_dir}/{tag} at step {start}{moved}{done}", flush=True)
    metrics = open(out_dir / "metrics.jsonl", "a") if is_logger else None   # append: earlier runs are kept
    losses: list[float] = []
    probe_step = start + 1 if cfg.train.memory_check else -1
    resumed = {"resumed_from": start} if tag else {}     # on the first row after a resume: readers drop
    status = 0                                           # the earlier run's rows after that step
    bar = tqdm(total=cfg.train.max_steps, initial=start, disable=not is_logger, dynamic_ncols=True, file=sys.stderr)
    try:
        for step in range(start, cfg.train.max_steps):
            tic = time.perf_counter()
            tokens = layout.global_batch * step_tokens(cfg, batches)
            if step == probe_step:      # the second step: Adam moments exist, everything is allocated
                accelerator.reset_peak_memory()
                with StepProbe(trainer.engine) as probe:
                    result = trainer.train_step(batches)
                elapsed = time.perf_counter() - tic
                step_plan = plan if cfg.data.kind != "directory" else \
                    run_plan(cfg, ds, layout, plan.device_memory, tokens // layout.global_batch)
                report_memory(step_plan, probe.result, ctx, out_dir if is_logger else None, step + 1)
            else:
                result = trainer.train_step(batches)
                elapsed = time.perf_counter() - tic
            every = cfg.train.check_replicas_every
            if every and (step + 1) % every == 0:
                bad = replica_mismatches(trainer.engine.module, ctx)
                if bad:
                    raise RuntimeError(f"step {step + 1}: replicated parameters differ across tp ranks: {bad}")
            val = {}
            if validator and validator.due(step + 1):
                tic = time.perf_counter()
                val = {**validator.run(step + 1), "val_time_s": round(time.perf_counter() - tic, 4)}
            if is_logger and ((step + 1) % cfg.train.log_every == 0 or val):
                record = {"step": step + 1, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                          "step_time_s": round(elapsed, 4), "samples_per_s": round(layout.global_batch / elapsed, 3),
                          "tokens_per_s": round(tokens / elapsed, 1), **accelerator.memory_stats(), **val}
                metrics.write(json.dumps({**record, **resumed}) + "\n")
                resumed = {}
                metrics.flush()
                if val:
                    buckets = " ".join(f"t{k[10:]}={v:.4f}" for k, v in val.items() if k.startswith("val_loss_t"))
                    tqdm.write(f"step {step + 1}: validation loss {val['val_loss']:.4f} ({buckets})")
                    validator.publish()
                monitor = getattr(trainer.engine, "monitor", None)
                if monitor is not None and monitor.enabled:
                    write_monitor_events(monitor, [(f"{'val' if k.startswith('val_') else 'train'}/{k}", v, step + 1)
                                                   for k, v in record.items() if k != "step" and v is not None])
            losses.append(result.loss)
            bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{result.lr:.2e}")
            bar.update()
            last, interrupted = step + 1 == cfg.train.max_steps, stop.requested()
            if last or interrupted or (cfg.ckpt.every and (step + 1) % cfg.ckpt.every == 0):
                try:
                    checkpoint.save(trainer, ckpt_dir, step + 1, cfg.ckpt.keep, ckpt_layout)
                except checkpoint.CheckpointError as e:     # raised on every rank: all stop here
                    if is_logger:
                        tqdm.write(str(e), file=sys.stderr)     # on a line of its own, under the bar
                    status = 1
                    break
            if interrupted:
                if is_logger:
                    print(f"stopped by signal after step {step + 1}; checkpoint {ckpt_dir}/step{step + 1}", flush=True)
                break
        bar.close()
        if is_logger and len(losses) >= 10 and status == 0:
            k = min(10, len(losses) // 2)
            first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
            print(f"loss: mean of the first {k} steps {first:.4f} -> last {k} steps {last:.4f} "
                  f"({last / first:.2f}x)", flush=True)
        if (ds.get("comms_logger") or {}).get("enabled"):
            deepspeed.comm.log_summary()      # every rank (it starts with a barrier); rank 0 prints the table
    except RuntimeError as e:     # a peer's connection broke: wait for the lost-rank verdict, which ends
        if heartbeat and peer_failure(e):     # the process naming the ranks, rather than a bare traceback
            heartbeat.await_verdict()
        raise
    finally:
        bar.close()
        if metrics:
            metrics.close()
        if dist.is_initialized():
            dist.barrier()
            if heartbeat:
                heartbeat.stop()
            dist.destroy_process_group()
    return status
