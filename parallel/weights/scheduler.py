"""A released pipeline's noise schedule against `model.schedule`: its scheduler/scheduler_config.json.

`model.init_from` names a pipeline's transformer/ folder; when the pipeline's scheduler/ folder sits beside
it, its scheduler_config.json is checked by the family's release scheduler (FamilySpec.sampling.scheduler,
models/scheduler_config.py): every key that shapes the schedule or the sampler must equal the experiment's, so
fine-tuning uses the release's schedule; keys absent from the file take that scheduler class's defaults.
"""
from __future__ import annotations

import json
from pathlib import Path

from models.config import ModelConfig
from models.registry import family

SCHEDULER_CONFIG = Path("scheduler") / "scheduler_config.json"


def scheduler_config_path(init_from: str | Path) -> Path:
    """Where a pipeline keeps the schedule of the transformer folder `init_from` (beside it); `init_from` a whole
    pipeline folder (Wan 2.2 A14B: transformer/ and transformer_2/ in it): inside it."""
    inside = Path(init_from).resolve() / SCHEDULER_CONFIG
    return inside if inside.is_file() else Path(init_from).resolve().parent / SCHEDULER_CONFIG


def check_scheduler(m: ModelConfig, init_from: str | Path) -> list[str]:
    """Every schedule key of the sibling scheduler_config.json that disagrees with the model section, named;
    nothing when there is no such file (a bare transformer folder) or the family has no released scheduler."""
    path = scheduler_config_path(init_from)
    scheduler = family(m).sampling.scheduler
    if not path.is_file() or scheduler is None:
        return []
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        return [f"{path}:{e.lineno}:{e.colno}: malformed JSON: {e.msg}"]
    return scheduler.check(m, config, str(path))
