"""The helpers and fixtures of tests/cli/test_train_cli.py that other test modules use too: `ROOT`, `train_py` (a
test module imports no other test module)."""
import os
import subprocess
import sys




ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train_py(*args, env_extra=None, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
