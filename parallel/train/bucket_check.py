"""The buckets of an experiment's directory dataset checked against its model, and the longest one (what
the checker reports and the memory plan sizes); parallel/train/buckets.py has the schedule."""
from __future__ import annotations

from pathlib import Path

from models.geometry import token_grid
from models.registry import sequence_tokens
from parallel.train.buckets import Shape, bucket_data, format_shape
from parallel.train.data import read_manifest


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
    out = [(s, shapes.count(s), cfg.model_copy(update={"data": bucket_data(cfg.data, s)}))
           for s in sorted(set(shapes), key=lambda s: (s is not None, s or ()))]
    return sorted(out, key=lambda b: -sequence_tokens(b[2].model, b[2].data))


def bucket_problems(cfg) -> list[str]:
    """Every bucket's shape against the model: whole latents and patches, and positions learned for one grid
    (the model config's `fixed_position_grid()`) refuse any other grid."""
    if cfg.data.kind != "directory":
        return []
    m, problems = cfg.model, []
    base = token_grid(m, cfg.data)
    fixed = m.fixed_position_grid()
    for shape, n, c in bucket_configs(cfg):
        if shape is None:
            continue
        where = f"data.path={cfg.data.path}: bucket {format_shape(shape)} ({n} sample{'s' if n > 1 else ''})"
        frames, height, width = shape
        step = m.vae_scale_spatial * m.patch_size
        if (frames - 1) % m.vae_scale_temporal:
            problems.append(f"{where}: {frames} frames; model.vae_scale_temporal={m.vae_scale_temporal} takes 1 + k x "
                            f"{m.vae_scale_temporal} frames")
        for name, size in (("height", height), ("width", width)):
            if size % step:
                problems.append(f"{where}: {name} {size} is not a multiple of model.vae_scale_spatial x "
                                f"model.patch_size = {step}")
        if fixed and token_grid(m, c.data) != base:
            problems.append(f"{where}: {fixed} is learned for one token grid, "
                            f"{'x'.join(map(str, base))} (data.num_frames x data.height x data.width), and this "
                            f"bucket's grid is {'x'.join(map(str, token_grid(m, c.data)))}; train it in a run of "
                            f"its own, or leave it out of the manifest")
    return problems
