"""tests/adam_bound.py's slack against torch's AdamW: gradients off by up to its delta move the weights
apart by no more than the slack, and near-zero gradients do move them apart by more than fp32 tolerance."""
import torch

from tests.adam_bound import FP32_ULP, ROUNDOFF_ULPS, gradient_scale, step_slack

LR, BETAS, EPS, STEPS = 3e-3, (0.9, 0.95), 1e-8, 3


def test_perturbed_gradients_stay_within_the_slack():
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(64, 256, generator=gen) * 1e-3 for _ in range(STEPS)]
    near_zero = torch.zeros(64, 256, dtype=torch.bool)
    near_zero.view(-1)[torch.randperm(near_zero.numel(), generator=gen)[:256]] = True
    for g in grads:                                   # single gradients that cancel to about eps, as in a layout
        g[near_zero] = torch.randn(256, generator=gen) * 1e-8
    w0 = torch.randn(64, 256, generator=gen) * 0.05
    params = [torch.nn.Parameter(w0.clone()) for _ in range(2)]
    opts = [torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0) for p in params]
    slack = torch.zeros_like(w0)
    for t, g in enumerate(grads, start=1):
        rms = (sum((1 - BETAS[1]) * BETAS[1] ** (t - s) * grads[s - 1] ** 2 for s in range(1, t + 1))
               / (1 - BETAS[1] ** t)).sqrt()
        delta = ROUNDOFF_ULPS * FP32_ULP * gradient_scale(rms)
        noise = (torch.rand(g.shape, generator=gen) * 2 - 1) * delta
        for p, opt, d in zip(params, opts, (0, noise)):
            p.grad = g + d
            opt.step()
        state = opts[0].state[params[0]]
        slack += step_slack(state["exp_avg"], state["exp_avg_sq"], t, LR, BETAS, EPS)
    diff = (params[1] - params[0]).detach().abs()
    assert (diff <= 1e-5 + 1.3e-6 * params[0].detach().abs() + slack).all()
    assert diff[near_zero].max() > 1e-5               # the amplification is real: fp32 tolerance alone fails
    ordinary = ~near_zero & (torch.stack(grads).abs().amin(dim=0) > 1e-5)
    assert slack[ordinary].max() < 1e-5               # gradients away from zero: under fp32 tolerance
