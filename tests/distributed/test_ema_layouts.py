"""EmaAdamW: the same EMA from every layout, consolidated, as from one process (split from
tests/unit/test_ema.py, which checks FusedEmaAdam's math in one process)."""
import pytest
import torch

from tests.train_utils import assert_weights_match, fp32_config, train


@pytest.fixture(scope="module")
def ema_reference():
    return train(1, 1, 1, fp32_config(optimizer="FusedEmaAdam"), steps=4)


LAYOUTS = [(1, 1, 2, 2), (1, 1, 2, 3), (2, 2, 1, 1)]       # ZeRO-2 and -3 partitions, ZeRO-1 with a pipeline


@pytest.mark.parametrize("tp, pp, dp, stage", LAYOUTS, ids=[f"tp{t}-pp{p}-dp{d}-zero{z}" for t, p, d, z in LAYOUTS])
def test_consolidated_ema_equals_one_process(ema_reference, tp, pp, dp, stage):
    run = train(tp, pp, dp, fp32_config(stage, optimizer="FusedEmaAdam"), steps=4)
    assert run["ema"].keys() == ema_reference["ema"].keys() == ema_reference["state"].keys()
    # The shadow is a convex combination of the weights after each step (and the identical initial ones), so
    # it is off by at most the largest weight difference: fp32 tolerance plus the reference's final Adam slack
    # (tests/adam_bound.py; it only grows with the steps).
    assert_weights_match(run["ema"], {"state": ema_reference["ema"], "slack": ema_reference["slack"]}, "ema ")
    for name, value in ema_reference["ema"].items():
        assert not torch.equal(value, ema_reference["state"][name]) or value.abs().sum() == 0 or "norm" in name
