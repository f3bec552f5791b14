"""EmaAdamW: the same EMA from every layout, consolidated, as from one process (split from
tests/unit/test_ema.py, which checks FusedEmaAdam's math in one process). One spawn per world size (1, 2 and 4
ranks: the `runs` fixture)."""
import pytest
import torch

from tests.train_utils import Run, assert_weights_match, fp32_config, train_all

LAYOUTS = [(1, 1, 2, 2), (1, 1, 2, 3), (2, 2, 1, 1)]       # ZeRO-2 and -3 partitions, ZeRO-1 with a pipeline


@pytest.fixture(scope="module")
def runs():
    """The one-process reference and every layout, 4 steps."""
    return train_all({"reference": Run(1, 1, 1, fp32_config(optimizer="FusedEmaAdam"), steps=4),
                      **{layout: Run(*layout[:3], fp32_config(layout[3], optimizer="FusedEmaAdam"), steps=4)
                         for layout in LAYOUTS}})


@pytest.mark.parametrize("tp, pp, dp, stage", LAYOUTS, ids=[f"tp{t}-pp{p}-dp{d}-zero{z}" for t, p, d, z in LAYOUTS])
def test_consolidated_ema_equals_one_process(runs, tp, pp, dp, stage):
    run, ema_reference = runs[tp, pp, dp, stage], runs["reference"]
    assert run["ema"].keys() == ema_reference["ema"].keys() == ema_reference["state"].keys()
    # The shadow is a convex combination of the weights after each step (and the identical initial ones), so
    # it is off by at most the largest weight difference: fp32 tolerance plus the reference's final Adam slack
    # (tests/adam_bound.py; it only grows with the steps).
    assert_weights_match(run["ema"], {"state": ema_reference["ema"], "slack": ema_reference["slack"]}, "ema ")
    for name, value in ema_reference["ema"].items():
        assert not torch.equal(value, ema_reference["state"][name]) or value.abs().sum() == 0 or "norm" in name
