"""parallel.experiment.units (sizes, dtypes, parameter counts) and parallel.experiment.cli (the shared experiment flags)."""
import argparse

import pytest
import torch
from torch import nn

from parallel.experiment.cli import Parser, add_experiment_args, size_arg
from parallel.experiment.units import BYTES, DTYPES, count_parameters, format_size, gib, parse_size


@pytest.mark.parametrize("text, n", [("5GB", 5 * 10 ** 9), ("500MiB", 500 * 2 ** 20), ("1000", 1000),
                                     ("80GiB", 80 * 2 ** 30), ("80 gb", 80 * 10 ** 9), ("1.5KiB", 1536),
                                     ("2TiB", 2 * 2 ** 40), ("3TB", 3 * 10 ** 12), ("7b", 7), (" 5. GB ", 5 * 10 ** 9)])
def test_parse_size(text, n):
    assert parse_size(text) == n


def test_parse_size_refuses():
    for text in ("5XB", "GB", "", "-1GB", "1e9"):
        with pytest.raises(ValueError, match="give a size such as 5GB, 500MiB or 1000000"):
            parse_size(text)
    assert parse_size("80GiB", unit_required=True) == 80 * 2 ** 30
    with pytest.raises(ValueError, match=r"^'80': give a number with a unit, e.g. 80GiB \(2\^30 bytes\)"):
        parse_size("80", unit_required=True)
    with pytest.raises(argparse.ArgumentTypeError, match="'5XB': give a size such as"):
        size_arg("5XB")


def test_format_size():
    assert [format_size(n) for n in (0, 512, 1024, 3 * 2 ** 20 + 2 ** 19, 1.5 * 2 ** 30, 2 ** 40)] == \
        ["0 B", "512 B", "1.0 KiB", "3.5 MiB", "1.50 GiB", "1024.00 GiB"]
    assert gib(80 * 2 ** 30) == "80.00" and gib(2 ** 29) == "0.50"


def test_dtypes():
    assert DTYPES == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    assert BYTES == {"fp32": 4, "bf16": 2, "fp16": 2}


def test_count_parameters():
    m = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    assert count_parameters(m) == 3 * 4 + 4 + 4 + 4
    assert count_parameters(m, matrices_only=True) == 12


def test_experiment_args():
    ap = Parser()        # the toolkit's parser: underscore spellings read as the dashed flags
    add_experiment_args(ap)
    args = ap.parse_args(["--config", "debug", "--deepspeed-config", "ds.json", "--set", "a=1", "--set", "b=2"])
    assert (args.config, args.deepspeed_config, args.overrides) == ("debug", "ds.json", ["a=1", "b=2"])
    assert ap.parse_args(["--config", "x", "--deepspeed_config", "y"]).overrides == []
    with pytest.raises(SystemExit):
        ap.parse_args(["--config", "debug"])              # the DeepSpeed JSON is required by default

    optional = Parser()
    add_experiment_args(optional, deepspeed_required=False)
    assert optional.parse_args(["--config", "debug"]).deepspeed_config is None

    none = Parser()
    add_experiment_args(none, deepspeed=False)
    assert not hasattr(none.parse_args(["--config", "debug"]), "deepspeed_config")
