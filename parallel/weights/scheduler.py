"""A released pipeline's noise schedule against `model.schedule`: its scheduler/scheduler_config.json.

`model.init_from` names a pipeline's transformer/ folder; when the pipeline's scheduler/ folder sits beside
it, every key of its scheduler_config.json that shapes the schedule or the sampler must equal the
experiment's (models/config.py NoiseSchedule; prediction_type is model.objective), so fine-tuning uses the
release's schedule. Keys absent from the file take the CogVideoX schedulers' defaults, as diffusers does.

A flow-matching scheduler (`prediction_type: flow_prediction`, `use_flow_sigmas`, or a FlowMatch* class: Wan 2.1's
UniPCMultistepScheduler) has no DDPM schedule: it needs model.objective flow_matching, nothing more. Its
flow_shift is the sampler's suggestion, not checked: the releases ship 3.0 and recommend 5.0 at 720p.
"""
from __future__ import annotations

import json
from pathlib import Path

from models.config import ModelConfig

SCHEDULER_CONFIG = Path("scheduler") / "scheduler_config.json"

# diffusers' CogVideoXDDIMScheduler / CogVideoXDPMScheduler constructor defaults (the same in both).
DEFAULTS = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
            "trained_betas": None, "set_alpha_to_one": True, "steps_offset": 0, "prediction_type": "epsilon",
            "timestep_spacing": "leading", "rescale_betas_zero_snr": False, "snr_shift_scale": 3.0}
SCHEDULE_KEYS = ("beta_start", "beta_end", "beta_schedule", "snr_shift_scale", "rescale_betas_zero_snr",
                 "timestep_spacing")
FIXED = {"num_train_timesteps": 1000, "trained_betas": None, "set_alpha_to_one": True, "steps_offset": 0}


def scheduler_config_path(init_from: str | Path) -> Path:
    """Where a pipeline keeps the schedule of the transformer folder `init_from`."""
    return Path(init_from).resolve().parent / SCHEDULER_CONFIG


def _show(value) -> str:
    return json.dumps(value)


def _want(value) -> str:
    return value if isinstance(value, str) else _show(value)


def _is_flow(config: dict) -> bool:
    return config.get("prediction_type") == "flow_prediction" or bool(config.get("use_flow_sigmas")) or \
        "FlowMatch" in str(config.get("_class_name", ""))


def check_scheduler(m: ModelConfig, init_from: str | Path) -> list[str]:
    """Every schedule key of the sibling scheduler_config.json that disagrees with the model section, named;
    nothing when there is no such file (a bare transformer folder)."""
    path = scheduler_config_path(init_from)
    if not path.is_file():
        return []
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        return [f"{path}:{e.lineno}:{e.colno}: malformed JSON: {e.msg}"]
    if _is_flow(config):
        return [] if m.objective == "flow_matching" else [
            f"{path}: a flow-matching scheduler ({config.get('_class_name', '?')}) != model.objective {m.objective}; "
            f"set --set model.objective=flow_matching or use the matching preset"]
    theirs = {**DEFAULTS, **config}
    problems = []
    if theirs["prediction_type"] != m.objective:
        problems.append(f"{path}: prediction_type {_show(theirs['prediction_type'])} != model.objective "
                        f"{m.objective}; set --set model.objective={_want(theirs['prediction_type'])} "
                        f"or use the matching preset")
    for key in SCHEDULE_KEYS:
        ours = getattr(m.schedule, key)
        if theirs[key] != ours:
            problems.append(f"{path}: {key} {_show(theirs[key])} != model.schedule.{key} {_show(ours)}; set "
                            f"--set model.schedule.{key}={_want(theirs[key])} or use the matching preset")
    for key, value in FIXED.items():
        if theirs[key] != value:
            problems.append(f"{path}: {key} {_show(theirs[key])} is not supported (the toolkit's schedule has "
                            f"{key} {_show(value)}, as the CogVideoX releases do)")
    return problems
