"""Buckets in the memory plan: a run of several clip shapes is sized on its longest one, and each shape gets
a row of its own (tokens, sp padding, activations, the worst rank's total, step time).

Where the shapes come from, first found:
  1. `--buckets 'FxHxW,...'` or `--buckets preset` (the config's data.buckets), as prepare_data takes them;
  2. a directory dataset's manifest (data.kind: directory): its samples' shapes, with their counts, as
     training reads them (parallel/experiment/manifest.py);
  3. else the config's one shape (no table).

A bucket's row is the plan of the experiment fixed at that shape (data.num_frames x data.height x
data.width), traced afresh (the token grid changes every activation), at the same layout and engine
settings: the row of the longest bucket is the plan printed above it. With sample counts the expected
step time is sum_b n_b t_b / N, since a step draws bucket b with probability n_b / N.
"""
from __future__ import annotations

from typing import Optional

from parallel.experiment.config import ConfigError
from parallel.distributed.sequence import padded_length
from parallel.plan.memory import EngineSettings, plan_memory
from parallel.plan.search import DEVICES, estimate_step_time
from parallel.plan.trace import ActivationTracer, sequence_length
from parallel.experiment.manifest import bucket_configs
from parallel.experiment.shapes import format_shape, resolve_buckets, shape_configs, shape_problems
from parallel.experiment.units import gib


def plan_buckets(cfg, buckets: Optional[str], source: str) -> list[tuple]:
    """(shape, samples or None, the experiment at that shape), the longest first (the one the plan sizes);
    [(None, None, cfg)] when the run has one shape. ConfigError names a shape the model refuses."""
    if buckets:
        try:
            shapes = resolve_buckets(buckets, cfg, source)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        problems = [p for s in shapes for p in shape_problems(cfg, s, f"--buckets: {format_shape(s)}")]
        if problems:
            raise ConfigError("\n".join(problems))
        return shape_configs(cfg, shapes)
    if cfg.data.kind == "directory":
        return bucket_configs(cfg)
    return [(None, None, cfg)]


def bucket_rows(cfg, found: list[tuple], ds: dict, dp: int, args) -> list[dict]:
    """One row per bucket for the layout of `cfg` (its parallel and train sections): the plan and the step
    time estimate of the experiment at that bucket's shape."""
    eng = EngineSettings.from_ds(ds, cfg.model.num_layers)
    rows = []
    for shape, samples, bucket in found:
        at_shape = bucket.model_copy(update={"parallel": cfg.parallel, "train": cfg.train})
        tracer = ActivationTracer(at_shape, eng.dtype)
        memory = plan_memory(at_shape, ds, dp, args.device_memory, tracer, args.margin, args.workspace)
        stage_params = max(stage.params for stage in memory.stages)
        time = estimate_step_time(at_shape, eng, dp, DEVICES[args.device], args.devices_per_node, args.utilisation,
                                  tracer, stage_params)
        tokens = sequence_length(at_shape)
        d = at_shape.data
        rows.append({"shape": [d.num_frames, d.height, d.width], "samples": samples, "tokens": tokens,
                     "padded_tokens": padded_length(tokens, cfg.parallel.sp_size),
                     "activations": memory.worst.lines["activations"], "recompute": memory.worst.lines["recompute"],
                     "total": memory.worst.total, "fits": memory.fits, "step_time": time.total,
                     "samples_per_s": time.samples_per_s})
    return rows


def expected_step_time(rows: list[dict]) -> Optional[float]:
    """sum_b n_b t_b / N over the buckets, when every bucket's sample count is known."""
    if not rows or any(r["samples"] is None for r in rows):
        return None
    return sum(r["samples"] * r["step_time"] for r in rows) / sum(r["samples"] for r in rows)


def render_buckets_text(rows: list[dict], where: str) -> list[str]:
    """The per-bucket table, in the units of the rest of the report (GiB, seconds)."""
    out = ["", f"buckets ({where}; sized on the first, the longest):",
           f"{'bucket':>14} {'samples':>8} {'tokens':>9} {'sp pad':>7} {'activations':>12} {'recompute':>10} "
           f"{'GiB':>8} {'fits':>5} {'step s':>8}"]
    for r in rows:
        out.append(f"{'x'.join(map(str, r['shape'])):>14} {'-' if r['samples'] is None else r['samples']:>8} "
                   f"{r['tokens']:>9,} {r['padded_tokens'] - r['tokens']:>7} {gib(r['activations']):>12} "
                   f"{gib(r['recompute']):>10} {gib(r['total']):>8} {'yes' if r['fits'] else 'NO':>5} "
                   f"{r['step_time']:>8.2f}")
    mean = expected_step_time(rows)
    if mean is not None:
        out.append(f"expected step time over the buckets (a step draws bucket b with probability n_b / N): "
                   f"{mean:.2f} s")
    return out
