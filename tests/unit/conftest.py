"""The unit tier (see tests/conftest.py): one process, no process group. A unit test that leaves
torch.distributed initialised errors at teardown; it belongs in tests/distributed."""
import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_process_group():
    yield
    assert not dist.is_initialized(), "this test initialised torch.distributed: move it to tests/distributed"
