"""UniPC for flow matching: diffusers' UniPCMultistepScheduler as Wan 2.1's pipeline configures it.

    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=k)
    (solver_order 2, solver_type bh2, predict_x0, lower_order_final, final_sigmas_type zero: its defaults)

Noise levels (float64, then float32): s_i = shift(linspace(1, 1/1000, steps + 1)[:-1]), s_0 = 1 - 1e-6 (its log
must stay finite), then 0; the model sees the integer timestep int(1000 s_i). With alpha = 1 - s and
lambda = log(alpha / s), each step converts the model's u to x0 = x - s u, corrects the previous step's result
with it (UniC, from step 1 on), and predicts the next sample (UniP, bh2) from the last one or two x0s: order 1
on the first step, 2 after, 1 again on the last (lower_order_final). The arithmetic below follows diffusers'
multistep_uni_p_bh_update / multistep_uni_c_bh_update line by line (fp32 0-dim tensors), so a tiny model's
samples match WanPipeline's to fp32 round-off (tests/unit/test_wan.py).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

SOLVER_ORDER = 2


def unipc_schedule(steps: int, shift: float, n: int = 1000) -> tuple[torch.Tensor, list[int]]:
    """(sigmas [steps + 1] float32 ending at 0, the model's integer timesteps [steps])."""
    s = np.linspace(1, 1 / n, steps + 1)[:-1]
    s = shift * s / (1 + (shift - 1) * s)
    if np.fabs(s[0] - 1) < 1e-6:
        s[0] -= 1e-6
    timesteps = torch.from_numpy((s * n).copy()).to(torch.int64).tolist()
    return torch.from_numpy(np.concatenate([s, [0]]).astype(np.float32)), timesteps


def _lambda(sigma: torch.Tensor) -> torch.Tensor:
    return torch.log(1 - sigma) - torch.log(sigma)


def _bh_update(sigmas, t: int, s0: int, order: int, outputs: list, x: torch.Tensor):
    """The part UniP and UniC share: x_t_ = (s_t / s_s0) x - alpha_t h_phi_1 m0 and the bh2 coefficients.
    t, s0: indices of the target and source noise levels; outputs: the last x0s, newest last."""
    sigma_t, sigma_s0 = sigmas[t], sigmas[s0]
    alpha_t = 1 - sigma_t
    lambda_s0 = _lambda(sigma_s0)
    h = _lambda(sigma_t) - lambda_s0
    m0 = outputs[-1]
    rks, d1s = [], []
    for i in range(1, order):
        rk = (_lambda(sigmas[s0 - i]) - lambda_s0) / h
        rks.append(rk)
        d1s.append((outputs[-(i + 1)] - m0) / rk)
    rks.append(torch.ones(()))
    rks = torch.stack(rks)
    hh = -h                                                      # predict_x0
    h_phi_1 = torch.expm1(hh)
    h_phi_k, factorial_i, b_h = h_phi_1 / hh - 1, 1, torch.expm1(hh)   # bh2: B(h) = e^hh - 1
    r, b = [], []
    for i in range(1, order + 1):
        r.append(torch.pow(rks, i - 1))
        b.append(h_phi_k * factorial_i / b_h)
        factorial_i *= i + 1
        h_phi_k = h_phi_k / hh - 1 / factorial_i
    x_t_ = sigma_t / sigma_s0 * x - alpha_t * h_phi_1 * m0
    return x_t_, alpha_t, b_h, torch.stack(r), torch.stack(b), (torch.stack(d1s, dim=1) if d1s else None), m0


def _predict(sigmas, k: int, order: int, outputs: list, x: torch.Tensor) -> torch.Tensor:
    """UniP: the sample at noise level k + 1."""
    x_t_, alpha_t, b_h, r, b, d1s, _ = _bh_update(sigmas, k + 1, k, order, outputs, x)
    if d1s is None:
        return (x_t_ - alpha_t * b_h * 0).to(x.dtype)           # diffusers' pred_res = 0, kept as it computes
    rhos = torch.ones(1, dtype=x.dtype) * 0.5 if order == 2 else torch.linalg.solve(r[:-1, :-1], b[:-1]).to(x.dtype)
    return (x_t_ - alpha_t * b_h * torch.einsum("k,bkc...->bc...", rhos, d1s)).to(x.dtype)


def _correct(sigmas, k: int, order: int, outputs: list, last: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """UniC: step k - 1's result redone with this step's x0."""
    x_t_, alpha_t, b_h, r, b, d1s, m0 = _bh_update(sigmas, k, k - 1, order, outputs, last)
    rhos = torch.ones(1, dtype=last.dtype) * 0.5 if order == 1 else torch.linalg.solve(r, b).to(last.dtype)
    corr = torch.einsum("k,bkc...->bc...", rhos[:-1], d1s) if d1s is not None else 0
    return (x_t_ - alpha_t * b_h * (corr + rhos[-1] * (x0 - m0))).to(last.dtype)


def unipc_sample(guided: Callable[[torch.Tensor, int], torch.Tensor], x: torch.Tensor, steps: int,
                 shift: float) -> torch.Tensor:
    """Integrate from x (pure noise) with `guided(x, t) -> u` (the guided flow prediction, fp32)."""
    sigmas, timesteps = unipc_schedule(steps, shift)
    outputs: list = [None] * SOLVER_ORDER
    last, order, warm = None, 0, 0
    for k, t in enumerate(timesteps):
        x0 = x - sigmas[k] * guided(x, t)                      # convert_model_output (flow_prediction)
        if k > 0 and last is not None:
            x = _correct(sigmas, k, order, outputs, last, x0)
        outputs = outputs[1:] + [x0]
        order = min(SOLVER_ORDER, steps - k, warm + 1)         # warm-up, then lower order on the last step
        last = x
        x = _predict(sigmas, k, order, outputs, x)
        warm = min(warm + 1, SOLVER_ORDER)
    return x
