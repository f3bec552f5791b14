"""How far Adam may carry fp32 round-off of the gradients into the weights: the per-element bound the
equivalence tests (tests/train_utils.assert_matches) allow beyond fp32 tolerance.

A layout sums each gradient in another order than one process, so its gradients differ from the
reference's by fp32 round-off, delta. Adam moves a weight by lr r, r = m/(sqrt(v) + eps) (bias-corrected
moments), which is scale-free: where sqrt(v) >> delta the round-off stays round-off, but where the
gradient cancels to within a few eps of zero, the update is still about lr x sign(g) and its round-off
is amplified up to lr delta / eps. Seen on dp 2 x tp 2 (blocks.2.ff_out.weight of `debug`): step 1's
gradient -1.719e-9 (one process) vs -1.673e-9 (layout), a 4.7e-11 difference, moved the weight by
-4.40e-4 vs -4.30e-4: 1.02e-5 apart, over assert_close's 1e-5, while every gradient agreed to 17 ulps
of its tensor's largest.

The bound. m is a convex combination of the gradients and sqrt(v) a weighted root mean square of them,
so if every step's gradient is off by at most delta, m and sqrt(v) are off by at most delta and

    |r' - r| <= |m' - m| / D' + |m| |D' - D| / (D D') <= delta (1 + |r|) / max(D - delta, eps),

D = sqrt(v) + eps. Summed over the steps (AdamW's decay only shrinks earlier differences), with lr,
m, v taken from the one-process reference after each step, this is `slack`. delta is ROUNDOFF_ULPS
ulps of the element's gradient scale: a weight gradient sum_s dy_so x_si rounds relative to the sizes
of its terms, which its row (dy_o) and its column (x_i) carry, not relative to its own size, which
cancellation brings near zero; the scale is the geometric mean of the largest sqrt(v) in the element's
row and in its column (a vector's largest). Measured at dp 2 x tp 2, step 1: gradients off by at most
17 of these ulps.

First order only: a weight that Adam moved 1e-5 apart changes the next steps' gradients of its
neighbours by more than round-off (at dp 2 x tp 2, blocks.2.ff_in's m at step 2: 200 ulps, after the
ff_out weight above). Those gradients are not near zero, so Adam passes that on at about lr x 200 ulps
/ sqrt(v), inside fp32 tolerance; the bound does not cover a second near-zero gradient that depends on
a first one's difference (the worst element of the measured run used 5 % of its allowance).

Elements far from zero get a slack far under fp32 tolerance; of `debug`'s 313k weights about 0.8 %
(near-zero gradients) get more than 1e-5, the failing one 3.2e-4 (its measured difference: 1.02e-5).
"""
from __future__ import annotations

from itertools import islice

import torch

ROUNDOFF_ULPS = 32
FP32_ULP = 2.0 ** -24


def gradient_scale(rms: torch.Tensor) -> torch.Tensor:
    """Per element: the geometric mean of the largest `rms` in its row (dim 0 index) and in its column
    (the other dims' index); a vector's largest for vectors."""
    if rms.dim() < 2:
        return rms.max().expand_as(rms) if rms.numel() else rms
    rows = rms.amax(dim=tuple(range(1, rms.dim())), keepdim=True)
    cols = rms.amax(dim=0, keepdim=True)
    return (rows * cols).sqrt().expand_as(rms)


def step_slack(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, lr: float, betas, eps: float
               ) -> torch.Tensor:
    """This step's bound on |Delta w| per element (see the module docstring), from torch Adam's state."""
    b1, b2 = betas
    m = exp_avg.float() / (1 - b1 ** step)
    rms = (exp_avg_sq.float() / (1 - b2 ** step)).sqrt()
    d = rms + eps
    delta = ROUNDOFF_ULPS * FP32_ULP * gradient_scale(rms)
    return lr * delta * (1 + m.abs() / d) / (d - delta).clamp(min=eps)


def add_step_slack(slack: dict, trainer, ctx, num_blocks: int, lr: float) -> None:
    """Accumulate into `slack` (canonical name -> tensor) the step just taken by `trainer`'s Adam. One
    process: its parameters are full (ZeRO-0's optimizer state or ZeRO's fragments, gathered)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    from parallel.distributed.deepspeed.optimizer import relink_optimizer_fragments
    from parallel.distributed.deepspeed.zero3 import full_shape
    from parallel.weights.gather import full_tensors

    relink_optimizer_fragments(trainer.engine.optimizer)
    group = trainer.optimizer.param_groups[0]
    steps = [int(s["step"]) for s in trainer.optimizer.state.values() if "step" in s]

    def state(key):
        def value(p):
            if not p.requires_grad:
                return torch.zeros_like(p)
            s = safe_get_full_optimizer_state(p, key)
            s = trainer.optimizer.state[p][key] if s is None else s
            return s.reshape(full_shape(p))
        return value

    module = trainer.engine.module
    count = len(list(module.named_parameters()))          # full_tensors yields the parameters, then buffers
    m = dict(islice(full_tensors(module, ctx, num_blocks, state("exp_avg")), count))
    v = dict(islice(full_tensors(module, ctx, num_blocks, state("exp_avg_sq")), count))
    for name in m:
        s = step_slack(m[name], v[name], max(steps), lr, group["betas"], group["eps"])
        slack[name] = slack.get(name, 0) + s
