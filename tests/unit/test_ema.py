"""EmaAdamW: FusedEmaAdam's math in one process (the same EMA from every layout:
tests/distributed/test_ema_layouts.py; exact resume with the EMA: tests/cli/test_resume_cli.py)."""
import pytest
import torch

from parallel.experiment.config import load_config
from parallel.model.build import layer_specs
from parallel.distributed.pipeline import SequentialDiT
from parallel.train.optim import EmaAdamW, adamw_implementation, build_optimizer
from parallel.distributed.topology import ParallelContext


def _model():
    cfg = load_config("debug")
    return cfg, SequentialDiT(layer_specs(cfg, ParallelContext.single()))


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_one_process_matches_adamw_plus_explicit_ema(impl):
    cfg, model = _model()
    _, reference = _model()
    opt = EmaAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, ema_decay=0.99,
                   **{impl: True})
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    shadows = [p.detach().clone() for p in reference.parameters()]
    g = torch.Generator().manual_seed(0)
    for n in range(1, 21):
        grads = [torch.randn(p.shape, generator=g) for p in model.parameters()]
        for p, q, grad in zip(model.parameters(), reference.parameters(), grads):
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
        d = min(0.99, (1 + n) / (10 + n))
        with torch.no_grad():
            for s, q in zip(shadows, reference.parameters()):
                s.copy_(d * s + (1 - d) * q)
    for p, q, s in zip(model.parameters(), reference.parameters(), shadows):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(opt.state[p]["ema"], s)


@pytest.mark.parametrize("device, impl", [("cpu", "fused"), ("cuda", "fused"), ("npu", "foreach"), ("hpu", "foreach")])
def test_fused_ema_adam_resolves_per_device(device, impl):
    cfg, model = _model()
    ds = {"optimizer": {"type": "FusedEmaAdam", "params": {"betas": [0.9, 0.95], "ema_decay": 0.999}}}
    opt = build_optimizer(model, ds, cfg.train, device_type=device)
    assert isinstance(opt, EmaAdamW) and opt.param_groups[0]["ema_decay"] == 0.999
    assert opt.defaults[impl] is True
    assert opt.implementation.startswith(f"FusedEmaAdam -> EmaAdamW with {impl} AdamW (")
    assert adamw_implementation(device)[0] == impl
