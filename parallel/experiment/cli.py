"""The flags every command shares, declared once so train.py, parallel.check, parallel.plan, parallel.export,
parallel.sample, parallel.verify and parallel.prepare_data read them alike: the experiment (`--config`,
`--set`), its DeepSpeed JSON (`--deepspeed-config`), the launcher's `--local-rank`, the process count
(`--world-size`) and the checkpoint a command reads (`--checkpoint latest|N|stepN`).

One vocabulary (`Parser`): every flag is spelled with dashes and its underscore spelling works too
(`--deepspeed_config`, `--world_size`: DeepSpeed's own examples use underscores); a renamed flag's old spelling
(`--resume`, `--tag`, `--devices`) still works and says the new one on stderr. One refusal: every command that
refuses to run (a usage error included) prints `<command> refused (N problems):` and the problems one a line,
and exits REFUSED (1); nothing was started. Imports argparse only: train.py parses before any heavy import."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn

CONFIG_HELP = "experiment YAML file or preset name"
REFUSED = 1         # every command's exit status when it refuses to run (nothing was started)
DS_CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"     # shipped beside configs/


def ds_config_arg(text: str) -> str:
    """argparse `type=` for --deepspeed-config: a file, else a shipped one by path or name (`ds_configs/
    zero1_bf16.json`, `zero1_bf16`) wherever the command runs from; an unknown name is left for the reader
    to refuse with its path."""
    path = Path(text)
    if path.is_file() or str(path.parent) not in (".", "ds_configs"):    # another folder: the user's own file
        return text
    name = path.name
    for candidate in (DS_CONFIG_DIR / name, DS_CONFIG_DIR / f"{name}.json"):
        if candidate.is_file():
            return str(candidate)
    return text


def refused(prog: str, problems) -> int:
    """Print the one refusal every command makes, `<prog> refused (N problems):` and the problems one a line
    (`problems`: a list, or text with one a line), on stderr; return REFUSED for the command to exit with."""
    lines = [line for p in ([problems] if isinstance(problems, str) else problems) for line in str(p).splitlines()]
    print(f"{prog} refused ({len(lines)} problem{'' if len(lines) == 1 else 's'}):", file=sys.stderr)
    for line in lines:
        print(f"  - {line}", file=sys.stderr)
    return REFUSED


class Parser(argparse.ArgumentParser):
    """argparse with the toolkit's flag vocabulary: each flag is declared with dashes (`--world-size`) and its
    underscore spelling (`--world_size`) is read as it, without showing twice in --help; a usage error (a
    missing or unknown flag, a bad value) is a refusal like any other: the usage line, then `refused`'s
    heading, exit REFUSED."""

    def _dashed(self, token: str) -> str:
        name, sep, value = token.partition("=")
        if not name.startswith("--") or "_" not in name or name in self._option_string_actions:
            return token
        dashed = "--" + name[2:].replace("_", "-")
        return dashed + sep + value if dashed in self._option_string_actions else token

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([self._dashed(a) if isinstance(a, str) else a for a in args], namespace)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        sys.exit(refused(self.prog, message))


class Renamed(argparse.Action):
    """An old spelling of a flag: stores into the new flag's dest and names the new flag on stderr."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"note: {option_string} is now {self.new} (the old spelling still works)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_renamed(ap: argparse.ArgumentParser, old: str, new: str, dest: str, **kwargs) -> None:
    ap.add_argument(old, action=Renamed, new=new, dest=dest, help=argparse.SUPPRESS, **kwargs)


def add_experiment_args(ap: argparse.ArgumentParser, deepspeed: bool = True, deepspeed_required: bool = True,
                        config_help: str = CONFIG_HELP) -> None:
    """--config (required), --deepspeed-config (with `deepspeed`; default None when not
    `deepspeed_required`), --set KEY=VALUE, repeatable, into args.overrides, and --local-rank (hidden)."""
    ap.add_argument("--config", required=True, help=config_help)
    if deepspeed:
        ap.add_argument("--deepspeed-config", dest="deepspeed_config", metavar="JSON",
                        required=deepspeed_required, default=None, type=ds_config_arg,
                        help="DeepSpeed JSON file, or a shipped one by name (zero1_bf16)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set parallel.tp_size=2 (repeatable)")
    # The launchers (deepspeed, torch.distributed.launch) append --local_rank=N to every process's arguments;
    # the ranks are read from the environment (parallel.distributed.topology.read_launch_env).
    ap.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS)


def add_world_size(ap: argparse.ArgumentParser, help: str = "number of processes, every node's together "
                   "(tp x sp x pp x dp)") -> None:
    """--world-size N, the total over all nodes (launch.sh's --nproc is per node); parallel.plan's old
    --devices still works, with a note."""
    ap.add_argument("--world-size", dest="world_size", type=int, default=None, help=help)
    add_renamed(ap, "--devices", "--world-size", "world_size", type=int)


LATEST = "latest"
NONE = "none"


def checkpoint_arg(text: str, training: bool = False):
    """argparse `type=` for --checkpoint: LATEST (also `auto`), a step (`40` or `step40`) as an int, and with
    `training` NONE (also `never`: start from step 0)."""
    word = text.strip().lower()
    if word in (LATEST, "auto"):
        return LATEST
    if training and word in (NONE, "never"):
        return NONE
    step = word.removeprefix("step")
    if step.isdigit():
        return int(step)
    raise argparse.ArgumentTypeError(f"{text!r}: give latest (the newest usable checkpoint), a step (40 or step40)"
                                     + (", or none (start from step 0)" if training else ""))


def add_checkpoint(ap: argparse.ArgumentParser, help: str, training: bool = False, default=LATEST) -> None:
    """--checkpoint latest|N|stepN (training: also none), default `default`; the old spellings --resume (train.py)
    and --tag (parallel.export) still work, with a note, in every command that has the flag."""
    kind = (lambda text: checkpoint_arg(text, training=True)) if training else checkpoint_arg
    ap.add_argument("--checkpoint", default=default, type=kind, metavar="{latest,N" + (",none}" if training else "}"),
                    help=help)
    for old in ("--resume", "--tag"):
        add_renamed(ap, old, "--checkpoint", "checkpoint", type=kind)


def require(ap: argparse.ArgumentParser, args: argparse.Namespace, **flags: str) -> argparse.Namespace:
    """argparse's 'required' for flags that also have an old spelling (argparse would not count it): dest=flag."""
    missing = [flag for dest, flag in flags.items() if getattr(args, dest) is None]
    if missing:
        ap.error(f"the following arguments are required: {', '.join(missing)}")
    return args


def size_arg(text: str) -> int:
    """argparse `type=` for a byte size with an optional unit (parallel.experiment.units.parse_size)."""
    from parallel.experiment.units import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(main: Callable[[], int]) -> NoReturn:
    """A command's entry (`python -m`, its console script): exit with main()'s status. A launched rank (WORLD_SIZE
    > 1) leaves without the interpreter's teardown, where the C++ threads of the process groups DeepSpeed made
    can abort a finished rank (SIGABRT, "terminate called without an active exception", pytorch#179291; seen
    once in the family matrix after `parallel.sample` had sampled), and the launcher then kills the ranks still
    writing. Everything the command writes is closed by the time main() returns."""
    code = main() or 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
