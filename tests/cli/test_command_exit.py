"""parallel.experiment.cli.run, every distributed command's entry: main()'s exit status, and a launched rank (WORLD_SIZE > 1)
leaves without the interpreter's teardown (where process-group threads can abort a finished rank with SIGABRT,
and the launcher then kills the ranks still writing); a single process exits normally."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAM = ("import atexit; from parallel.experiment.cli import run; atexit.register(lambda: print('teardown ran', flush=True)); "
           "run(lambda: print('work done', flush=True) or 3)")


@pytest.mark.parametrize("world, teardown", [("4", False), ("1", True), (None, True)])
def test_a_launched_rank_skips_the_teardown_and_keeps_the_exit_status(world, teardown):
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    env["PYTHONPATH"] = ROOT
    if world:
        env["WORLD_SIZE"] = world
    p = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and "work done" in p.stdout
    assert ("teardown ran" in p.stdout) == teardown, p.stdout
