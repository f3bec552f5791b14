"""DeepSpeed JSON files: reading them with line-numbered errors, the engine settings in them, filling batch keys.

What the toolkit does with each top-level key (honoured or refused, unknown ones refused with a
did-you-mean) is parallel/ds_keys.py's table.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from parallel.config import ConfigError, ExperimentConfig

# Optimizer types the toolkit builds (parallel/train/optim.py), lower-cased: EMA ones keep a shadow of the weights.
EMA_OPTIMIZERS = ("fusedemaadam", "emaadamw")
ADAM_OPTIMIZERS = ("adamw", "adam")

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def read_ds_config(path: str | Path) -> dict[str, Any]:
    """Parse a DeepSpeed JSON file; a syntax error names the file, line and column."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read DeepSpeed config ({e.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}:{e.colno}: malformed JSON: {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level, got {type(data).__name__}")
    return data


def enabled(ds: dict[str, Any], section: str) -> bool:
    value = ds.get(section, {})
    return bool(value.get("enabled", False)) if isinstance(value, dict) else False


def zero_stage(ds: dict[str, Any]) -> int:
    return int((ds.get("zero_optimization") or {}).get("stage", 0))


def precision(ds: dict[str, Any]) -> str:
    """'bf16', 'fp16', 'fp32' (or 'bf16+fp16' when both are on, which the checker refuses)."""
    on = [name for name, sections in (("bf16", ("bf16", "bfloat16")), ("fp16", ("fp16",)))
          if any(enabled(ds, s) for s in sections)]
    return "+".join(on) if on else "fp32"


def grad_accum_dtype(ds: dict[str, Any]) -> str | None:
    return (ds.get("data_types") or {}).get("grad_accum_dtype")


def with_batch_keys(ds: dict[str, Any], cfg: ExperimentConfig, dp_size: int) -> dict[str, Any]:
    """A copy of `ds` whose batch keys come from the experiment: train_batch_size = micro x accum x dp.

    Keys already set in the JSON must agree (the checker reports a mismatch); "auto" is replaced.
    """
    out = copy.deepcopy(ds)
    out["train_micro_batch_size_per_gpu"] = cfg.train.micro_batch_size
    out["gradient_accumulation_steps"] = cfg.train.grad_accum_steps
    out["train_batch_size"] = cfg.global_batch_size(dp_size)
    return out
