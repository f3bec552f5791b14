"""The command-line doors alike: every command's parser takes the launcher's --local_rank and names itself as it
is run in its usage line."""
import importlib

import pytest

# module -> (usage name, the least argv its parser accepts)
COMMANDS = {
    "train": ("train.py", ["--config", "debug", "--deepspeed_config", "d.json"]),
    "parallel.check": ("python -m parallel.check", ["--config", "debug"]),
    "parallel.plan.cli": ("python -m parallel.plan", ["--config", "debug", "--deepspeed_config", "d.json",
                                                      "--devices", "8", "--device-memory", "80GiB"]),
    "parallel.export": ("python -m parallel.export", ["--config", "debug", "--deepspeed_config", "d.json",
                                                      "--out", "x"]),
    "parallel.sample": ("python -m parallel.sample", ["--config", "debug", "--out", "x"]),
    "parallel.verify": ("python -m parallel.verify", ["--config", "debug"]),
    "parallel.prepare_data.prepare": ("python -m parallel.prepare_data", ["--config", "debug", "--videos", "v",
                                                                         "--vae", "vae", "--out", "x"]),
}


@pytest.mark.parametrize("module", COMMANDS)
def test_every_command_takes_the_launchers_local_rank(module):
    """deepspeed --module X ... appends --local_rank=N to each process's arguments (and torch.distributed.launch
    --local-rank N)."""
    parser = importlib.import_module(module).parser()
    argv = COMMANDS[module][1]
    assert parser.parse_args(argv + ["--local_rank=1"]).local_rank == 1
    assert parser.parse_args(argv + ["--local-rank", "3"]).local_rank == 3
    assert parser.parse_args(argv).local_rank is None


@pytest.mark.parametrize("module", COMMANDS)
def test_usage_names_the_command_as_run(module):
    parser = importlib.import_module(module).parser()
    assert parser.format_usage().startswith(f"usage: {COMMANDS[module][0]} ")
