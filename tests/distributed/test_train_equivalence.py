"""Every (tp, pp, dp) layout and ZeRO stage trains the `debug` DiT exactly like one process (fp32).

Three optimizer steps at a global batch of 4: per-step losses on every rank and the final weights,
gathered to full tensors under canonical names, must equal the one-process run: the losses within fp32
tolerance, the weights within fp32 tolerance plus the bound on what Adam makes of the gradients' round-off
(tests/adam_bound.py; it matters only where a gradient cancels to near zero).

Every run of this module is trained in one spawn per world size (1, 2 and 4 ranks: the `runs` fixture).
"""
import pytest
import torch

from tests.train_utils import Run, assert_matches, assert_weights_match, fp32_config, train_all

# (tp, pp, dp, zero stage). ZeRO-2 at dp 2 is trained in tests/distributed/test_sequence_parallel.py (sp 2 x dp 2),
# tests/distributed/test_ema_layouts.py and tests/cli/test_resume_cli.py; ZeRO-1 at dp 2 here with tp and with pp.
LAYOUTS = [(2, 1, 1, 0), (1, 2, 1, 0), (1, 1, 2, 3), (2, 2, 1, 0), (2, 1, 2, 1), (1, 2, 2, 1)]
STDIT_LAYOUTS = [(2, 2, 1, 0), (1, 1, 2, 1)]      # tp 2 alone: tests/distributed/test_stdit_parallel.py and test_sequence_parallel.py


def stdit_fp32_config(stage: int = 0) -> dict:
    """fp32_config with Adam's eps at 1e-6. Adam moves a weight by lr g / (|g| + eps), so a gradient's
    absolute round-off d (about 1e-10 here, from the layout's summation order) moves it by up to
    lr d / eps: 3e-5 at eps 1e-8 and lr 3e-3, above assert_close's 1e-5 for the few of debug-stdit's
    573k gradient elements that happen to be near 1e-8 in size; 3e-7 at eps 1e-6."""
    ds = fp32_config(stage)
    ds["optimizer"]["params"]["eps"] = 1e-6
    return ds


@pytest.fixture(scope="module")
def runs():
    """The one-process references (debug with and without activation checkpointing, debug-stdit) and every layout."""
    return train_all({
        "reference": Run(1, 1, 1, fp32_config()),
        "checkpointing off": Run(1, 1, 1, fp32_config(checkpointing=False)),
        "stdit reference": Run(1, 1, 1, stdit_fp32_config(), preset="debug-stdit"),
        **{layout: Run(*layout[:3], fp32_config(layout[3])) for layout in LAYOUTS},
        **{("stdit", *layout): Run(*layout[:3], stdit_fp32_config(layout[3]), preset="debug-stdit")
           for layout in STDIT_LAYOUTS}})


@pytest.mark.parametrize("tp, pp, dp, stage", LAYOUTS, ids=[f"tp{t}-pp{p}-dp{d}-zero{z}" for t, p, d, z in LAYOUTS])
def test_layout_matches_one_process(runs, tp, pp, dp, stage):
    assert_matches(runs[tp, pp, dp, stage], runs["reference"])


def test_reference_loss_moves(runs):
    """Guards the comparisons above against a model that does not train at all."""
    assert len(set(runs["reference"]["losses"])) == 3


def test_activation_checkpointing_changes_nothing(runs):
    """Recomputation repeats the forward bit for bit; only the order in which temb's gradient is summed
    over blocks differs, so later steps agree to fp32 round-off."""
    off, reference = runs["checkpointing off"], runs["reference"]
    assert off["losses"][0] == reference["losses"][0]
    torch.testing.assert_close(torch.tensor(off["losses"]), torch.tensor(reference["losses"]))
    assert_weights_match(off["state"], reference)


@pytest.mark.parametrize("tp, pp, dp, stage", STDIT_LAYOUTS,
                         ids=[f"tp{t}-pp{p}-dp{d}-zero{z}" for t, p, d, z in STDIT_LAYOUTS])
def test_stdit_layout_matches_one_process(runs, tp, pp, dp, stage):
    """The STDiT3-style family (four stage tensors x, t, t_mlp, y between pipeline stages, each layer a
    spatial and a temporal block, recomputed in backward): the same guarantee."""
    assert_matches(runs["stdit", tp, pp, dp, stage], runs["stdit reference"])
