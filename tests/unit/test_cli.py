"""The command-line doors alike: every command's parser takes the launcher's --local_rank and names itself as it
is run in its usage line."""
import importlib

import pytest

# module -> (usage name, the least argv its parser accepts)
COMMANDS = {
    "train": ("train.py", ["--config", "debug", "--deepspeed_config", "d.json"]),
    "parallel.check": ("python -m parallel.check", ["--config", "debug"]),
    "parallel.plan.cli": ("python -m parallel.plan", ["--config", "debug", "--deepspeed_config", "d.json",
                                                      "--world-size", "8", "--device-memory", "80GiB"]),
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


def test_one_name_for_the_process_count_and_the_device_profile(capsys):
    """--world-size in check and plan; plan's old --devices and --device still work and name the new flag."""
    from parallel.check import parser as check_parser
    from parallel.plan.cli import parser as plan_parser
    base = ["--config", "debug", "--deepspeed_config", "d.json", "--device-memory", "1GiB"]
    assert check_parser().parse_args(["--config", "debug", "--world-size", "8"]).world_size == 8
    args = plan_parser().parse_args(base + ["--world-size", "8", "--device-profile", "h100-80gb"])
    assert (args.world_size, args.device) == (8, "h100-80gb")
    capsys.readouterr()
    args = plan_parser().parse_args(base + ["--devices", "4", "--device", "cpu"])
    assert (args.world_size, args.device) == (4, "cpu")
    assert capsys.readouterr().err.splitlines() == [
        "note: --devices is now --world-size (the old spelling still works)",
        "note: --device is now --device-profile (the old spelling still works)"]


def test_plan_without_a_process_count_is_refused_by_name(capsys):
    from parallel.plan.cli import main
    with pytest.raises(SystemExit) as e:
        main(["--config", "debug", "--deepspeed_config", "ds_configs/zero1_bf16.json", "--device-memory", "1GiB"])
    assert e.value.code == 2 and "the following arguments are required: --world-size" in capsys.readouterr().err


def test_check_without_a_deepspeed_json_says_what_it_checked(capsys):
    """--deepspeed_config is optional in parallel.check (the model, layout and data checks need none); the
    verdict says the engine was DeepSpeed's default, ZeRO-0 fp32, and its keys were not checked."""
    from parallel.check import main
    assert main(["--config", "debug"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok: debug tp=1 pp=1 dp=1 (world 1), ZeRO-0 fp32 (no --deepspeed_config: DeepSpeed's "
                          "defaults, its engine keys unchecked), global batch 4")
    assert main(["--config", "debug", "--deepspeed_config", "zero1_bf16"]) == 0      # a shipped one by name
    assert "ZeRO-1 bf16, global batch 4" in capsys.readouterr().out
