"""The command-line doors alike: every command's parser takes the launcher's --local_rank and names itself as it
is run in its usage line."""
import importlib
import re

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
    assert e.value.code == 1 and capsys.readouterr().err.splitlines()[-2:] == [
        "python -m parallel.plan refused (1 problem):", "  - the following arguments are required: --world-size"]


def test_check_without_a_deepspeed_json_says_what_it_checked(capsys):
    """--deepspeed_config is optional in parallel.check (the model, layout and data checks need none); the
    verdict says the engine was DeepSpeed's default, ZeRO-0 fp32, and its keys were not checked."""
    from parallel.check import main
    assert main(["--config", "debug"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok: debug tp=1 pp=1 dp=1 (world 1), ZeRO-0 fp32 (no --deepspeed-config: DeepSpeed's "
                          "defaults, its engine keys unchecked), global batch 4")
    assert main(["--config", "debug", "--deepspeed_config", "zero1_bf16"]) == 0      # a shipped one by name
    assert "ZeRO-1 bf16, global batch 4" in capsys.readouterr().out


@pytest.mark.parametrize("module", COMMANDS)
def test_every_flag_is_spelled_with_dashes_and_its_underscore_spelling_works(module):
    """Usage lines show dashes only; each flag's underscore spelling (`--deepspeed_config`, as DeepSpeed's examples
    write it) is read as the dashed one, a switch parsed to the same value."""
    parser = importlib.import_module(module).parser()
    assert [f for f in re.findall(r"--[\w-]+", parser.format_usage()) if "_" in f] == []
    argv = COMMANDS[module][1]
    for action in parser._actions:
        for flag in [f for f in action.option_strings if f.startswith("--") and "-" in f[2:]]:
            underscore = "--" + flag[2:].replace("-", "_")
            assert parser._dashed(f"{underscore}=v") == f"{flag}=v" or \
                parser._option_string_actions[underscore] is action       # declared too: --local_rank
            if action.nargs == 0 and action.dest != "help":     # a switch: parsed, same value as the dashed one
                assert vars(parser.parse_args(argv + [underscore])) == vars(parser.parse_args(argv + [flag]))


# every command, refusing an unknown key: (its main, its argv without the --set)
REFUSING = {
    "train.py": ("train", ["--config", "debug", "--deepspeed_config", "zero1_bf16"]),
    "python -m parallel.check": ("parallel.check", ["--config", "debug"]),
    "python -m parallel.plan": ("parallel.plan.cli", ["--config", "debug", "--deepspeed-config", "zero1_bf16",
                                                      "--world-size", "8", "--device-memory", "80GiB"]),
    "python -m parallel.export": ("parallel.export", ["--config", "debug", "--deepspeed-config", "zero1_bf16",
                                                      "--out", "x"]),
    "python -m parallel.sample": ("parallel.sample", ["--config", "debug", "--out", "x"]),
    "python -m parallel.verify": ("parallel.verify", ["--config", "debug"]),
    "python -m parallel.prepare_data": ("parallel.prepare_data.prepare", ["--config", "debug", "--videos", "v",
                                                                         "--vae", "vae", "--out", "x"]),
    "python -m models": ("models.__main__", ["--config", "debug"]),
}


@pytest.mark.parametrize("prog", REFUSING)
def test_every_command_refuses_under_one_heading_with_one_exit_status(prog, capsys):
    """A refused configuration and a usage error alike: `<command> refused (N problems):`, the problems one a line,
    exit 1."""
    module, argv = REFUSING[prog]
    main = importlib.import_module(module).main
    assert main(argv + ["--set", "parallel.tp_sise=2"]) == 1
    assert capsys.readouterr().err.splitlines()[-2:] == [
        f"{prog} refused (1 problem):",
        "  - --set: unknown key parallel.tp_sise (did you mean parallel.tp_size?); set --set parallel.tp_size=2 "
        "instead"]
    with pytest.raises(SystemExit) as e:
        main(argv + ["--bogus"])
    assert e.value.code == 1
    assert capsys.readouterr().err.splitlines()[-2:] == [f"{prog} refused (1 problem):",
                                                         "  - unrecognized arguments: --bogus"]


@pytest.mark.parametrize("module, training", [("train", True), ("parallel.export", False),
                                              ("parallel.sample", False), ("parallel.verify", False)])
def test_one_way_to_name_a_checkpoint(module, training, capsys):
    """--checkpoint latest|auto|N|stepN (train.py also none|never) in the four commands that read checkpoints; the
    old spellings --resume and --tag store the same value and name the new flag."""
    parser = importlib.import_module(module).parser()
    argv = COMMANDS[module][1]
    for given, want in (("latest", "latest"), ("auto", "latest"), ("4", 4), ("step4", 4), ("STEP12", 12)):
        assert parser.parse_args(argv + ["--checkpoint", given]).checkpoint == want
    for old in ("--resume", "--tag"):
        assert parser.parse_args(argv + [old, "step7"]).checkpoint == 7
        assert capsys.readouterr().err == f"note: {old} is now --checkpoint (the old spelling still works)\n"
    if training:
        assert [parser.parse_args(argv + ["--checkpoint", w]).checkpoint for w in ("none", "never")] == ["none"] * 2
    else:
        with pytest.raises(SystemExit):
            parser.parse_args(argv + ["--checkpoint", "never"])
        assert capsys.readouterr().err.splitlines()[-1] == (
            "  - argument --checkpoint: 'never': give latest (the newest usable checkpoint), a step (40 or step40)")
