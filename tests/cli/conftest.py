"""Fixtures shared by the launcher tests."""
import pytest

from tests.helpers.launchers import reference_losses


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The direct `deepspeed --num_gpus 4 train.py` run's per-step losses: one run for every launcher test
    (tests/cli/test_launchers.py, tests/cli/test_slurm.py) that must reproduce them."""
    return reference_losses(tmp_path_factory)
