"""The helpers and fixtures of tests/cli/test_train_cli.py that other test modules use too: `ROOT`, `train_py` (a
test module imports no other test module)."""
from tests.helpers.commands import ROOT, run_command  # noqa: F401  (ROOT: the modules import it from here)


def train_py(*args, env_extra=None, timeout=300):
    """`python train.py *args` in ROOT, one process forked from the tests' preloaded server (tests.helpers.commands):
    this process's environment without a launcher's variables, `env_extra` added."""
    return run_command(["train.py", *args], env_extra=env_extra, timeout=timeout)
