"""The learning-rate schedule: the toolkit's own (train.*), or the DeepSpeed JSON's "scheduler" section.

Either way the toolkit builds it as a `torch.optim.lr_scheduler.LambdaLR` over the optimizer it built,
`lr(n) = train.lr * f(n)` at optimizer step n = 0, 1, ..., so a checkpoint holds one kind of schedule
state (LambdaLR's step count; and each expert's, below) and resumes to the same lr whichever schedule is in use.

The toolkit's own (no "scheduler" section), W = train.warmup_steps, D = train.decay_steps or train.max_steps,
m = train.min_lr / train.lr:

    f(n) = (n + 1) / W                                   n < W
    f(n) = m + (1 - m) (1 + cos(pi p)) / 2,  p = min(1, (n - W) / max(1, D - W))

DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR (deepspeed/runtime/lr_schedules.py, 0.19) as
DeepSpeed runs them: the scheduler sets the lr when built and after every optimizer step, so step n
runs at DeepSpeed's iteration i = n - 1, and i = -1 is the value set at construction. With
W = max(2, warmup_num_steps), T = total_num_steps:

    warmup  g(i) = log(i + 1) / log(W)  (warmup_type "log", DeepSpeed's default)  or  i / W  ("linear"),  i < W
    WarmupLR        lr = min_lr + (max_lr - min_lr) g(i);  g = 1 after warmup;          i = -1: min_lr
    WarmupDecayLR   as WarmupLR, then g(i) = max(0, (T - i) / max(1, T - W))
    WarmupCosineLR  lr = train.lr r(i):  r = r0 + (1 - r0) g(i) in warmup (r0 = warmup_min_ratio), then
                    r = c + (1 - c) (1 + cos(pi min(1, (i - W + 1) / max(1, T - W)))) / 2 (c = cos_min_ratio);
                    i = -1: 0

The section's keys that say what train.* already says (warmup_max_lr = train.lr, warmup_num_steps =
train.warmup_steps, total_num_steps = train.decay_steps or train.max_steps, cos_min_ratio = train.min_lr /
train.lr) are filled in from the experiment when absent (or "auto") and refused when they disagree, so
the numbers live in one place and the logged lr is the one the JSON describes.

A model of several experts (Wan 2.2 A14B with both, parallel/train/optim.py: groups tagged "expert": e) runs
each expert's groups at that expert's own update count, n_e = the updates e took part in, lr = train.lr * f(n_e)
(`ExpertLambdaLR`): an expert that sat out k steps (no sample chose it) resumes its warmup and decay where it
left them, as in a run that trains it alone. n_e is the step count of e's Adam states; an update skipped
altogether (the anomaly guard, an fp16 overflow) advances neither.

Where the two overlap they agree: after warmup (step n > W) WarmupCosineLR so filled in is the toolkit's
cosine step for step (DeepSpeed's i - W + 1 = n - W); during warmup DeepSpeed's ramp runs two steps
behind the toolkit's ((n - 1) / W from 0 at step 0, against (n + 1) / W).
"""
from __future__ import annotations

import difflib
import math
from typing import Any, Callable

import torch

from parallel.experiment.config import TrainConfig

WARMUP_TYPES = ("log", "linear")

# Each scheduler the toolkit honours -> the parameters DeepSpeed's class takes (last_batch_iteration aside).
SCHEDULERS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"),
}

REFUSED_SCHEDULERS = {
    "OneCycle": "its lr comes from cycle_min_lr/cycle_max_lr rather than train.lr, and it cycles Adam's beta1 "
                "(cycle_momentum), which optimizer.params.betas then no longer describes",
    "LRRangeTest": "it is an lr sweep that grows the lr without bound (a tool to pick train.lr), not a schedule "
                   "to train with",
}

USE_INSTEAD = ("use WarmupLR, WarmupDecayLR or WarmupCosineLR, or remove the \"scheduler\" section for the "
               "toolkit's schedule (train.lr, train.warmup_steps, train.min_lr, train.decay_steps)")


def lr_factor(step: int, train: TrainConfig) -> float:
    """The toolkit's own: linear warmup over train.warmup_steps, then cosine decay to train.min_lr at
    train.decay_steps (default train.max_steps)."""
    if train.warmup_steps and step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    span = max(1, (train.decay_steps or train.max_steps) - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    floor = train.min_lr / train.lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _total_key(train: TrainConfig) -> tuple[str, int]:
    return ("train.decay_steps", train.decay_steps) if train.decay_steps else ("train.max_steps", train.max_steps)


def _shared(kind: str, train: TrainConfig) -> dict[str, tuple[str, float, str]]:
    """The section's keys that train.* also sets -> (train key, value, what to --set)."""
    total_key, total = _total_key(train)
    out = {"warmup_num_steps": ("train.warmup_steps", train.warmup_steps, "train.warmup_steps={}")}
    if kind in ("WarmupLR", "WarmupDecayLR"):
        out["warmup_max_lr"] = ("train.lr", train.lr, "train.lr={}")
    if kind in ("WarmupDecayLR", "WarmupCosineLR"):
        out["total_num_steps"] = (total_key, total, total_key + "={}")
    if kind == "WarmupCosineLR":
        out["cos_min_ratio"] = ("train.min_lr / train.lr", train.min_lr / train.lr, "train.min_lr={}")
    return out


def _params(sched: dict[str, Any]) -> dict[str, Any]:
    """The section's params; "auto" (as Hugging Face writes it) counts as absent."""
    params = sched.get("params") or {}
    return {k: v for k, v in params.items() if v != "auto"} if isinstance(params, dict) else params


def scheduler_problems(ds: dict[str, Any], train: TrainConfig, src: str) -> list[str]:
    """Everything in the "scheduler" section the toolkit would not run exactly as DeepSpeed describes it."""
    if "scheduler" not in ds:
        return []
    sched = ds["scheduler"]
    if not isinstance(sched, dict) or "type" not in sched:
        return [f"{src}: scheduler needs a \"type\" (DeepSpeed ignores a section without one); {USE_INSTEAD}"]
    kind = sched["type"]
    if kind in REFUSED_SCHEDULERS:
        return [f"{src}: scheduler.type={kind!r} is refused: {REFUSED_SCHEDULERS[kind]}; {USE_INSTEAD}"]
    if kind not in SCHEDULERS:
        return [f"{src}: scheduler.type={kind!r} is not one the toolkit runs (DeepSpeed would build torch's "
                f"lr_scheduler.{kind} if it exists, and ignore it beside the toolkit's); {USE_INSTEAD}"]
    params = _params(sched)
    if not isinstance(params, dict):
        return [f"{src}: scheduler.params must be an object of {', '.join(SCHEDULERS[kind])}"]
    problems = []
    for key, value in params.items():
        if key == "last_batch_iteration":
            problems.append(f"{src}: scheduler.params.last_batch_iteration: the toolkit resumes the schedule "
                            f"from the checkpoint; remove it")
        elif key not in SCHEDULERS[kind]:
            close = difflib.get_close_matches(key, SCHEDULERS[kind], n=1, cutoff=0.6)
            hint = f" (did you mean \"{close[0]}\"?)" if close else ""
            problems.append(f"{src}: scheduler.params.{key}: {kind} has no such parameter{hint}; it takes "
                            f"{', '.join(SCHEDULERS[kind])}")
        elif key == "warmup_type":
            if value not in WARMUP_TYPES:
                problems.append(f"{src}: scheduler.params.warmup_type={value!r}: use \"log\" or \"linear\" "
                                f"(DeepSpeed would fall back to \"log\" with a warning)")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{src}: scheduler.params.{key}={value!r}: give one number (the toolkit's two "
                            f"parameter groups share one schedule)")
    if problems:
        return problems
    for key, (train_key, want, fix) in _shared(kind, train).items():
        if key in params and not math.isclose(float(params[key]), want, rel_tol=1e-9, abs_tol=1e-15):
            if key == "cos_min_ratio":
                fix = fix.format(f"{params[key] * train.lr:g}")
                ours = f"{train_key} = {train.min_lr} / {train.lr} = {want:g}"
            else:
                fix, ours = fix.format(params[key]), f"{train_key}={want}"
            problems.append(f"{src}: scheduler.params.{key}={params[key]} != {ours}; set --set {fix} or remove "
                            f"scheduler.params.{key} (it is filled in from the experiment)")
    steps = int(params.get("warmup_num_steps", train.warmup_steps))
    if steps < 2 and not problems:
        problems.append(f"{src}: scheduler.type={kind!r} with train.warmup_steps={train.warmup_steps}: DeepSpeed's "
                        f"{kind} warms up over max(2, warmup_num_steps) steps; set train.warmup_steps >= 2, "
                        f"or remove the \"scheduler\" section (the toolkit's schedule allows any warmup)")
    if kind == "WarmupLR" and (train.min_lr or train.decay_steps):
        problems.append(f"{src}: scheduler.type='WarmupLR' holds the lr at train.lr after warmup, but "
                        f"train.min_lr={train.min_lr} / train.decay_steps={train.decay_steps} ask for a decay; "
                        f"use WarmupCosineLR (cos_min_ratio = train.min_lr / train.lr) or unset them")
    if kind == "WarmupDecayLR" and train.min_lr:
        problems.append(f"{src}: scheduler.type='WarmupDecayLR' decays to 0, but train.min_lr={train.min_lr}; "
                        f"use WarmupCosineLR (cos_min_ratio = train.min_lr / train.lr) or set train.min_lr=0")
    return problems


def scheduler_params(ds: dict[str, Any], train: TrainConfig) -> tuple[str, dict[str, Any]] | None:
    """(type, every parameter with DeepSpeed's defaults and the experiment's values filled in), or None
    when the JSON has no "scheduler" section. Assumes scheduler_problems() found nothing."""
    sched = ds.get("scheduler")
    if sched is None:
        return None
    kind = sched["type"]
    params = {"warmup_min_lr": 0.0, "warmup_min_ratio": 0.0, "warmup_type": "log"}
    params.update({key: value for key, (_, value, _) in _shared(kind, train).items()})
    params.update(_params(sched))
    return kind, {k: v for k, v in params.items() if k in SCHEDULERS[kind]}


def _warmup(i: int, steps: int, warmup_type: str) -> float:
    return math.log(i + 1) / math.log(steps) if warmup_type == "log" else i / steps


def deepspeed_lr(i: int, kind: str, p: dict[str, Any], lr: float) -> float:
    """DeepSpeed's lr at its iteration i (-1: as built), for a section filled in by scheduler_params."""
    steps = max(2, int(p["warmup_num_steps"]))
    if kind == "WarmupCosineLR":
        if i < 0:
            return 0.0
        if i < steps:
            r0 = p["warmup_min_ratio"]
            return lr * (r0 + _warmup(i, steps, p["warmup_type"]) * (1 - r0))
        progress = min(1.0, (i - steps + 1) / max(1, p["total_num_steps"] - steps))
        c = p["cos_min_ratio"]
        return lr * max(0.0, c + (1 - c) * (1 + math.cos(math.pi * progress)) / 2)
    low, high = p["warmup_min_lr"], p["warmup_max_lr"]
    if i < 0:
        return low
    if i < steps:
        gamma = _warmup(i, steps, p["warmup_type"])
    elif kind == "WarmupDecayLR":
        total = p["total_num_steps"]
        gamma = max(0.0, (total - i) / max(1.0, total - steps))
    else:
        gamma = 1.0
    return low + (high - low) * gamma


def schedule_factor(ds: dict[str, Any], train: TrainConfig) -> Callable[[int], float]:
    """f(n) for LambdaLR: lr at optimizer step n = train.lr * f(n), from the JSON's scheduler or train.*."""
    found = scheduler_params(ds, train)
    if found is None:
        return lambda n: lr_factor(n, train)
    kind, params = found
    return lambda n: deepspeed_lr(n - 1, kind, params, train.lr) / train.lr


class ExpertLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose groups tagged "expert": e run at lr = base * f(n_e), n_e the updates of expert e so far
    (`expert_steps`); untagged groups at the global count (last_epoch). The experts in `optimizer.idle`
    (SkipsIdleExperts, set before the update) do not advance. Saved and loaded with the scheduler's state."""

    def __init__(self, optimizer, factor: Callable[[int], float]):
        experts = {g["expert"] for g in optimizer.param_groups if g.get("expert") is not None}
        self.expert_steps = [0] * (max(experts) + 1 if experts else 0)
        super().__init__(optimizer, factor)

    def step(self, epoch=None) -> None:
        if self._step_count > 0:                    # not the step LRScheduler.__init__ takes to set lr(0)
            idle = getattr(self.optimizer, "idle", frozenset())
            self.expert_steps = [n + (e not in idle) for e, n in enumerate(self.expert_steps)]
        super().step(epoch)

    def lrs(self) -> list[float]:
        """Each group's lr at the current counts."""
        return [base * fn(self.last_epoch if g.get("expert") is None else self.expert_steps[g["expert"]])
                for base, fn, g in zip(self.base_lrs, self.lr_lambdas, self.optimizer.param_groups)]

    def get_lr(self) -> list[float]:
        return self.lrs()

    def load_state_dict(self, state_dict: dict) -> None:
        """A state saved before per-expert counts (every group at the global count) continues that way."""
        super().load_state_dict({"expert_steps": [state_dict.get("last_epoch", 0)] * len(self.expert_steps),
                                 **state_dict})


def build_schedule(optimizer, factor: Callable[[int], float]) -> torch.optim.lr_scheduler.LambdaLR:
    """The LambdaLR of `factor` over `optimizer`; per-expert counts when it has expert groups."""
    if any(g.get("expert") is not None for g in optimizer.param_groups):
        return ExpertLambdaLR(optimizer, factor)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
