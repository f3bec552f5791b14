"""The anomaly guard (train.anomaly): a step whose loss or gradient norm is not finite, whose loss is above
spike_factor x the running median of the last `window` applied steps, or whose batch held a latent file
that could not be read, is skipped (no optimizer update) or stops the run, the same way on every rank.

The decision, per step, after the backward of the last micro-batch and before the optimizer update
(parallel/train/engine.py, TrainingEngine.train_step; with the pipeline engine inside train_batch, before
its optimizer step: parallel/distributed/deepspeed/skip.py's guard_pipeline_updates, the loss judged on
the last stage, None elsewhere):

    reason_r = first of: a bad sample read on rank r | loss not finite | grad norm not finite (ZeRO-0:
               the replica's norm before clipping) | loss > spike_factor x median(last `window` losses)
    flag     = all-reduce MAX over every rank of [reason_r is not None]        (one scalar)
    reasons  = all-gather of the reason strings, only when flag = 1 (the rare path)

The loss is the step's global loss (every data-parallel replica's, already all-reduced), so every rank
sees the same value and the same median. A skipped step consumes its step number and its samples (step N
still names the same samples after a resume), but not the optimizer: weights, Adam moments and step
count, EMA and the LR schedule stay as they were (parallel/distributed/deepspeed/skip.py), so the run
continues as one that never saw that batch. Under ZeRO-1/2 the gradient norm is checked by DeepSpeed's
own overflow path (fp32: it skips a non-finite norm itself; the guard counts it when it reports one).

A bad sample in a directory dataset (a file that cannot be read any more: truncated or replaced after the
checker read its header; or one holding NaN or inf, a VAE overflow) is read through GuardedSamples: it is
replaced by zeros of the same shapes (the step still runs its collectives in lockstep) and its step is
skipped as above, or stops, as `bad_samples` says. Without train.anomaly a directory dataset still gets
this guard for its samples only, stopping on one: the file named, never a traceback.
"""
from __future__ import annotations

import math
import statistics
import sys
from collections import deque
from typing import Optional

import torch
import torch.distributed as dist
from tqdm import tqdm


class AnomalyStop(RuntimeError):
    """train.anomaly asked to stop; the message names the step, the samples and the reason."""


class AnomalyGuard:
    """Per-step anomaly decisions of one rank; `decide` is collective (every rank calls it every step)."""

    def __init__(self, cfg, device=None, values: bool = True):
        """cfg: train.anomaly (parallel.experiment.config.AnomalyConfig); values=False: judge unreadable samples only
        (the guard a directory dataset gets without train.anomaly, which stops on one)."""
        self.cfg, self.device, self.values = cfg, device, values
        self.history: deque[float] = deque(maxlen=cfg.window)
        self.bad_samples: list[str] = []          # GuardedSamples appends; cleared each step
        self.skipped = 0
        self.in_a_row = 0
        self.forced: Optional[str] = None         # the next step's reason, given alike on every rank

    def force(self, reason: Optional[str]) -> None:
        """Skip the next step for `reason` (the trainer: a batch a rollback went back past), or not (None)."""
        self.forced = reason

    def local_reason(self, loss: Optional[float], grad_norm: Optional[float]) -> Optional[str]:
        if self.forced:
            return self.forced
        if self.bad_samples:
            return f"unreadable sample {self.bad_samples[0]}"
        if not self.values or loss is None:        # None: a pipeline stage without the loss
            return None
        if not math.isfinite(loss):
            return f"loss {loss} is not finite"
        if grad_norm is not None and not math.isfinite(grad_norm):
            return f"gradient norm {grad_norm} is not finite"
        f = self.cfg.spike_factor
        if f is not None and len(self.history) >= self.cfg.min_history:
            median = statistics.median(self.history)
            if loss > f * median:
                return (f"loss {loss:.4f} is {loss / median:.1f}x the median {median:.4f} of the last "
                        f"{len(self.history)} steps (train.anomaly.spike_factor={f:g})")
        return None

    def decide(self, loss: Optional[float], grad_norm: Optional[float] = None) -> Optional[str]:
        """The reason to skip this step (the same on every rank), or None to apply it."""
        mine = self.local_reason(loss, grad_norm)
        self.bad_samples = []
        flag = torch.tensor([0.0 if mine is None else 1.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            if loss is not None:
                self.history.append(loss)
            self.in_a_row = 0
            return None
        reasons = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, mine)
        reason = next(x for x in reasons if x)
        if all(x == reason for x in reasons):      # the global loss: every rank saw the same
            return reason
        ranks = [r for r, x in enumerate(reasons) if x == reason]     # pipeline: the last stage's
        return f"{reason} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"

    def skip(self, step: int, reason: str, samples: list[int], is_logger: bool) -> bool:
        """Count a skipped step, say so (logging rank), and stop when asked or after max_skips in a row;
        True when the run should roll back (train.anomaly.action=rollback)."""
        self.skipped += 1
        self.in_a_row += 1
        unreadable = reason.startswith("unreadable")
        stop = self.cfg.action == "stop" or (unreadable and self.cfg.bad_samples == "stop") \
            or self.in_a_row > self.cfg.max_skips
        rollback = self.cfg.action == "rollback" and not unreadable and not self.forced and not stop
        advice = " (fix the file or drop its manifest.jsonl line, or --set 'train.anomaly={bad_samples: skip}' " \
            "to skip such steps)" if reason.startswith("unreadable") and stop else ""
        line = (f"step {step}: {reason}; samples {samples}; "
                + (f"stopping (train.anomaly){advice}" if stop else "update skipped, rolling back" if rollback else
                   f"update skipped ({self.skipped} skipped so far, train.anomaly.action={self.cfg.action})"))
        if is_logger:
            tqdm.write(line, file=sys.stderr)        # on a line of its own, under the progress bar
        if stop:
            why = f" ({self.in_a_row} in a row, train.anomaly.max_skips={self.cfg.max_skips})" \
                if self.in_a_row > self.cfg.max_skips else ""
            raise AnomalyStop(line + why)
        return rollback


class GuardedSamples:
    """A dataset whose unreadable samples become zeros of a readable sample of the same bucket's shapes
    (their step then skipped by the guard); every other attribute is the dataset's."""

    def __init__(self, dataset, guard: AnomalyGuard):
        self.dataset, self.guard = dataset, guard
        self.template: dict = {}        # latent shape -> a readable sample's tensors

    def __getattr__(self, name):
        return getattr(self.dataset, name)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        key = self._shape(i)
        name = self.dataset.items[i][0] if hasattr(self.dataset, "items") else f"index {i}"
        try:
            sample = self.dataset[i]
        except Exception as e:             # noqa: BLE001 - any reader's failure on a bad file
            if key not in self.template:
                self.template[key] = self._readable(key, i)
            self.guard.bad_samples.append(f"{name} ({type(e).__name__}: {str(e)[:120]})")
            return tuple(torch.zeros_like(t) for t in self.template[key])
        if not all(torch.isfinite(t).all() for t in sample if t.is_floating_point()):    # a VAE overflow
            self.guard.bad_samples.append(f"{name} (holds NaN or inf values)")
            return tuple(torch.zeros_like(t) for t in sample)
        self.template.setdefault(key, sample)
        return sample

    def _shape(self, i: int):
        shapes = getattr(self.dataset, "shapes", None)
        return None if shapes is None or shapes[i] is None else tuple(shapes[i])

    def _readable(self, key, bad: int):
        for j in range(len(self.dataset)):
            if j != bad and self._shape(j) == key:
                try:
                    return self.dataset[j]
                except Exception:      # noqa: BLE001
                    continue
        raise RuntimeError(f"no readable sample of shape {key} in the dataset")
