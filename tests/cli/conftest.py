"""Fixtures shared by the launcher tests and the documentation tests."""
import os

import pytest

from tests.helpers.launchers import reference_losses


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The direct `deepspeed --num_gpus 4 train.py` run's per-step losses: one run for every launcher test
    (tests/cli/test_launchers.py, tests/cli/test_netns_hosts.py) that must reproduce them."""
    return reference_losses(tmp_path_factory)


@pytest.fixture(scope="session", autouse=True)
def doc_answers_shared(tmp_path_factory):
    """The documentation tests keep the answers of commands run as written in a folder every pytest-xdist worker
    of this run shares (the run's own pytest-N folder), so each runs once in the session (tests/cli/doc_runs.py)."""
    from tests.cli import doc_runs
    base = tmp_path_factory.getbasetemp()
    doc_runs.share_answers_in((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "doc-answers")
