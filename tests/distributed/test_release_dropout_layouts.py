"""Caption dropout in training: dp 2 and tp 2 drop the same samples as one process, so they train the same
weights (tests/unit/test_release_dropout.py checks the batches themselves); LTX-2 (`debug-ltx2`) at dp 2, where a
dropped sample's audio caption is dropped with its video caption (tests/unit/test_ltx2_training.py checks its
batches). One spawn per world size (1 and 2 ranks: the `runs` fixture)."""
import pytest

from tests.train_utils import Run, assert_matches, fp32_config, train_all

DROPOUT = ("data.caption_dropout=0.5",)
LAYOUTS = [(1, 2), (2, 1)]        # (tp, dp)


@pytest.fixture(scope="module")
def runs():
    """One process with and without dropout, and every layout with it; debug-ltx2 in one process and at dp 2."""
    return train_all({"reference": Run(1, 1, 1, fp32_config(), extra=DROPOUT), "no dropout": Run(1, 1, 1, fp32_config()),
                      **{(tp, dp): Run(tp, 1, dp, fp32_config(), extra=DROPOUT) for tp, dp in LAYOUTS},
                      **{("ltx2", dp): Run(1, 1, dp, fp32_config(), extra=DROPOUT, preset="debug-ltx2") for dp in (1, 2)}})


@pytest.mark.parametrize("tp, dp", LAYOUTS)
def test_dropout_training_in_every_layout_equals_one_process(runs, tp, dp):
    assert_matches(runs[tp, dp], runs["reference"])


def test_dropout_changes_what_is_trained(runs):
    assert runs["no dropout"]["losses"] != runs["reference"]["losses"]


def test_ltx2_dropout_at_dp2_equals_one_process(runs):
    assert_matches(runs["ltx2", 2], runs["ltx2", 1])
