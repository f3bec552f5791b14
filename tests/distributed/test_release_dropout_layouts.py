"""Caption dropout in training: dp 2 and tp 2 drop the same samples as one process, so they train the same
weights (tests/unit/test_release_dropout.py checks the batches themselves)."""
import pytest

from tests.train_utils import assert_matches, fp32_config, train


@pytest.fixture(scope="module")
def reference():
    return train(1, 1, 1, fp32_config(), extra=["data.caption_dropout=0.5"])


@pytest.mark.parametrize("tp, dp", [(1, 2), (2, 1)])
def test_dropout_training_in_every_layout_equals_one_process(reference, tp, dp):
    assert_matches(train(tp, 1, dp, fp32_config(), extra=["data.caption_dropout=0.5"]), reference)


def test_dropout_changes_what_is_trained(reference):
    assert train(1, 1, 1, fp32_config())["losses"] != reference["losses"]
