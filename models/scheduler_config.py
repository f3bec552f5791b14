"""A released pipeline's `scheduler/scheduler_config.json` read against `model.objective` and `model.schedule`.

Each family's spec names its release's scheduler (FamilySpec.sampling.scheduler): a `DiffusersScheduler` with
the constructor defaults of the scheduler class its release ships, which keys absent from the file take (as
diffusers does). A flow-matching file (`prediction_type: flow_prediction`, `use_flow_sigmas`, or a FlowMatch*
class) has no DDPM schedule: it needs model.objective flow_matching, nothing more (its flow_shift is the sampler's
suggestion). Any other file is a DDPM schedule: its prediction_type must be model.objective and every key that
shapes the schedule must equal model.schedule's (models/config.py NoiseSchedule).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from models.config import ModelConfig, set_flag

SCHEDULE_KEYS = ("beta_start", "beta_end", "beta_schedule", "snr_shift_scale", "rescale_betas_zero_snr",
                 "timestep_spacing")
# What the toolkit's DDPM schedule (models/diffusion.py) fixes: 1000 training steps, betas from the keys above.
FIXED = {"num_train_timesteps": 1000, "trained_betas": None, "set_alpha_to_one": True, "steps_offset": 0}


def _show(value) -> str:
    return json.dumps(value)


def is_flow(config: dict) -> bool:
    return config.get("prediction_type") == "flow_prediction" or bool(config.get("use_flow_sigmas")) or \
        "FlowMatch" in str(config.get("_class_name", ""))


@dataclass(frozen=True)
class DiffusersScheduler:
    """A release's scheduler class: `defaults`, its constructor defaults for the keys the check reads;
    `release`, who ships it (for messages)."""

    defaults: dict
    release: str

    def check(self, m: ModelConfig, config: dict, path: str) -> list[str]:
        if is_flow(config):
            return [] if m.objective == "flow_matching" else [
                f"{path}: a flow-matching scheduler ({config.get('_class_name', '?')}) != model.objective "
                f"{m.objective}; set --set model.objective=flow_matching or use the matching preset"]
        theirs = {**self.defaults, **config}
        problems = []
        if theirs.get("prediction_type") != m.objective:
            problems.append(f"{path}: prediction_type {_show(theirs.get('prediction_type'))} != model.objective "
                            f"{m.objective}; set {set_flag('model.objective', theirs.get('prediction_type'))} "
                            f"or use the matching preset")
        for key in SCHEDULE_KEYS:
            ours = getattr(m.schedule, key)
            if theirs.get(key) != ours:
                problems.append(f"{path}: {key} {_show(theirs.get(key))} != model.schedule.{key} {_show(ours)}; set "
                                f"{set_flag(f'model.schedule.{key}', theirs.get(key))} or use the matching preset")
        for key, value in FIXED.items():
            if theirs.get(key, value) != value:
                problems.append(f"{path}: {key} {_show(theirs[key])} is not supported (the toolkit's schedule has "
                                f"{key} {_show(value)}, as {self.release} do)")
        return problems
