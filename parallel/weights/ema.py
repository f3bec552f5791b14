"""The EMA weights kept by EmaAdamW, assembled to full tensors from whatever layout trained them.

Each rank holds the shadow of the fp32 partition it owns (ZeRO 1/2/3, BF16_Optimizer) or of its own
parameters (ZeRO-0, fp32). `full_ema(optimizer)` returns, per model parameter, the shadow gathered over
data-parallel ranks (DeepSpeed's fragment mapping, a collective); `parallel.model.build.full_state` then
gathers tensor-parallel shards and names them canonically. Frozen parameters (LoRA's base) are not
updated and have no shadow: their EMA is the parameter itself.
"""
from __future__ import annotations

import torch
from deepspeed.utils import safe_get_full_optimizer_state

from parallel.distributed.deepspeed.optimizer import relink_optimizer_fragments
from parallel.distributed.deepspeed.zero3 import full_shape

EMA_KEY = "ema"


def has_ema(optimizer) -> bool:
    return any(EMA_KEY in state for state in optimizer.state.values())


def full_ema(optimizer, wrapper=None):
    """A `value(param)` function for `full_state`: the parameter's full (dp-gathered) EMA shadow.

    `optimizer` is the toolkit's EmaAdamW, `wrapper` the DeepSpeed optimizer around it (engine.optimizer).
    """
    if wrapper is not None:             # ZeRO-1/2 and BF16_Optimizer views may be stale or missing
        relink_optimizer_fragments(wrapper)

    def value(param: torch.nn.Parameter) -> torch.Tensor:
        if not param.requires_grad:                   # LoRA's frozen base: constant, its own average
            return param
        shadow = safe_get_full_optimizer_state(param, EMA_KEY)
        if shadow is None:                            # ZeRO-0 fp32: the optimizer holds the parameter itself
            shadow = optimizer.state[param][EMA_KEY]
        return shadow.reshape(full_shape(param))
    return value
