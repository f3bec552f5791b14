"""DeepSpeed JSON files: reading them with line-numbered errors, the engine settings in them, filling batch keys
and Hugging Face's "auto" values from the experiment (`fill_auto`, `AUTO_KEYS`).

What the toolkit does with each top-level key (honoured or refused, unknown ones refused with a
did-you-mean) is parallel/experiment/ds_keys.py's table.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from parallel.experiment.cli import DS_CONFIG_DIR
from parallel.experiment.config import ConfigError, ExperimentConfig

# Optimizer types the toolkit builds (parallel/train/optim.py), lower-cased: EMA ones keep a shadow of the weights.
EMA_OPTIMIZERS = ("fusedemaadam", "emaadamw")
ADAM_OPTIMIZERS = ("adamw", "adam")

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def read_ds_config(path: str | Path) -> dict[str, Any]:
    """Parse a DeepSpeed JSON file; a syntax error names the file, line and column."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        shipped = ", ".join(sorted(p.stem for p in DS_CONFIG_DIR.glob("*.json")))
        raise ConfigError(f"{path}: no such DeepSpeed config; give a JSON file, or a shipped one by name "
                          f"(--deepspeed-config zero1_bf16): {shipped}") from None
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


# Hugging Face's "auto" (HfDeepSpeedConfig, accelerate): the dotted keys the toolkit fills -> (where the value
# comes from, the value). The experiment's own keys first; where the experiment has none, the value the toolkit
# uses when the key is absent, which is also HF TrainingArguments' default.
HF_DEFAULT = "HF TrainingArguments' default, and the toolkit's when the key is absent"
AUTO_KEYS: dict[str, tuple[str, Callable[[ExperimentConfig], Any]]] = {
    "train_micro_batch_size_per_gpu": ("train.micro_batch_size", lambda c: c.train.micro_batch_size),
    "gradient_accumulation_steps": ("train.grad_accum_steps", lambda c: c.train.grad_accum_steps),
    "gradient_clipping": ("HF TrainingArguments' max_grad_norm default, as ds_configs/ set it", lambda c: 1.0),
    "optimizer.params.lr": ("train.lr", lambda c: c.train.lr),
    "optimizer.params.betas": (HF_DEFAULT, lambda c: [0.9, 0.999]),
    "optimizer.params.eps": (HF_DEFAULT, lambda c: 1e-8),
    "optimizer.params.weight_decay": (HF_DEFAULT, lambda c: 0.0),
    "scheduler.params.warmup_min_lr": ("DeepSpeed's default, as HF fills it", lambda c: 0.0),
    "scheduler.params.warmup_max_lr": ("train.lr", lambda c: c.train.lr),
    "scheduler.params.warmup_num_steps": ("train.warmup_steps", lambda c: c.train.warmup_steps),
    "scheduler.params.total_num_steps": ("", lambda c: c.train.decay_steps or c.train.max_steps),
    "scheduler.params.warmup_min_ratio": ("DeepSpeed's default", lambda c: 0.0),
    "scheduler.params.cos_min_ratio": ("train.min_lr / train.lr", lambda c: c.train.min_lr / c.train.lr),
    "bf16.enabled": ("the toolkit trains in bf16 unless told otherwise: set false for fp32", lambda c: True),
    "bfloat16.enabled": ("the toolkit trains in bf16 unless told otherwise: set false for fp32", lambda c: True),
    "fp16.enabled": ("fp16 only when set true; bf16 is the toolkit's reduced precision", lambda c: False),
    "zero_optimization.reduce_bucket_size": ("model.hidden_size^2, as HF fills it",
                                             lambda c: c.model.hidden_size ** 2),
    "zero_optimization.stage3_prefetch_bucket_size": ("0.9 x model.hidden_size^2, as HF fills it",
                                                      lambda c: int(0.9 * c.model.hidden_size ** 2)),
    "zero_optimization.stage3_param_persistence_threshold": ("10 x model.hidden_size, as HF fills it",
                                                             lambda c: 10 * c.model.hidden_size),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        "accelerate's default; python -m parallel.export writes the weights", lambda c: False),
}


@dataclass
class AutoFill:
    """A DeepSpeed dict with its "auto" values filled in: `ds` (a copy), `filled` ("key=value (source)" each)
    and `problems` (an "auto" the toolkit cannot fill, named; it is left out of `ds`)."""

    ds: dict[str, Any]
    filled: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _autos(node: Any, prefix: str = ""):
    """(dotted key, parent dict, key) of every "auto" value, nested sections included."""
    for key, value in list(node.items()):
        dotted = f"{prefix}{key}"
        if value == "auto":
            yield dotted, node, key
        elif isinstance(value, dict):
            yield from _autos(value, dotted + ".")


def fill_auto(ds: dict[str, Any], cfg: ExperimentConfig, src: str, dp_size: int | None = None) -> AutoFill:
    """Every "auto" of `ds` filled from the experiment (AUTO_KEYS); train_batch_size = micro x accum x dp only
    with `dp_size` (the planner fills it per layout). Any other "auto" is a problem naming its key."""
    out = AutoFill(copy.deepcopy(ds))
    for dotted, parent, key in _autos(out.ds):
        if dotted == "train_batch_size":
            if dp_size is not None:
                parent[key] = cfg.global_batch_size(dp_size)
                out.filled.append(f"train_batch_size={parent[key]} (train.micro_batch_size x train.grad_accum_steps "
                                  f"x dp = {cfg.train.micro_batch_size} x {cfg.train.grad_accum_steps} x {dp_size})")
            continue
        if dotted not in AUTO_KEYS:
            del parent[key]
            out.problems.append(f"{src}: {dotted}=\"auto\": the toolkit fills \"auto\" from the experiment only for "
                                f"{', '.join(['train_batch_size', *AUTO_KEYS])}; give {dotted} a value")
            continue
        source, value = AUTO_KEYS[dotted]
        if dotted == "scheduler.params.total_num_steps":
            source = "train.decay_steps" if cfg.train.decay_steps else "train.max_steps"
        if dotted in BATCH_KEYS and dp_size is None:
            continue                   # the planner varies the micro-batch: each layout's check fills it
        parent[key] = value(cfg)
        out.filled.append(f"{dotted}={json.dumps(parent[key])} ({source})")
    return out
