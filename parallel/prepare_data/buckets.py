"""`--buckets 'F1xH1xW1,F2xH2xW2,...'` or `--buckets preset`: several clip shapes in one prepared folder, and
which one a video gets.

`preset` takes the experiment's `data.buckets` (configs/*.yaml carry the shapes each release trains on;
every one is checked against the model as training checks a bucket, parallel/train/bucket_check.py).

A video of n frames at h x w pixels goes to the bucket that keeps the most of it:
  1. the nearest aspect ratio, |log(H/W) - log(h/w)| (the centre crop then cuts the least);
  2. then the most frames it has: the largest F <= n (with --fps: the frames its duration holds at that
     rate); when every bucket wants more frames than that, the shortest one;
  3. then the largest H x W not above h x w (no upscaling); when all are above, the smallest.
Its clip is resized and centre-cropped to that bucket (parallel/prepare_data/frames.py), its latent
records the bucket in the file's metadata, and the manifest line gets "shape": [F, H, W]
(parallel/train/buckets.py reads it for training).
"""
from __future__ import annotations

import math
import re

import yaml

from parallel.config import CONFIG_DIR

Bucket = tuple[int, int, int]        # pixel (frames, height, width)

_SHAPE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*x\s*(\d+)\s*$")


def parse_buckets(text: str) -> list[Bucket]:
    """'49x480x720,49x720x480' -> [(49, 480, 720), (49, 720, 480)]; ValueError names the bad item."""
    buckets = []
    for item in text.split(","):
        m = _SHAPE.match(item)
        if not m or min(map(int, m.groups())) < 1:
            raise ValueError(f"--buckets={text}: {item.strip()!r} is not FRAMESxHEIGHTxWIDTH in pixels "
                             "(e.g. --buckets 49x480x720,49x720x480,25x480x480)")
        buckets.append(tuple(map(int, m.groups())))
    if len(set(buckets)) != len(buckets):
        raise ValueError(f"--buckets={text}: a shape is listed twice")
    return buckets


PRESET = "preset"


def presets_with_buckets() -> list[str]:
    """Names of the configs/*.yaml presets whose data section lists buckets."""
    found = []
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        data = (yaml.safe_load(path.read_text()) or {}).get("data") or {}
        if data.get("buckets"):
            found.append(path.stem)
    return found


def resolve_buckets(text: str, cfg, source: str) -> list[Bucket]:
    """--buckets: `preset` -> the experiment's data.buckets (`source` names its config), else parse_buckets.
    ValueError says what would work."""
    if text.strip() != PRESET:
        return parse_buckets(text)
    if not cfg.data.buckets:
        raise ValueError(f"--buckets preset: {source} has no data.buckets; give the shapes "
                         f"(--buckets 49x480x720,49x720x480) or use a preset that lists them: "
                         f"{', '.join(presets_with_buckets())}")
    return [tuple(b) for b in cfg.data.buckets]


def choose_bucket(buckets: list[Bucket], frames: int, height: int, width: int) -> Bucket:
    """The bucket that keeps the most of a video of `frames` frames at height x width (module docstring)."""
    aspect = math.log(height / width)

    def key(b: Bucket):
        f, h, w = b
        fits, area = f <= frames, h * w
        return (round(abs(math.log(h / w) - aspect), 9),
                (0, -f) if fits else (1, f),
                (0, -area) if area <= height * width else (1, area))
    return min(buckets, key=key)


def format_bucket(b: Bucket) -> str:
    return "x".join(map(str, b))
