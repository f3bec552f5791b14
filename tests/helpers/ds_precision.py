"""The helpers and fixtures of tests/unit/test_ds_precision.py that other test modules use too: `fp16_json` (a test
module imports no other test module)."""
import json

import pytest

from parallel.check import DeviceDtypes


@pytest.fixture
def fp16_json(tmp_path):
    if DeviceDtypes.here().fp16:
        pytest.skip("this machine's accelerator has fp16")
    ds = json.load(open("ds_configs/zero0_fp32.json"))
    ds["fp16"] = {"enabled": True}
    path = tmp_path / "fp16.json"
    path.write_text(json.dumps(ds))
    return path
