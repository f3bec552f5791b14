"""What a checkpoint records of the data order and the learning-rate schedule, and the one line a resume
prints when this run's differ (it still resumes: a changed schedule is often meant, but never silent).

The data order is fixed by (train.seed, the dataset: data.kind, data.path, data.num_samples) and the global
batch (which find_resume refuses to change); the schedule by train.lr, min_lr, warmup_steps, the decay
horizon (train.decay_steps, else train.max_steps) and the DeepSpeed JSON's scheduler section.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from parallel.experiment.config import ExperimentConfig
from parallel.train.schedule import scheduler_params

MARKER = "complete.json"       # parallel.checkpoints.checkpoint.MARKER (that module imports this one's callers)


def run_records(cfg: ExperimentConfig, ds: dict) -> dict:
    """{"data_order": {...}, "schedule": {...}}: dotted key -> value, for the checkpoint's marker."""
    t, d = cfg.train, cfg.data
    found = scheduler_params(ds, t)
    return {"data_order": {"train.seed": t.seed, "data.kind": d.kind, "data.path": d.path,
                           **({"data.num_samples": d.num_samples} if d.kind == "synthetic" else {})},
            "schedule": {"train.lr": t.lr, "train.min_lr": t.min_lr, "train.warmup_steps": t.warmup_steps,
                         "decay horizon (train.decay_steps or train.max_steps)": t.decay_steps or t.max_steps,
                         "scheduler (DeepSpeed JSON)": None if found is None else json.loads(json.dumps(found))}}


def resume_changes(folder: Path, records: dict) -> Optional[str]:
    """One line naming every recorded key whose value differs between the checkpoint in `folder` and this
    run (`records`: run_records'), or None (also for a checkpoint written before these records)."""
    saved = json.loads((Path(folder) / MARKER).read_text())
    parts = []
    for section, label in (("data_order", "data order"), ("schedule", "schedule")):
        if section not in saved:
            continue
        differ = [f"{k} {json.dumps(saved[section].get(k))} -> {json.dumps(v)}"
                  for k, v in records[section].items() if saved[section].get(k) != v]
        if differ:
            parts.append(f"the {label} ({', '.join(differ)})")
    if not parts:
        return None
    return (f"resuming {folder} with {' and '.join(parts)} changed: the steps after it are not the ones the run "
            f"that wrote it would have taken")
