"""Released transformer weights in the diffusers layout: check, and load into any layout.

A diffusers folder (`save_pretrained`, or the `transformer/` folder of a released pipeline) holds
`config.json` and `diffusion_pytorch_model.safetensors`, or several shards listed in
`diffusion_pytorch_model.safetensors.index.json`. What differs between families (the config keys and
the tensor names) is the family's `ReleasedFormat` (models/spec.py; CogVideoX: models/cogvideox/released.py).

`check_released` reads only config.json and the safetensors headers, so train.py refuses a mismatched
folder before any process group exists. `load_released` fills a built (not yet DeepSpeed-initialised)
model: each rank reads only the tensors of its pipeline stage, and of tensor-parallel ones only its
slice (`safe_open(...).get_slice(name)[rows]`). parallel/weights/diffusers_export.py writes any layout's
weights (or EMA) back in this layout.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from models.config import ModelConfig
from models.registry import family
from models.spec import ReleasedFormat
from parallel.model.lora import is_adapter
from parallel.weights.gather import format_shapes, model_tensors

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"
PIPELINE_INDEX = "model_index.json"


def released_format(m: ModelConfig) -> ReleasedFormat:
    """The family's published-weights format; a family without one is refused by name."""
    fmt = family(m).formats.released
    if fmt is None:
        raise ValueError(f"model.family={m.family} has no released-weights format: model.init_from and "
                         f"--format diffusers need a family that has one")
    return fmt.bind(m) if hasattr(fmt, "bind") else fmt     # a name map that depends on the config


def folders(m: ModelConfig) -> dict[str, str]:
    """Released-name prefix -> subfolder of model.init_from ({"": ""}: one transformer, the folder itself; Wan 2.2
    A14B: {"transformer/": "transformer", "transformer_2/": "transformer_2"}, the format's `folders`)."""
    fmt = released_format(m)
    return fmt.folders(m) if hasattr(fmt, "folders") else {"": ""}


def check_config(m: ModelConfig, folder: Path) -> list[str]:
    """config.json (of each subfolder, `folders`) against the model section: one problem per differing key,
    naming both; first what the format says of the folder itself (`check_folder`: a wrong kind of release)."""
    try:
        fmt = released_format(m)
    except ValueError as e:
        return [str(e)]
    if hasattr(fmt, "check_folder"):
        problems = fmt.check_folder(m, folder)
        if problems:
            return problems
    problems = []
    for sub in folders(m).values():
        problems += _check_one(m, fmt, folder / sub / CONFIG_NAME if sub else folder / CONFIG_NAME)
    return problems


def _check_one(m: ModelConfig, fmt: ReleasedFormat, path: Path) -> list[str]:
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        return [f"{path}: cannot read ({e.strerror}); model.init_from must be a diffusers folder with "
                f"config.json and *.safetensors (a pipeline's transformer/ folder)"]
    except json.JSONDecodeError as e:
        return [f"{path}:{e.lineno}:{e.colno}: malformed JSON: {e.msg}"]
    problems = []
    kind = config.get("_class_name", fmt.class_name)
    if kind != fmt.class_name:
        problems.append(f"{path}: _class_name {kind} is not {fmt.class_name}")
    return problems + fmt.check_config(m, config, str(path))


def released_files(m: ModelConfig, folder: Path) -> dict[str, Path]:
    """Released tensor name, with its subfolder prefix (`folders`), -> the safetensors file holding it."""
    files = {}
    for prefix, sub in folders(m).items():
        files.update({prefix + n: p for n, p in tensor_files(folder / sub if sub else folder).items()})
    return files


def stored_name(source: str) -> str:
    """A released name without its subfolder prefix: the name inside its safetensors file."""
    return source.rpartition("/")[2]


def tensor_files(folder: Path) -> dict[str, Path]:
    """Diffusers tensor name -> the safetensors file holding it (from the index when sharded)."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index (needs a weight_map of tensor -> file): {e}") from None
        files = {name: folder / file for name, file in weight_map.items()}
        missing = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if missing:
            raise ValueError(f"{index} lists shards that are not in {folder}: {', '.join(missing)}")
        return files
    candidates = [folder / WEIGHTS_NAME] if (folder / WEIGHTS_NAME).is_file() else sorted(folder.glob("*.safetensors"))
    if len(candidates) != 1:
        found = ", ".join(sorted(p.name for p in folder.iterdir())) if folder.is_dir() else "no such folder"
        hint = f"; the transformer of a pipeline is in {folder / 'transformer'}" \
            if (folder / "transformer" / CONFIG_NAME).is_file() else ""
        raise ValueError(f"{folder}: expected {WEIGHTS_NAME}, or shards with {INDEX_NAME} (found: {found}){hint}")
    from safetensors import safe_open
    with safe_open(str(candidates[0]), framework="pt") as f:
        return {name: candidates[0] for name in f.keys()}


def _shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open
    shapes = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if files.get(name) == path:
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _prefixed_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """_shapes of released_files' (prefixed) names."""
    by_prefix: dict[str, dict[str, Path]] = {}
    for name, path in files.items():
        prefix = name[:len(name) - len(stored_name(name))]
        by_prefix.setdefault(prefix, {})[stored_name(name)] = path
    shapes = {}
    for prefix, group in by_prefix.items():
        shapes.update({prefix + n: shape for n, shape in _shapes(group).items()})
    return shapes


def expected_tensors(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every released tensor name of this model with its shape (the model built on the meta device)."""
    return format_shapes(m, released_format(m).shapes)


def is_single_file(path: Path) -> bool:
    """model.init_from names one .safetensors file (Open-Sora 2.0's checkpoint), not a diffusers folder."""
    return path.suffix == ".safetensors" and not path.is_dir()


def _listing(names: list[str], limit: int = 20) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_released(m: ModelConfig, folder: str | Path) -> list[str]:
    """Every problem with a diffusers folder for this model: config keys, missing, unexpected and
    mis-shaped tensors (reads config.json and the safetensors headers only). A .safetensors file is Open-Sora 2.0's
    checkpoint (parallel/weights/opensora.py)."""
    folder = Path(folder)
    if is_single_file(folder):
        from parallel.weights.opensora import check_opensora
        return check_opensora(m, folder)
    problems = check_config(m, folder)
    if problems:
        return problems
    try:
        files = released_files(m, folder)
    except ValueError as e:
        return [str(e)]
    have, want = _prefixed_shapes(files), expected_tensors(m)
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    if missing:
        problems.append(f"{folder}: {len(missing)} tensors of {released_format(m).class_name} are missing: "
                        f"{_listing(missing)}")
    if unexpected:
        problems.append(f"{folder}: {len(unexpected)} tensors have no place in the toolkit's model: "
                        f"{_listing(unexpected)}")
    wrong = [f"{n} {list(have[n])} (expected {list(want[n])})" for n in sorted(set(have) & set(want))
             if have[n] != want[n]]
    if wrong:
        problems.append(f"{folder}: {len(wrong)} tensors have other shapes than the config implies: {_listing(wrong)}")
    return problems


def _rank_slices(sources: list[str], p: torch.Tensor, ctx) -> list[tuple[str, tuple]]:
    """(released name, index) pairs whose reads, concatenated along the partition dim, give this rank's p."""
    r = ctx.tp_rank
    if not getattr(p, "tensor_model_parallel", False):    # replicated: the whole tensor(s)
        return [(s, (slice(None),)) for s in sources]
    if p.partition_dim == 1:                              # row-parallel: columns of each fused input part
        offsets, pieces = 0, []
        for n in getattr(p, "tp_parts", None) or [p.shape[1]]:
            pieces.append((sources[0], (slice(None), slice(offsets + r * n, offsets + (r + 1) * n))))
            offsets += n * ctx.tp_size
        return pieces
    local = getattr(p, "tp_parts", None) or [p.shape[0]]  # column-parallel: rows of each fused part
    return [(s, (slice(r * n, (r + 1) * n),)) for s, n in zip(sources, local)]


@torch.no_grad()
def load_released(module: nn.Module, ctx, m: ModelConfig, folder: str | Path) -> int:
    """Copy released weights into this rank's part of a built model (before deepspeed.initialize);
    returns the number of elements read. Raises ValueError listing every problem, before reading any."""
    from safetensors import safe_open
    folder = Path(folder)
    if is_single_file(folder):
        from parallel.weights.opensora import load_opensora
        return load_opensora(module, ctx, m, folder)
    problems = check_released(m, folder)
    if problems:
        raise ValueError("\n".join(problems))
    fmt, files = released_format(m), released_files(m, folder)
    handles, read = {}, 0
    for name, target in model_tensors(module, m.num_layers):
        if is_adapter(name):                              # LoRA's adapters: model.lora.init_from
            continue
        pieces = []
        for source, index in _rank_slices(fmt.names(name), target, ctx):
            path = files[source]
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt", device="cpu")
            pieces.append(handles[path].get_slice(stored_name(source))[index])
        value = torch.cat(pieces, dim=getattr(target, "partition_dim", 0)) if len(pieces) > 1 else pieces[0]
        target.copy_(value.reshape(target.shape).to(target.dtype))
        read += value.numel()
    return read


def _diffusers_version() -> str:
    try:
        from importlib.metadata import version
        return version("diffusers")
    except Exception:                                     # the optional extra is not installed
        return "0.30.0"


def diffusers_config(m: ModelConfig, data) -> dict:
    """The config.json of the released class equal to this model."""
    fmt = released_format(m)
    return {"_class_name": fmt.class_name, "_diffusers_version": _diffusers_version(), **fmt.config(m, data)}


def pipeline_index(m: ModelConfig) -> Optional[dict]:
    """The model_index.json a folder of several transformers holds beside their subfolders (Wan 2.2 A14B: the
    pipeline's boundary_ratio between transformer/ and transformer_2/), or None: the format's `pipeline_index`."""
    fmt = released_format(m)
    index = fmt.pipeline_index(m) if hasattr(fmt, "pipeline_index") else None
    return None if index is None else {"_diffusers_version": _diffusers_version(), **index}
