"""Optimizers named in the DeepSpeed JSON, built by the toolkit so one name works on every device.

`"FusedEmaAdam"` (SwissArmyTransformer's name, as CogVideo configs use it) and its alias `"EmaAdamW"`
build `EmaAdamW`: AdamW plus an exponential moving average of every parameter it updates,

    shadow <- d * shadow + (1 - d) * p,   d = min(ema_decay, (1 + n) / (10 + n)),   n = step count,

applied right after the AdamW update (the FusedEmaAdam rule; ema_decay defaults to 0.9999). The
shadow lives in the optimizer state (`state[p]["ema"]`), so under ZeRO it exists only for the fp32
partition a rank owns, and DeepSpeed saves and restores it with every checkpoint.

The AdamW arithmetic is torch's: `fused=True` where torch has a fused kernel for the device (CUDA,
CPU), `foreach=True` elsewhere (Ascend NPU, others); the EMA uses `torch._foreach_*` in either case.

A model of several experts (Wan 2.2 A14B with both experts, models/wan/experts.py: parameters named
`...experts.{e}...`) gets each expert's own groups, tagged `"expert": e`, and an optimizer that leaves the
groups of the experts in `optimizer.idle` out of its step (`SkipsIdleExperts`): parameters, moments, step
count and EMA untouched, as in a run that trains the other expert alone. DeepSpeed flattens and partitions
each group on its own (ZeRO-1/2, BF16_Optimizer; ZeRO-3 by sub-groups of one group) and hands the client
optimizer one group at a time or all, keeping the group dicts, so the tag works at every ZeRO stage; the
trainer sets `idle` before each update (parallel/train/engine.py).
"""
from __future__ import annotations

import logging

import torch

from parallel.model.build import expert_of_parameter
from parallel.experiment.config import TrainConfig
from parallel.experiment.ds_config import ADAM_OPTIMIZERS, EMA_OPTIMIZERS

log = logging.getLogger(__name__)

FUSED_ADAMW_DEVICES = ("cuda", "cpu", "mps", "xpu")


def adamw_implementation(device_type: str) -> tuple[str, str]:
    """('fused' | 'foreach', why) for a device type such as 'cuda', 'npu', 'cpu'."""
    if device_type in FUSED_ADAMW_DEVICES:
        return "fused", f"torch has a fused AdamW kernel for {device_type}"
    return "foreach", f"no fused AdamW kernel for {device_type} in torch; multi-tensor (foreach) AdamW"


def ema_decay_at(step: int, ema_decay: float) -> float:
    return min(ema_decay, (1 + step) / (10 + step))


class EmaAdamW(torch.optim.AdamW):
    """AdamW followed by an EMA of the updated parameters (FusedEmaAdam's math, portable)."""

    def __init__(self, params, *, ema_decay: float = 0.9999, **adamw_kwargs):
        if not 0.0 <= ema_decay <= 1.0:
            raise ValueError(f"optimizer.params.ema_decay={ema_decay} must be in [0, 1]")
        super().__init__(params, **adamw_kwargs)
        for group in self.param_groups:
            group.setdefault("ema_decay", ema_decay)

    @torch.no_grad()
    def step(self, closure=None):
        # The shadow starts from the weights before their first update.
        fresh = {p: p.detach().clone() for g in self.param_groups for p in g["params"]
                 if p.grad is not None and "ema" not in self.state[p]}
        loss = super().step(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in fresh.keys() & set(params):
                self.state[p]["ema"] = fresh[p]
            shadows = [self.state[p]["ema"] for p in params]
            d = ema_decay_at(int(self.state[params[0]]["step"]), group["ema_decay"])
            torch._foreach_mul_(shadows, d)
            torch._foreach_add_(shadows, params, alpha=1 - d)
        return loss


class SkipsIdleExperts:
    """An optimizer whose param groups tagged `"expert": e` sit out step() while e is in `idle`."""

    idle: frozenset = frozenset()

    def step(self, closure=None):
        groups = self.param_groups
        self.param_groups = [g for g in groups if g.get("expert") not in self.idle]
        try:
            return super().step(closure)
        finally:
            self.param_groups = groups


class ExpertAdamW(SkipsIdleExperts, torch.optim.AdamW):
    """torch's AdamW, idle experts' groups left out of the step."""


class ExpertEmaAdamW(SkipsIdleExperts, EmaAdamW):
    """EmaAdamW, idle experts' groups (and their EMA) left out of the step."""


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The trainable parameters in groups: decay on matrices only; per expert (tagged "expert") when the model
    has several, then the parameters of no expert. Empty groups left out."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    experts = sorted({expert_of_parameter(n) for n, _ in named}, key=lambda e: (e is None, e))
    groups = []
    for e in experts:
        mine = [p for n, p in named if expert_of_parameter(n) == e]
        tag = {} if e is None else {"expert": e}
        groups += [{"params": [p for p in mine if p.dim() >= 2], "weight_decay": weight_decay, **tag},
                   {"params": [p for p in mine if p.dim() < 2], "weight_decay": 0.0, **tag}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, ds: dict, train: TrainConfig, device_type: str | None = None):
    """The JSON's optimizer (AdamW, Adam, FusedEmaAdam/EmaAdamW) at train.lr; decay on matrices only; a model of
    several experts: groups per expert, and an optimizer that skips the idle ones (module docstring)."""
    from parallel.distributed import accelerator

    section = ds.get("optimizer") or {"type": "AdamW", "params": {}}
    kind = str(section.get("type", "AdamW"))
    if kind.lower() not in EMA_OPTIMIZERS + ADAM_OPTIMIZERS:
        raise ValueError(f"optimizer.type={kind!r}: use AdamW, Adam, FusedEmaAdam or EmaAdamW")
    params = dict(section.get("params", {}))
    wd = float(params.pop("weight_decay", 0.0))
    kwargs = {k: params[k] for k in ("betas", "eps", "amsgrad") if k in params}
    device_type = device_type or accelerator.name()
    impl, why = adamw_implementation(device_type)
    kwargs[impl] = True
    groups = param_groups(model, wd)
    experts = any("expert" in g for g in groups)
    if kind.lower() in EMA_OPTIMIZERS:
        opt = (ExpertEmaAdamW if experts else EmaAdamW)(groups, lr=train.lr,
                                                         ema_decay=float(params.get("ema_decay", 0.9999)), **kwargs)
    else:
        opt = (ExpertAdamW if experts else torch.optim.AdamW)(groups, lr=train.lr, **kwargs)
    opt.implementation = f"{kind} -> {type(opt).__name__} with {impl} AdamW ({why})"
    log.info("optimizer: %s", opt.implementation)
    return opt
