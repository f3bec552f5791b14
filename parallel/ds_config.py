"""DeepSpeed JSON files: reading them with line-numbered errors, refusing unknown keys, filling batch keys.

DeepSpeed silently ignores a misspelt top-level key (`"activation_checkpoint"` turns checkpointing off
without a word), so every top-level key is checked against the keys DeepSpeed 0.19 reads.
"""
from __future__ import annotations

import copy
import difflib
import json
from pathlib import Path
from typing import Any

from parallel.config import ConfigError, ExperimentConfig

# Top-level keys read by DeepSpeed 0.19's runtime (runtime/config.py and the section configs it calls).
KNOWN_TOP_LEVEL_KEYS = frozenset("""
train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps steps_per_print
optimizer scheduler fp16 bf16 bfloat16 amp torch_autocast data_types communication_data_type
seq_parallel_communication_data_type prescale_gradients gradient_predivide_factor gradient_allreduce_op
sparse_gradients gradient_clipping zero_optimization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer
activation_checkpointing flops_profiler comms_logger tensorboard csv_monitor wandb comet monitor_config
wall_clock_breakdown memory_breakdown dump_state timers disable_allgather disable_python_gc
dataloader_drop_last checkpoint data_efficiency curriculum_learning compression_training sparse_attention
pipeline elasticity autotuning aio nebula compile eigenvalue progressive_layer_drop quantize_training
hybrid_engine weight_quantization mics_shard_size mics_hierarchical_params_gather sequence_parallel_size
tensor_parallel expert_parallel use_data_before_expert_parallelism graph_harvesting log_level
managed_gradient_accumulation random_ltd datastates_ckpt zero_optimization_stage legacy_fusion
""".split())

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


def unknown_key_problems(ds: dict[str, Any], source: str) -> list[str]:
    problems = []
    for key in ds:
        if key in KNOWN_TOP_LEVEL_KEYS:
            continue
        close = difflib.get_close_matches(key, sorted(KNOWN_TOP_LEVEL_KEYS), n=1, cutoff=0.6)
        hint = f" (did you mean \"{close[0]}\"?)" if close else ""
        problems.append(f"{source}: unknown DeepSpeed key \"{key}\"{hint}; DeepSpeed would ignore it silently")
    return problems


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
