"""The helpers and fixtures of tests/distributed/test_wan_layouts.py that other test modules use too:
`wan_fp32_config` (a test module imports no other test module)."""


from tests.train_utils import fp32_config


def wan_fp32_config() -> dict:
    """fp32_config with Adam's eps at 1e-6, as tests/helpers/sequence_parallel.py's sp_config says why."""
    return fp32_config(eps=1e-6)
