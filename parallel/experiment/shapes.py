"""Clip shapes, one vocabulary for every command: a `Shape` is a pixel (frames, height, width); a bucket is
the samples of one shape (a directory dataset may hold several; parallel/experiment/manifest.py reads them, and
parallel/train/buckets.py schedules which one each step trains on).

Shapes come from a manifest line's `"shape": [F, H, W]` (`parse_shape`), from `--buckets 'FxHxW,...'`
(`parse_shapes`) or `--buckets preset`, the config's `data.buckets` (`resolve_buckets`). Each is checked
against the model (`shape_problems`) as the checker, the planner and prepare_data check it, and the
experiment at a shape is its `data:` section with that frames x height x width (`bucket_data`).

A video of n frames at h x w pixels goes to the bucket that keeps the most of it (`choose_bucket`):
  1. the nearest aspect ratio, |log(H/W) - log(h/w)| (the centre crop then cuts the least);
  2. then the most frames it has: the largest F <= n (with --fps: the frames its duration holds at that
     rate); when every bucket wants more frames than that, the shortest one;
  3. then the largest H x W not above h x w (no upscaling); when all are above, the smallest.
"""
from __future__ import annotations

import math
import re
from typing import Optional, Sequence

import yaml

from models.geometry import token_grid
from models.registry import sequence_tokens
from parallel.experiment.config import CONFIG_DIR

Shape = tuple[int, int, int]        # (frames, height, width) in pixels; Optional[Shape] None: the config's

PRESET = "preset"
_SHAPE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*x\s*(\d+)\s*$")


def parse_shape(value, where: str) -> Optional[Shape]:
    """A manifest line's "shape" value: three positive ints, or absent (None)."""
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 3 and all(isinstance(n, int) and n > 0 for n in value)):
        raise ValueError(f'{where}: "shape" must be [frames, height, width] in pixels, e.g. [49, 480, 720]; '
                         f"got {value!r}")
    return tuple(value)


def parse_shapes(text: str) -> list[Shape]:
    """'49x480x720,49x720x480' -> [(49, 480, 720), (49, 720, 480)]; ValueError names the bad item."""
    shapes = []
    for item in text.split(","):
        m = _SHAPE.match(item)
        if not m or min(map(int, m.groups())) < 1:
            raise ValueError(f"--buckets={text}: {item.strip()!r} is not FRAMESxHEIGHTxWIDTH in pixels "
                             "(e.g. --buckets 49x480x720,49x720x480,25x480x480)")
        shapes.append(tuple(map(int, m.groups())))
    if len(set(shapes)) != len(shapes):
        raise ValueError(f"--buckets={text}: a shape is listed twice")
    return shapes


def format_shape(shape: Optional[Shape]) -> str:
    """(49, 480, 720) -> '49x480x720' (as --buckets and the manifest's readers take it)."""
    return "the config's shape" if shape is None else "x".join(map(str, shape))


def presets_with_buckets() -> list[str]:
    """Names of the configs/*.yaml presets whose data section lists buckets."""
    found = []
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        data = (yaml.safe_load(path.read_text()) or {}).get("data") or {}
        if data.get("buckets"):
            found.append(path.stem)
    return found


def resolve_buckets(text: str, cfg, source: str) -> list[Shape]:
    """--buckets: `preset` -> the experiment's data.buckets (`source` names its config), else parse_shapes.
    ValueError says what would work."""
    if text.strip() != PRESET:
        return parse_shapes(text)
    if not cfg.data.buckets:
        raise ValueError(f"--buckets preset: {source} has no data.buckets; give the shapes "
                         f"(--buckets 49x480x720,49x720x480) or use a preset that lists them: "
                         f"{', '.join(presets_with_buckets())}")
    return [tuple(b) for b in cfg.data.buckets]


def choose_bucket(shapes: list[Shape], frames: int, height: int, width: int) -> Shape:
    """The bucket that keeps the most of a video of `frames` frames at height x width (module docstring)."""
    aspect = math.log(height / width)

    def key(b: Shape):
        f, h, w = b
        fits, area = f <= frames, h * w
        return (round(abs(math.log(h / w) - aspect), 9),
                (0, -f) if fits else (1, f),
                (0, -area) if area <= height * width else (1, area))
    return min(shapes, key=key)


def bucket_data(data, shape: Optional[Shape]):
    """The experiment's `data:` section with one bucket's frames x height x width (models.geometry takes it)."""
    if shape is None:
        return data
    frames, height, width = shape
    return data.model_copy(update={"num_frames": frames, "height": height, "width": width})


def dataset_shapes(data, shapes: Sequence[Optional[Shape]]) -> list:
    """Each distinct shape of a dataset as a `data:` section, largest (most pixels) first."""
    distinct = sorted(set(shapes), key=lambda s: (s is not None, s or ()))
    sections = [bucket_data(data, s) for s in distinct]
    return sorted(sections, key=lambda d: -d.num_frames * d.height * d.width)


def shape_configs(cfg, shapes: Sequence[Optional[Shape]], counts: Optional[Sequence[int]] = None) -> list[tuple]:
    """(shape, samples or None, the experiment at that shape) for each shape, the longest token sequence first
    (ties: the most pixels, then the shape), as the memory plan sizes the first."""
    counts = list(counts) if counts is not None else [None] * len(shapes)
    out = [(s, n, cfg.model_copy(update={"data": bucket_data(cfg.data, s)})) for s, n in zip(shapes, counts)]

    def key(b):
        d = b[2].data
        return (-sequence_tokens(b[2].model, d), -d.num_frames * d.height * d.width, b[0] is not None, b[0] or ())
    return sorted(out, key=key)


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
