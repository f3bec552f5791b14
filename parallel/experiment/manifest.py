"""A directory dataset's manifest.jsonl (what `python -m parallel.prepare_data` writes and training reads):
its lines, and its buckets (the samples of each shape, parallel/experiment/shapes.py) checked against the model.

A line is {"latent": file, "text": file} (or "caption": str where a text encoder will encode it), with
"shape": [frames, height, width] in pixels when the dataset holds several shapes. A family with a second stream
(LTX-2's audio) stores its tensors in the same two files (STREAM_KEYS).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from parallel.experiment.shapes import (Shape, format_shape, parse_shape, preset_bucket_problems, shape_configs,
                                        shape_problems)

# A second stream's tensors (FamilySpec.second_stream: LTX-2's audio), by the file of the manifest line they sit in:
# the latent file's "audio" (packed audio latents), the text file's "audio_text" (the audio caption states).
STREAM_KEYS = (("latent", "audio"), ("text", "audio_text"))


def read_manifest(root: Path, captions: bool = False, key: str = "data.path") -> tuple[list, list, list[int], list]:
    """`root`/manifest.jsonl as (latent, text) pairs, their captions, their manifest line numbers and their
    shapes ("shape": [frames, height, width] in pixels, or None: the config's; parallel/experiment/shapes.py).

    text is a file, or with `captions` (a text encoder will encode it) the line's caption when it has one.
    Every listed file is checked to exist, so a missing one is named before training starts."""
    manifest = root / "manifest.jsonl"
    if not manifest.is_file():
        raise FileNotFoundError(f"{key}={root}: no manifest.jsonl in it (lines of "
                                '{"latent": "x.safetensors", "text": "x_text.safetensors"})')
    items, texts, lines, shapes = [], [], [], []
    for n, line in enumerate(manifest.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            latent = root / entry["latent"]
            text = entry["caption"] if captions and "caption" in entry else root / entry["text"]
            shapes.append(parse_shape(entry.get("shape"), f"{manifest}:{n}"))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            need = '"text": file or "caption": str' if captions else '"text": file'
            raise ValueError(f"{manifest}:{n}: expected {{\"latent\": file, {need}}} (problem: {e!r})") from None
        for f in (latent, text):
            if isinstance(f, Path) and not f.is_file():
                raise FileNotFoundError(f"{manifest}:{n}: data file {f} does not exist")
        items.append((latent, text))
        texts.append(entry.get("caption") if isinstance(entry.get("caption"), str) else None)
        lines.append(n)
    if not items:
        raise ValueError(f"{manifest}: no samples listed")
    return items, texts, lines, shapes


def bucket_configs(cfg) -> list[tuple[Optional[Shape], int, object]]:
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
