"""Every (tp, pp, dp) layout and ZeRO stage trains the `debug` DiT exactly like one process (fp32).

Three optimizer steps at a global batch of 4: per-step losses on every rank and the final weights,
gathered to full tensors under canonical names, must equal the one-process run within fp32 tolerances.
"""
import pytest
import torch

from tests.train_utils import fp32_config, train


@pytest.fixture(scope="module")
def reference():
    return train(1, 1, 1, fp32_config())


LAYOUTS = [  # (tp, pp, dp, zero stage)
    (2, 1, 1, 0), (1, 2, 1, 0), (1, 1, 2, 1), (1, 1, 2, 2), (1, 1, 2, 3), (2, 2, 1, 0), (2, 1, 2, 1), (1, 2, 2, 1),
]


@pytest.mark.parametrize("tp, pp, dp, stage", LAYOUTS, ids=[f"tp{t}-pp{p}-dp{d}-zero{z}" for t, p, d, z in LAYOUTS])
def test_layout_matches_one_process(reference, tp, pp, dp, stage):
    run = train(tp, pp, dp, fp32_config(stage))
    expected = torch.tensor(reference["losses"], dtype=torch.float32)   # fp32 tolerances, not float64's
    for rank_losses in run["all_losses"]:
        torch.testing.assert_close(torch.tensor(rank_losses, dtype=torch.float32), expected)
    assert run["state"].keys() == reference["state"].keys()
    for name, value in reference["state"].items():
        torch.testing.assert_close(run["state"][name], value, msg=lambda m: f"{name}: {m}")
    assert run["replica_mismatches"] == []


def test_reference_loss_moves(reference):
    """Guards the comparisons above against a model that does not train at all."""
    assert len(set(reference["losses"])) == 3


def test_activation_checkpointing_changes_nothing(reference):
    """Recomputation repeats the forward bit for bit; only the order in which temb's gradient is summed
    over blocks differs, so later steps agree to fp32 round-off."""
    off = train(1, 1, 1, fp32_config(checkpointing=False))
    assert off["losses"][0] == reference["losses"][0]
    torch.testing.assert_close(torch.tensor(off["losses"]), torch.tensor(reference["losses"]))
    for name, value in reference["state"].items():
        torch.testing.assert_close(off["state"][name], value, msg=lambda m: f"{name}: {m}")
