"""The buckets of an experiment checked against its model, and the longest one (what the checker reports
and the memory plan sizes): a directory dataset's (its manifest's shapes), a preset's `data.buckets`, or a
list given on a command line. parallel/train/buckets.py has the schedule."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from models.geometry import token_grid
from models.registry import sequence_tokens
from parallel.train.buckets import Shape, bucket_data, format_shape
from parallel.train.data import read_manifest


def shape_configs(cfg, shapes: Sequence[Shape], counts: Optional[Sequence[int]] = None) -> list[tuple]:
    """(shape, samples or None, the experiment at that shape) for each shape, the longest token sequence first
    (ties: the most pixels, then the shape), as the memory plan sizes the first."""
    counts = list(counts) if counts is not None else [None] * len(shapes)
    out = [(s, n, cfg.model_copy(update={"data": bucket_data(cfg.data, s)})) for s, n in zip(shapes, counts)]

    def key(b):
        d = b[2].data
        return (-sequence_tokens(b[2].model, d), -d.num_frames * d.height * d.width, b[0] is not None, b[0] or ())
    return sorted(out, key=key)


def bucket_configs(cfg) -> list[tuple[Shape, int, object]]:
    """(shape, samples, the experiment at that shape) for each bucket of a directory dataset (data.path's
    manifest), the longest token sequence first; [(None, n, cfg)] for synthetic data or one shape.
    The manifest is read (its lines only); an unreadable one gives the config's shape (check_shapes names it)."""
    if cfg.data.kind != "directory":
        return [(None, cfg.data.num_samples, cfg)]
    try:
        shapes = read_manifest(Path(cfg.data.path), captions=True)[3]
    except (FileNotFoundError, ValueError):
        return [(None, 0, cfg)]
    distinct = sorted(set(shapes), key=lambda s: (s is not None, s or ()))
    return shape_configs(cfg, distinct, [shapes.count(s) for s in distinct])


def shape_problems(cfg, shape: tuple[int, int, int], where: str) -> list[str]:
    """One bucket's shape against the model: 1 + k x vae_scale_temporal frames, height and width whole
    patches of whole latents, and positions learned for one grid (the model config's
    `fixed_position_grid()`) refuse any other grid. `where` starts each message."""
    m, problems = cfg.model, []
    frames, height, width = shape
    step = m.vae_scale_spatial * m.patch_size
    if (frames - 1) % m.vae_scale_temporal:
        problems.append(f"{where}: {frames} frames; model.vae_scale_temporal={m.vae_scale_temporal} takes 1 + k x "
                        f"{m.vae_scale_temporal} frames")
    for name, size in (("height", height), ("width", width)):
        if size % step:
            problems.append(f"{where}: {name} {size} is not a multiple of model.vae_scale_spatial x "
                            f"model.patch_size = {step}")
    base, fixed = token_grid(m, cfg.data), m.fixed_position_grid()
    grid = token_grid(m, bucket_data(cfg.data, shape))
    if fixed and grid != base:
        problems.append(f"{where}: {fixed} is learned for one token grid, "
                        f"{'x'.join(map(str, base))} (data.num_frames x data.height x data.width), and this "
                        f"bucket's grid is {'x'.join(map(str, grid))}; train it in a run of "
                        f"its own, or leave this shape out")
    limit = m.largest_position_grid()
    if limit is not None and (grid[1] > limit[0][0] or grid[2] > limit[0][1]):
        problems.append(f"{where}: a {grid[1]} x {grid[2]} patch grid exceeds the rotary table's "
                        f"{limit[0][0]} x {limit[0][1]} ({limit[1]}); leave this shape out or use a smaller one")
    return problems


def preset_bucket_problems(cfg, source: str = "data.buckets") -> list[str]:
    """Every shape of the preset's `data.buckets` list against the model (shape_problems)."""
    return [p for shape in cfg.data.buckets or ()
            for p in shape_problems(cfg, shape, f"{source}: {format_shape(shape)}")]


def bucket_problems(cfg) -> list[str]:
    """Every bucket of the directory dataset (data.path's manifest) and of the preset's data.buckets
    against the model (shape_problems)."""
    problems = preset_bucket_problems(cfg)
    if cfg.data.kind != "directory":
        return problems
    for shape, n, c in bucket_configs(cfg):
        if shape is not None:
            where = f"data.path={cfg.data.path}: bucket {format_shape(shape)} ({n} sample{'s' if n > 1 else ''})"
            problems += shape_problems(cfg, shape, where)
    return problems
