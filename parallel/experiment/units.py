"""The units every command shares: byte sizes read from flags ("80GiB", "5GB") and printed, the precision
names of configs and flags (fp32, bf16, fp16) as torch dtypes and element sizes, and parameter counts."""
from __future__ import annotations

import re

import torch
from torch import nn

KiB, MiB, GiB, TiB = 2 ** 10, 2 ** 20, 2 ** 30, 2 ** 40
SIZE_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
              "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BYTES = {name: dtype.itemsize for name, dtype in DTYPES.items()}      # element size: fp32 4, bf16/fp16 2


def parse_size(text: str, unit_required: bool = False) -> int:
    """'80GiB' -> 80 x 2^30 bytes, '5GB' -> 5 x 10^9, '1.5 MiB' -> 1572864, '1000' -> 1000 (a ValueError
    with `unit_required`: GiB and GB differ by 7%). Units are case-insensitive."""
    m = re.fullmatch(r"\s*([0-9]+\.?[0-9]*|\.[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if unit in SIZE_UNITS or (unit == "" and not unit_required):
        return int(float(m.group(1)) * SIZE_UNITS.get(unit, 1))
    if unit_required:
        raise ValueError(f"{text!r}: give a number with a unit, e.g. 80GiB (2^30 bytes) or 80GB (10^9 bytes); "
                         f"units: KiB MiB GiB TiB KB MB GB TB")
    raise ValueError(f"{text!r}: give a size such as 5GB, 500MiB or 1000000 (bytes)")


def format_size(n: float) -> str:
    """n bytes in the largest binary unit it reaches: '1.50 GiB', '12.0 MiB', '3.0 KiB', '512 B'."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n:.0f} B"


def gib(n: float) -> str:
    """n bytes in GiB with two decimals and no unit, for columns headed GiB: '80.00'."""
    return f"{n / GiB:.2f}"


def count_parameters(module: nn.Module, matrices_only: bool = False) -> int:
    """Elements of the module's parameters; `matrices_only`: of its matrices (dim >= 2), the N of the
    6 N S matmul FLOPs per training step."""
    return sum(p.numel() for p in module.parameters() if p.dim() >= 2 or not matrices_only)
