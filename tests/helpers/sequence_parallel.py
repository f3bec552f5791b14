"""The helpers and fixtures of tests/distributed/test_sequence_parallel.py that other test modules use too:
`sp_config` (a test module imports no other test module)."""

from tests.train_utils import fp32_config


def sp_config(stage: int = 0) -> dict:
    """fp32_config with Adam's eps at 1e-6: Adam moves a weight by lr g / (|g| + eps), so the round-off
    d of a gradient element near eps in size (the sp ranks add its token contributions in another order)
    moves the weight by up to lr d / eps; at eps 1e-6 that stays under assert_close's fp32 tolerance
    (tests/distributed/test_train_equivalence.py's stdit_fp32_config, for the same reason)."""
    ds = fp32_config(stage)
    ds["optimizer"]["params"]["eps"] = 1e-6
    return ds
