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


# What tests.helpers.commands.run_command must do as `python` does: the status, both streams (a C-level write to fd 1
# too), an atexit handler's output, sys.argv, the script's folder on sys.path, WORLD_SIZE's os._exit.
PROGRAMS = {
    "exit status": "import sys; print(sys.argv[1:]); sys.exit(4)",
    "exit message": "import sys; print('out'); sys.exit('refused: the reason')",
    "exception": "import os; os.write(1, b'from fd 1\\n'); raise ValueError('bad input')",
    "atexit": "import atexit, sys; atexit.register(lambda: print('at exit', file=sys.stderr)); print(__name__)",
    "launched rank": PROGRAM,
}


@pytest.mark.parametrize("name", PROGRAMS)
@pytest.mark.parametrize("world", [None, "2"])
def test_a_forked_command_exits_and_prints_as_python_does(name, world, tmp_path):
    from tests.helpers.commands import run_command

    script = tmp_path / "prog.py"
    script.write_text(f"import sys; assert sys.path[0] == {str(tmp_path)!r}, sys.path[:2]\n" + PROGRAMS[name])
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = ROOT
    if world:
        env["WORLD_SIZE"] = world
    want = subprocess.run([sys.executable, str(script), "a b", "c"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    got = run_command([str(script), "a b", "c"], env=env)
    assert (got.returncode, got.stdout) == (want.returncode, want.stdout)
    assert got.stderr.replace(sys.executable, "python") == want.stderr.replace(sys.executable, "python")
