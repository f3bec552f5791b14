"""Gradient clipping of fp32 ZeRO-0 with the norm of the whole replica, and the norm kept.

clip_with_replica_norm(engine, norm_fn)  (0.19.8)
    does     replaces engine.clip_fp32_gradients: norm_fn's norm, clipped as DeepSpeed clips, kept in
             engine._global_grad_norm
    why      fp32 ZeRO-0 clipping (clip_grad_norm_(..., mpu=engine.mpu)) drops the norm, so
             get_global_grad_norm() is None; under the pipeline grid it reads the pipe x model rank as the
             tp rank, so replicated parameters of every stage but the first are left out of the norm
    relies   _take_model_step calling self.clip_fp32_gradients() (fp32, no ZeRO); get_global_grad_norm
             returning self._global_grad_norm; gradient_clipping()
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def clip_with_replica_norm(engine, norm_fn: Callable[[list[torch.nn.Parameter]], torch.Tensor]) -> None:
    """fp32 ZeRO-0 clipping with `norm_fn(params)` (the L2 norm of the whole replica's gradients, given this
    rank's parameters that have one): coef = clip / (norm + 1e-6), applied when < 1, as DeepSpeed does;
    the norm is kept for `engine.get_global_grad_norm()`."""
    def clip_and_record():
        params = [p for p in engine.module.parameters() if p.grad is not None]
        norm = norm_fn(params)
        coef = engine.gradient_clipping() / (norm + 1e-6)
        if coef < 1:
            for p in params:
                p.grad.detach().mul_(coef)
        engine._global_grad_norm = float(norm)
    engine.clip_fp32_gradients = clip_and_record
