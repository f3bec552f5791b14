"""The training loop behind train.py, as a class whose parts a model family or an objective overrides.

    Trainer(cfg, ds, layout, env, planner=run_plan).fit()     # 0, or 1 when a checkpoint could not be written

(run_plan: parallel/plan/memory.py's memory plan, handed in by train.py, since the planner sits above training.)

`fit` is the loop and nothing else; each of its concerns is a method:

    start()            process groups, the DeepSpeed engine, the checkpoint to resume, batches, validator
    step(batches)      one optimizer step over the global batch -> StepResult (loss, grad norm, lr): the
                       extension point (torchtitan's FluxTrainer overrides forward_backward_step the same way)
    timed_step(step)   step() timed, and measured against the memory plan once (train.memory_check)
    check_replicas(n)  tp replicas of replicated parameters still equal (train.check_replicas_every)
    validate(n)        the validation losses and samples due after step n ({} when none are)
    log(n, ...)        the metrics.jsonl row, the validation line, DeepSpeed's monitors (logging rank)
    save(n)            a checkpoint (parallel/checkpoints/checkpoint.py); False when it could not be written
    finish(status)     the loss summary and the comms table
    close()            metrics file, heartbeat and process groups, however the loop ended

A subclass replaces `step` (say, another objective's loss) and the loop, checkpoints, metrics and
validation stay as they are. Every refusal of the configuration happens before this class is built
(parallel/check.py's load_and_check, resume included), when no process group exists yet.
"""
from __future__ import annotations

import json
import math
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator, Optional

import deepspeed
import torch
import torch.distributed as dist
from tqdm import tqdm

from parallel.distributed.topology import Layout
from parallel.experiment.cli import refused
from parallel.experiment.config import AnomalyConfig, ConfigError, ExperimentConfig
from parallel.distributed import accelerator
from parallel.experiment.ds_config import EMA_OPTIMIZERS
from parallel.distributed.deepspeed.monitor import close_monitors, write_monitor_events
from parallel.distributed.deepspeed.zero3 import full_shape
from parallel.distributed.replicas import replica_mismatches
from parallel.distributed.topology import LaunchEnv
from parallel.train.probe import StepProbe
from parallel.checkpoints import checkpoint, lora_base
from parallel.train.anomaly import AnomalyGuard, AnomalyStop, GuardedSamples
from parallel.train.continuity import resume_changes, run_records
from parallel.train.engine import StepResult
from parallel.train.run import (build_dataset, build_val_dataset, checkpoint_layout, device_budget, plan_line,
                                plan_refusal, report_memory, start_engine, step_tokens, training_batches)
from parallel.validation.validate import Validator
from parallel.train.watchdog import collective_in, peer_failure, start_heartbeat, timed_out


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


class Trainer:
    """One training run of a checked experiment (cfg, DeepSpeed dict, layout) on this process's rank."""

    def __init__(self, cfg: ExperimentConfig, ds: dict, layout: Layout, env: LaunchEnv, resume: bool | int = True,
                 *, planner: Callable):
        """resume: True continues from the newest usable checkpoint, False starts from step 0, an int from
        that step's checkpoint only. planner: (cfg, ds, layout, device memory, tokens=None) -> the memory plan
        (parallel/plan/memory.py run_plan, which train.py passes: the planner sits above training, which never
        imports it)."""
        self.cfg, self.ds, self.layout, self.env, self.resume = cfg, ds, layout, env, resume
        self.planner = planner
        self.ckpt_dir = Path(cfg.ckpt_dir)
        self.ckpt_layout = {**checkpoint_layout(layout), "global_batch": layout.global_batch}  # a resume keeps it
        self.model_keys = checkpoint.model_signature(cfg.model)    # recorded in each checkpoint, checked on resume
        self.records = run_records(cfg, ds)          # the data order and schedule, compared on resume
        self.out_dir = Path(cfg.train.output_dir)
        self.metrics = self.heartbeat = None
        self.base_record: dict = {}                # the marker's lora_base record (release_record)
        self.rolled_past: dict[int, str] = {}      # step index -> why: skipped when reached after a rollback
        self.losses: list[float] = []

    def start(self) -> None:
        """Everything before the first step; the datasets first, so a missing file stops us before any group."""
        cfg, layout, env = self.cfg, self.layout, self.env
        dataset = build_dataset(cfg)
        device = accelerator.device(env.local_rank)
        self.guard = AnomalyGuard(cfg.train.anomaly, device) if cfg.train.anomaly else None
        if cfg.data.kind == "directory":      # an unreadable latent: its step skipped and counted, or a stop
            self.guard = self.guard or AnomalyGuard(AnomalyConfig(action="stop", bad_samples="stop"), device,
                                                    values=False)
            dataset = GuardedSamples(dataset, self.guard)
        self.dataset = dataset
        val_dataset = build_val_dataset(cfg) if cfg.val.every else None
        step = None if self.resume is True else self.resume       # an int: train.py --checkpoint N
        self.tag = checkpoint.find_resume(self.ckpt_dir, self.ckpt_layout, model=self.model_keys, step=step,
                                          release=cfg.model.init_from) if self.resume is not False else None
        # The plan traces the model on the meta device: no process group needed, so a layout it cannot plan
        # stops here, before any rank waits on another.
        self.plan = self.planner(cfg, self.ds, layout, device_budget(cfg, env.local_rank))
        refusal = plan_refusal(self.plan, cfg, layout)
        if refusal:                 # before any process group: every rank plans alike and stops
            raise ConfigError(refusal)
        # a checkpoint wins over model.init_from (but for a LoRA base it left in its release: lora_base.source)
        base = lora_base.source(self.ckpt_dir / self.tag, cfg.model.init_from) if self.tag else None
        self.ctx, self.engine = start_engine(cfg, self.ds, layout, env, init_from=self.tag is None, base=base)
        self.heartbeat = start_heartbeat(cfg, self.ctx, self.ckpt_dir)
        self.ckpt_predicted = self.predict_checkpoint()
        if self.tag:         # every file's checksum, read by all ranks together, before any weight is loaded
            try:
                self.tag = checkpoint.verified_resume(self.ckpt_dir, self.ckpt_layout, self.model_keys, step,
                                                      release=cfg.model.init_from)
            except ValueError as e:      # every rank: all damaged; refused, nothing written
                raise checkpoint.CheckpointError(str(e)) from None
        self.base_record = self.release_record()
        self.start_step = self.engine.load(self.ckpt_dir, self.tag) if self.tag else 0
        self.batches = training_batches(cfg, self.ctx, dataset, self.start_step)
        self.stop = StopSignal(accelerator.device(env.local_rank))
        self.is_logger = self.ctx.rank == 0
        self.validator = Validator(cfg, self.engine, self.ctx, val_dataset, self.out_dir if self.is_logger else None) \
            if val_dataset else None
        if self.is_logger:
            self.announce()
        self.metrics = open(self.out_dir / "metrics.jsonl", "a") if self.is_logger else None  # earlier runs kept
        self.probe_step = self.start_step + 1 if cfg.train.memory_check else -1
        # on the first row after a resume: readers drop the earlier run's rows after that step
        self.resumed = {"resumed_from": self.start_step} if self.tag else {}

    def release_record(self) -> dict:
        """The marker's lora_base record of the release this run's checkpoints leave the base in ({} where they hold
        it): the resumed checkpoint's when it read the base from the same files (verified_resume checked their
        bytes), else their checksums taken now, the ranks a share each."""
        release = self.engine.release
        if release is None:
            return {}
        saved = lora_base.record(self.ckpt_dir / self.tag) if self.tag else None
        if saved is not None:
            return {lora_base.KEY: {**saved, "init_from": release}}
        return {lora_base.KEY: lora_base.fingerprint(self.cfg.model, release)}

    def predict_checkpoint(self) -> int:
        """checkpoint.predicted_bytes for this run: the parameters and buffers of one replica (dp and sp rank 0: each
        tensor-parallel slice and pipeline stage once; ZeRO-3's partitioned ones at their full size)."""
        module = self.engine.engine.module
        params = list(module.parameters())
        count = lambda ps: sum(math.prod(full_shape(p)) for p in ps)
        buffers = sum(b.numel() * b.element_size() for b in module.buffers())
        mine = (count(params), count(p for p in params if p.requires_grad), buffers) \
            if self.ctx.dp_rank == 0 and self.ctx.sp_rank == 0 else (0, 0, 0)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        ema = str(self.ds.get("optimizer", {}).get("type", "")).lower() in EMA_OPTIMIZERS
        total = [sum(column) for column in zip(*every)]
        return checkpoint.predicted_bytes(total[0], total[1], self.layout.precision, ema, self.cfg.ckpt.layout_free,
                                          buffer_bytes=total[2], base=self.engine.release is None)

    def announce(self) -> None:
        """The logging rank's opening lines: the memory plan, the layout, the optimizer, where weights come from."""
        cfg, layout, tag, start = self.cfg, self.layout, self.tag, self.start_step
        print(plan_line(self.plan), flush=True)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        print(f"training {cfg.model.name}: {self.ctx.describe()} ZeRO-{layout.zero_stage} {layout.precision}, "
              f"global batch {layout.global_batch}, {cfg.train.max_steps} steps -> {self.out_dir}/metrics.jsonl",
              flush=True)
        print(f"optimizer: {self.engine.optimizer.implementation}", flush=True)
        if cfg.model.init_from:
            print("initial weights: the checkpoint's (model.init_from is not read when resuming)" if tag else
                  f"initial weights: {cfg.model.init_from} (model.init_from)", flush=True)
        if tag:
            done = "; train.max_steps reached, nothing to do (raise it, or --checkpoint none)" \
                if start >= cfg.train.max_steps else ""
            saved = checkpoint.saved_layout(self.ckpt_dir / tag)
            moved = "" if checkpoint.same_layout(saved, self.ckpt_layout) else \
                f" (written at {checkpoint.describe(saved)}, read from its layout-free copy)"
            print(f"resumed from {self.ckpt_dir}/{tag} at step {start}{moved}{done}", flush=True)
            changed = resume_changes(self.ckpt_dir / tag, self.records)
            if changed:
                print(changed, flush=True)

    def step(self, batches: Iterator) -> StepResult:
        """One optimizer step over the global batch: forward, backward and update of every micro-batch."""
        return self.engine.train_step(batches, self.guard)

    def timed_step(self, step: int) -> tuple[StepResult, float, int]:
        """(result, seconds, tokens of the global batch) of step `step` + 1. The step after the first
        (Adam moments exist, everything is allocated) is measured against the memory plan of its shape."""
        cfg, layout = self.cfg, self.layout
        tic = time.perf_counter()
        tokens = layout.global_batch * step_tokens(cfg, self.batches)
        if step != self.probe_step:
            result = self.step(self.batches)
            return result, time.perf_counter() - tic, tokens
        accelerator.reset_peak_memory()
        with StepProbe(self.engine.engine) as probe:
            result = self.step(self.batches)
        elapsed = time.perf_counter() - tic
        step_plan = self.plan if cfg.data.kind != "directory" else \
            self.planner(cfg, self.ds, layout, self.plan.device_memory, tokens // layout.global_batch)
        report_memory(step_plan, probe.result, self.ctx, self.out_dir if self.is_logger else None, step + 1)
        return result, elapsed, tokens

    def check_replicas(self, done: int) -> None:
        every = self.cfg.train.check_replicas_every
        if every and done % every == 0:
            bad = replica_mismatches(self.engine.engine.module, self.ctx)
            if bad:
                raise RuntimeError(f"step {done}: replicated parameters differ across tp ranks: {bad}")

    def at(self, step: int, phase: str) -> None:
        """Where the main thread is, for the hang watchdog (heartbeat.PHASES)."""
        if self.heartbeat:
            self.heartbeat.at(step, phase)

    def validate(self, done: int) -> dict:
        if not (self.validator and self.validator.due(done)):
            return {}
        self.at(done, "validation")
        tic = time.perf_counter()
        return {**self.validator.run(done), "val_time_s": round(time.perf_counter() - tic, 4)}

    def log(self, done: int, result: StepResult, elapsed: float, tokens: int, val: dict) -> None:
        """metrics.jsonl every train.log_every steps and with every validation; the logging rank only."""
        if not self.is_logger or not (done % self.cfg.train.log_every == 0 or val):
            return
        batch = self.layout.global_batch
        record = {"step": done, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                  "step_time_s": round(elapsed, 4), "samples_per_s": round(batch / elapsed, 3),
                  "tokens_per_s": round(tokens / elapsed, 1), **accelerator.memory_stats(), **val}
        for e, lr in enumerate(result.expert_lrs or ()):       # several experts, each at its own schedule count
            record[f"lr_expert{e}"] = lr
        if self.guard and (self.cfg.train.anomaly or self.guard.skipped):
            record["anomalies"] = self.guard.skipped
            if result.skipped:
                record["skipped"] = result.skipped
        self.metrics.write(json.dumps({**record, **self.resumed}) + "\n")
        self.resumed = {}
        self.metrics.flush()
        if val:
            buckets = " ".join(f"t{k[10:]}={v:.4f}" for k, v in val.items() if k.startswith("val_loss_t"))
            tqdm.write(f"step {done}: validation loss {val['val_loss']:.4f} ({buckets})")
            self.validator.publish()
        monitor = getattr(self.engine.engine, "monitor", None)
        if monitor is not None and monitor.enabled:
            write_monitor_events(monitor, [(f"{'val' if k.startswith('val_') else 'train'}/{k}", v, done)
                                           for k, v in record.items() if k != "step" and v is not None])

    def skip(self, step: int, result: StepResult) -> Optional[int]:
        """A step the anomaly guard skipped: counted and said with its samples; AnomalyStop when it must stop.
        train.anomaly.action=rollback: the newest verified checkpoint before it is loaded and its batch is
        skipped when the run gets there again; the step to continue from (None without a rollback)."""
        g = self.layout.global_batch
        samples = [self.batches.sample_index(step * g + j) for j in range(g)]
        if not self.guard.skip(step + 1, result.skipped, samples, self.is_logger) or step in self.rolled_past:
            return None
        tag = checkpoint.verified_resume(self.ckpt_dir, self.ckpt_layout, self.model_keys, quiet=True,
                                         release=self.cfg.model.init_from, check_release=False) \
            if checkpoint.complete_steps(self.ckpt_dir) else None
        if tag is None or int(tag[4:]) > step:
            raise AnomalyStop(f"step {step + 1}: train.anomaly.action=rollback found no checkpoint before it in "
                              f"{self.ckpt_dir}; stopping (set ckpt.every to keep one)")
        back = self.engine.load(self.ckpt_dir, tag)
        self.rolled_past[step] = f"rolled back past it: {result.skipped}"
        self.batches = training_batches(self.cfg, self.ctx, self.dataset, back)
        if self.is_logger:
            tqdm.write(f"step {step + 1}: rolled back to {self.ckpt_dir}/{tag}; step {step + 1}'s batch will be "
                       f"skipped", file=sys.stderr)
        return back

    def save(self, done: int) -> bool:
        """Checkpoint step `done`; False (on every rank, the reason printed once) when it could not be written."""
        self.at(done, "checkpoint save")
        try:
            checkpoint.save(self.engine, self.ckpt_dir, done, self.cfg.ckpt.keep, self.ckpt_layout, self.model_keys,
                            {**self.records, **self.base_record}, self.ckpt_predicted)
        except checkpoint.CheckpointError as e:      # raised on every rank: all stop
            if self.is_logger:
                tqdm.write(str(e), file=sys.stderr)      # on a line of its own, under the bar
            return False
        return True

    def fit(self) -> int:
        """Train from the resumed step to train.max_steps; the exit status."""
        cfg = self.cfg
        try:
            self.start()
        except checkpoint.CheckpointError as e:      # the checkpoint to resume turned out damaged
            if self.env.rank == 0:
                print(str(e), file=sys.stderr, flush=True)
            self.close()
            return 1
        except ConfigError as e:                  # the memory plan does not fit (train.py's heading)
            if self.env.local_rank == 0:
                refused("train.py", str(e))
            self.close()
            return 1
        status = 0
        bar = tqdm(total=cfg.train.max_steps, initial=self.start_step, disable=not self.is_logger,
                   dynamic_ncols=True, file=sys.stderr)
        try:
            step = self.start_step
            while step < cfg.train.max_steps:
                done = step + 1
                if self.guard:      # a batch a rollback went back past is skipped, on every rank alike
                    self.guard.force(self.rolled_past.get(step))
                self.at(done, "forward/backward")
                result, elapsed, tokens = self.timed_step(step)
                back = self.skip(step, result) if result.skipped else None
                self.check_replicas(done)
                self.log(done, result, elapsed, tokens, self.validate(done) if back is None else {})
                if back is not None:            # rolled back: continue from the checkpoint's step
                    step, self.resumed = back, {"resumed_from": back}    # readers drop the rows after it
                    bar.reset(total=cfg.train.max_steps)
                    bar.update(step)
                    continue
                step += 1
                if not result.skipped:
                    self.losses.append(result.loss)
                bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{result.lr:.2e}")
                bar.update()
                last, interrupted = done == cfg.train.max_steps, self.stop.requested()
                if last or interrupted or (cfg.ckpt.every and done % cfg.ckpt.every == 0):
                    if not self.save(done):
                        status = 1
                        break
                if interrupted:
                    if self.is_logger:
                        print(f"stopped by signal after step {done}; checkpoint {self.ckpt_dir}/step{done}", flush=True)
                    break
            bar.close()
            self.finish(status)
        except AnomalyStop:           # every rank, the same step; said by the logging rank; no checkpoint
            status = 1
            self.finish(status)
        except RuntimeError as e:     # a peer's connection broke or a collective timed out: wait for the
            if self.heartbeat and (peer_failure(e) or timed_out(e)):     # verdict, which ends the process naming
                where = collective_in(traceback.extract_tb(e.__traceback__)) or "collective"    # the ranks,
                self.heartbeat.await_verdict(collective=where if timed_out(e) else "")            # not a traceback
            raise
        finally:
            bar.close()
            self.close()
        return status

    def finish(self, status: int) -> None:
        losses = self.losses
        if self.is_logger and len(losses) >= 10 and status == 0:
            k = min(10, len(losses) // 2)
            first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
            print(f"loss: mean of the first {k} steps {first:.4f} -> last {k} steps {last:.4f} "
                  f"({last / first:.2f}x)", flush=True)
        if (self.ds.get("comms_logger") or {}).get("enabled"):
            deepspeed.comm.log_summary()      # every rank (it starts with a barrier); rank 0 prints the table

    def close(self) -> None:
        """Close every file and sink (train.py's ranks leave without the interpreter's teardown:
        parallel.experiment.cli.run), then the process group."""
        if self.metrics:
            self.metrics.close()
        engine = getattr(self, "engine", None)
        if engine is not None and dist.is_initialized():
            close_monitors(getattr(engine.engine, "monitor", None))
        if dist.is_initialized():
            self.at(self.cfg.train.max_steps, "shutdown")
            dist.barrier()
            if self.heartbeat:
                self.heartbeat.stop()
            dist.destroy_process_group()
