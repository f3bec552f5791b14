"""The training run behind train.py: process groups, data, DeepSpeed engine, loop, metrics."""
from __future__ import annotations

import datetime
import json
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

from models.data import DiffusionBatches, DirectoryLatents, SyntheticLatents
from models.diffusion import Objective
from models.dit import latent_shape, token_grid
from parallel import accelerator, checkpoint
from parallel.check import Layout
from parallel.config import ExperimentConfig
from parallel.engine import build_trainer
from parallel.replicas import replica_mismatches
from parallel.seed import seed_all
from parallel.topology import Grid, LaunchEnv, ParallelContext


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


def plan_line(cfg: ExperimentConfig, ds: dict, layout: Layout, device_memory: int) -> str:
    """The memory planner's verdict for this run's own layout, in one line (parallel/plan.py has the table)."""
    from parallel.plan_memory import EngineSettings, plan_memory
    from parallel.plan_trace import ActivationTracer

    tracer = ActivationTracer(cfg, EngineSettings.from_ds(ds, 1).dtype)
    plan = plan_memory(cfg, ds, layout.dp_size, device_memory, tracer)
    w = plan.worst
    states = sum(w.lines[k] for k in ("parameters", "gradients", "adam_moments", "master_weights", "ema_shadow"))
    size = lambda n: f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"  # noqa: E731
    return (f"memory plan: worst rank (stage {w.stage}) {size(w.total)} of {size(device_memory)} "
            f"({'fits' if plan.fits else 'DOES NOT FIT'}; activations {size(w.lines['activations'])}, model states "
            f"{size(states)}, margin {size(w.lines['margin'])}); python -m parallel.plan for the breakdown")


def build_dataset(cfg: ExperimentConfig):
    if cfg.data.kind == "directory":
        encoder = None
        if cfg.data.text_encoder:
            from models.text_encoder import T5TextEncoder
            encoder = T5TextEncoder(cfg.data.text_encoder, cfg.model.max_text_len, cfg.model.text_embed_dim)
        return DirectoryLatents(cfg.data.path, encoder)
    m = cfg.model
    return SyntheticLatents(cfg.data.num_samples, m.in_channels, latent_shape(m, cfg.data), m.max_text_len,
                            m.text_embed_dim, cfg.train.seed)


def tokens_per_sample(cfg: ExperimentConfig) -> int:
    t, h, w = token_grid(cfg.model, cfg.data)
    return cfg.model.max_text_len + t * h * w


def checkpoint_layout(layout: Layout) -> dict:
    """What a checkpoint must match to be resumed as it is."""
    return {"tp_size": layout.tp_size, "pp_size": layout.pp_size, "dp_size": layout.dp_size,
            "zero_stage": layout.zero_stage}


def init_process_groups(timeout_s: int) -> None:
    """torch.distributed with one timeout for every collective, so a dead or stuck rank fails the run
    instead of hanging it. new_group() ignores init's timeout (gloo subgroups, DeepSpeed's pipeline groups
    among them, would wait 30 minutes), so the default for the groups created later is set too."""
    timeout = datetime.timedelta(seconds=timeout_s)
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    deepspeed.init_distributed(dist_backend=accelerator.backend(), timeout=timeout)


def start_engine(cfg: ExperimentConfig, ds: dict, layout: Layout, env: LaunchEnv):
    """Process groups, the (pp, dp, tp) context and the DeepSpeed engine for a checked layout."""
    export_launch_env(env)
    accelerator.set_device(env.local_rank)
    init_process_groups(cfg.train.collective_timeout_s)
    ctx = ParallelContext.build(Grid(layout.pp_size, layout.dp_size, layout.tp_size))
    seed_all(cfg.train.seed)
    return ctx, build_trainer(cfg, ds, ctx)


def run_training(cfg: ExperimentConfig, ds: dict, layout: Layout, env: LaunchEnv, resume: bool = True) -> int:
    if layout.precision == "bf16" and not accelerator.is_bf16_supported():
        print(f"refusing to start: bf16.enabled=true but the {accelerator.name()} device here has no bf16; "
              f"use ds_configs/zero0_fp32.json", file=sys.stderr)
        return 1
    dataset = build_dataset(cfg)               # a missing data file stops us before any process group

    ctx, trainer = start_engine(cfg, ds, layout, env)
    ckpt_dir, ckpt_layout = Path(cfg.ckpt_dir), checkpoint_layout(layout)
    tag = checkpoint.find_resume(ckpt_dir, ckpt_layout) if resume else None
    start = trainer.load(ckpt_dir, tag) if tag else 0
    batches = DiffusionBatches(dataset, Objective(cfg.model.objective), seed=cfg.train.seed,
                               micro_batch=cfg.train.micro_batch_size, grad_accum=cfg.train.grad_accum_steps,
                               dp_rank=ctx.dp_rank, dp_size=ctx.dp_size, start_step=start)
    stop = StopSignal(accelerator.device(env.local_rank))

    is_logger = ctx.rank == 0
    out_dir = Path(cfg.train.output_dir)
    if is_logger:
        print(plan_line(cfg, ds, layout, accelerator.total_memory(env.local_rank)), flush=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        print(f"training {cfg.model.name}: {ctx.describe()} ZeRO-{layout.zero_stage} {layout.precision}, "
              f"global batch {layout.global_batch}, {cfg.train.max_steps} steps -> {out_dir}/metrics.jsonl",
              flush=True)
        print(f"optimizer: {trainer.optimizer.implementation}", flush=True)
        if tag:
            done = "; train.max_steps reached, nothing to do (raise it, or --resume never)" \
                if start >= cfg.train.max_steps else ""
            print(f"resumed from {ckpt_dir}/{tag} at step {start}{done}", flush=True)
    metrics = open(out_dir / "metrics.jsonl", "a") if is_logger else None   # append: earlier runs are kept
    tokens = layout.global_batch * tokens_per_sample(cfg)
    losses: list[float] = []
    bar = tqdm(total=cfg.train.max_steps, initial=start, disable=not is_logger, dynamic_ncols=True, file=sys.stderr)
    try:
        for step in range(start, cfg.train.max_steps):
            start = time.perf_counter()
            result = trainer.train_step(batches)
            elapsed = time.perf_counter() - start
            every = cfg.train.check_replicas_every
            if every and (step + 1) % every == 0:
                bad = replica_mismatches(trainer.engine.module, ctx)
                if bad:
                    raise RuntimeError(f"step {step + 1}: replicated parameters differ across tp ranks: {bad}")
            if is_logger and (step + 1) % cfg.train.log_every == 0:
                record = {"step": step + 1, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                          "step_time_s": round(elapsed, 4), "samples_per_s": round(layout.global_batch / elapsed, 3),
                          "tokens_per_s": round(tokens / elapsed, 1), **accelerator.memory_stats()}
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                monitor = getattr(trainer.engine, "monitor", None)
                if monitor is not None and monitor.enabled:
                    monitor.write_events([(f"train/{k}", v, step + 1) for k, v in record.items()
                                          if k != "step" and v is not None])
            losses.append(result.loss)
            bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{result.lr:.2e}")
            bar.update()
            last, interrupted = step + 1 == cfg.train.max_steps, stop.requested()
            if last or interrupted or (cfg.ckpt.every and (step + 1) % cfg.ckpt.every == 0):
                checkpoint.save(trainer, ckpt_dir, step + 1, cfg.ckpt.keep, ckpt_layout)
            if interrupted:
                if is_logger:
                    print(f"stopped by signal after step {step + 1}; checkpoint {ckpt_dir}/step{step + 1}", flush=True)
                break
        bar.close()
        if is_logger and len(losses) >= 10:
            k = min(10, len(losses) // 2)
            first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
            print(f"loss: mean of the first {k} steps {first:.4f} -> last {k} steps {last:.4f} "
                  f"({last / first:.2f}x)", flush=True)
    finally:
        bar.close()
        if metrics:
            metrics.close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    return 0
