"""The flags every command shares: the experiment (`--config`, `--set`), its DeepSpeed JSON
(`--deepspeed_config`) and the launcher's `--local_rank`, declared once so train.py, parallel.check,
parallel.plan, parallel.export, parallel.sample, parallel.verify and parallel.prepare_data read them alike. Imports argparse only: train.py parses before any heavy import."""
from __future__ import annotations

import argparse

CONFIG_HELP = "experiment YAML file or preset name"


def add_experiment_args(ap: argparse.ArgumentParser, deepspeed: bool = True, deepspeed_required: bool = True,
                        config_help: str = CONFIG_HELP) -> None:
    """--config (required), --deepspeed_config / --deepspeed-config (with `deepspeed`; default None when
    not `deepspeed_required`), --set KEY=VALUE, repeatable, into args.overrides, and --local_rank (hidden)."""
    ap.add_argument("--config", required=True, help=config_help)
    if deepspeed:
        ap.add_argument("--deepspeed_config", "--deepspeed-config", required=deepspeed_required, default=None,
                        help="DeepSpeed JSON file")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set parallel.tp_size=2 (repeatable)")
    # The launchers (deepspeed, torch.distributed.launch) append --local_rank=N to every process's arguments;
    # the ranks are read from the environment (parallel.distributed.topology.read_launch_env).
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def size_arg(text: str) -> int:
    """argparse `type=` for a byte size with an optional unit (parallel.units.parse_size)."""
    from parallel.units import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
