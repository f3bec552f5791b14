"""The variables a launcher (torchrun, DeepSpeed's) gives each of its ranks. A test's command runs without them
(tests/helpers/commands.py run_command, tests/helpers/launchers.py run_env): in pytest started under a launcher, or
after a test that set them, the command would otherwise take itself for one of that launcher's ranks."""
import os

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def without_launcher_vars() -> dict:
    """This process's environment without LAUNCHER_VARS."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
