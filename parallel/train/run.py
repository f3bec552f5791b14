"""The pieces of a training run that parallel/train/trainer.py's loop (and sampling, export, bench) put together:
the launcher's environment, process groups, datasets and batches, the DeepSpeed engine, the memory plan's line
and its check against a measured step (the plan itself: parallel/plan/memory.py run_plan, handed in by train.py)."""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import socket
from typing import Optional

import deepspeed
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from tqdm import tqdm

from parallel.train.data import DiffusionBatches, DirectoryLatents, IndexRange, SyntheticLatents
from models.diffusion import Objective
from models.geometry import latent_grid, latent_shape, token_grid
from models.registry import family, sequence_tokens
from parallel.distributed import accelerator
from parallel.experiment.config import ExperimentConfig
from parallel.train.engine import build_trainer
from parallel.train.probe import StepMeasurement
from parallel.distributed.deepspeed.shm import unlink_shm_buffer
from parallel.distributed.seed import seed_all
from parallel.distributed.topology import LaunchEnv, Layout, ParallelContext
from parallel.experiment.units import format_size, parse_size


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


def device_budget(cfg: ExperimentConfig, local_rank: int) -> int:
    """The bytes the run's memory plan must fit: train.device_memory, else this device's own."""
    if cfg.train.device_memory:
        return parse_size(cfg.train.device_memory, unit_required=True)
    return accelerator.total_memory(local_rank)


def plan_refusal(plan, cfg: ExperimentConfig, layout: Layout) -> str | None:
    """Why the run does not start, where its memory plan does not fit and train.allow_oversubscribe is false."""
    if plan.fits or cfg.train.allow_oversubscribe:
        return None
    w, budget = plan.worst, format_size(plan.device_memory)
    of = f"train.device_memory={cfg.train.device_memory}" if cfg.train.device_memory else \
        f"this {accelerator.name()} device's {budget}"
    return (f"memory plan: the worst rank (stage {w.stage}) needs {format_size(w.total)} of {of}, short by "
            f"{format_size(-plan.headroom)}: {layout.describe()} ZeRO-{layout.zero_stage} {layout.precision} does not "
            f"fit; python -m parallel.plan --world-size {layout.world_size} --device-memory {budget.replace(' ', '')} "
            f"--search (with this run's --config, --deepspeed-config and --set) lists the layouts that do; or set "
            f"--set train.allow_oversubscribe=true to start anyway")


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
    from models.text_encoder import build_text_encoder
    return build_text_encoder(cfg.data.text_encoder, cfg.model.max_text_len, cfg.model.text_embed_dim,
                              expected=family(cfg.model).formats.text_encoder, model=cfg.model)


def build_dataset(cfg: ExperimentConfig):
    stream = family(cfg.model).training_stream(cfg.model, cfg.data)       # LTX-2's audio, or None
    if cfg.data.kind == "directory":
        return DirectoryLatents(cfg.data.path, _text_encoder(cfg), stream=stream is not None)
    m = cfg.model
    return SyntheticLatents(cfg.data.num_samples, m.in_channels, latent_shape(m, cfg.data), m.max_text_len,
                            m.text_embed_dim, cfg.train.seed, stream.shapes() if stream else ())


def training_batches(cfg: ExperimentConfig, ctx, dataset=None, start_step: int = 0) -> DiffusionBatches:
    """This rank's micro-batches of the run (dataset: build_dataset(cfg) unless given), from `start_step`."""
    return DiffusionBatches(dataset if dataset is not None else build_dataset(cfg), Objective.of(cfg.model),
                            seed=cfg.train.seed, micro_batch=cfg.train.micro_batch_size,
                            grad_accum=cfg.train.grad_accum_steps, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size,
                            start_step=start_step, caption_dropout=cfg.data.caption_dropout,
                            condition=family(cfg.model).training_condition(cfg.model, cfg.data),
                            timesteps=family(cfg.model).timesteps, model=cfg.model,
                            stream=family(cfg.model).training_stream(cfg.model, cfg.data))


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


@contextlib.contextmanager
def layout_groups(cfg: ExperimentConfig, layout: Layout, env: LaunchEnv):
    """The layout's ParallelContext, in process groups created here and destroyed on leaving, or in those already
    up (a test's spawned ranks: DeepSpeed wraps their group, and they stay up). parallel.export and parallel.sample
    run their body in it."""
    owned = not dist.is_initialized()
    if owned:
        export_launch_env(env)
        accelerator.set_device(env.local_rank)
        init_process_groups(cfg.train.collective_timeout_s)
    else:
        deepspeed.init_distributed(dist_backend=accelerator.backend())
    try:
        yield ParallelContext.build(layout.dims)
    finally:
        if owned:
            dist.destroy_process_group()


def start_engine(cfg: ExperimentConfig, ds: dict, layout: Layout, env: LaunchEnv, init_from: bool = True,
                 base: Optional[str] = None):
    """Process groups, the (pp, dp, tp) context and the DeepSpeed engine for a checked layout
    (init_from=False: do not read model.init_from, a checkpoint will be loaded, so the model is built without the
    random init it overwrites; `base`: the release a LoRA checkpoint's base is read from, build_trainer's)."""
    export_launch_env(env)
    accelerator.set_device(env.local_rank)
    init_process_groups(cfg.train.collective_timeout_s)
    ctx = ParallelContext.build(layout.dims)
    seed_all(cfg.train.seed)
    return ctx, build_trainer(cfg, ds, ctx, init_from, base=base)


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
