"""A family's single-file checkpoint (FamilySpec.formats.checkpoint, a models.spec.CheckpointFormat: Open-Sora 2.0's
`Open_Sora_v2.safetensors` with its MMDiTModel's names, for the HunyuanVideo family) in and out of a model of any
layout; the name map and its rewrites are the family's (models/hunyuanvideo/opensora2.py).

`check_opensora` reads the header only (every missing, unexpected or mis-shaped tensor at once, before any
process group); `load_opensora` fills a built model: each rank reads the tensors of its pipeline stage, rewrites
them to the toolkit's full tensor and keeps its tensor-parallel slice; `write_opensora` writes full tensors
(`parallel.weights.gather.full_tensors` of any layout) back under the checkpoint's names, bit for bit what was read.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from models.config import ModelConfig
from models.registry import FAMILIES, family
from models.spec import CheckpointFormat
from parallel.model.lora import is_adapter
from parallel.weights.gather import format_shapes, model_tensors


def format_problems(m: ModelConfig) -> list[str]:
    """What keeps this model section from its family's single-file checkpoint, each with its key. A family without
    one: the refusal of a family that has one (it names the family the file loads into)."""
    own = family(m).formats.checkpoint
    if own is not None:
        return own.problems(m)
    other: CheckpointFormat | None = next((s.formats.checkpoint for s in FAMILIES.values() if s.formats.checkpoint),
                                          None)
    return (other.problems(m) if other else []) or [f"model.family={m.family} reads no single-file checkpoint; "
                                                    f"model.init_from must be a diffusers folder"]


def expected_tensors(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor name of this model with its shape (the model built on the meta device)."""
    return format_shapes(m, family(m).formats.checkpoint.shapes)


def check_opensora(m: ModelConfig, path: str | Path) -> list[str]:
    """Every problem with the family's single-file checkpoint for this model section (reads the safetensors
    header)."""
    from safetensors import safe_open
    path = Path(path)
    problems = [f"{path}: {p}" for p in format_problems(m)]
    if problems:
        return problems
    fmt = family(m).formats.checkpoint
    try:
        with safe_open(str(path), framework="pt") as f:
            have = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    except Exception as e:                                   # not a file, not safetensors
        return [f"{path}: cannot read as safetensors ({e}); model.init_from must be {fmt.title}'s "
                f"{fmt.file_name} or a diffusers folder"]
    want = expected_tensors(m)
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing:
        problems.append(f"{path}: {len(missing)} tensors of {fmt.title} are missing: {', '.join(missing[:20])}")
    if unexpected:
        problems.append(f"{path}: {len(unexpected)} tensors have no place in the model (model.cond_embed, "
                        f"model.guidance_embed, model.num_layers?): {', '.join(unexpected[:20])}")
    wrong = [f"{n} {list(have[n])} (expected {list(want[n])})" for n in sorted(set(have) & set(want))
             if have[n] != want[n]]
    if wrong:
        problems.append(f"{path}: {len(wrong)} tensors have other shapes than the config implies: "
                        f"{', '.join(wrong[:20])}")
    return problems


def _local(full: torch.Tensor, p: torch.Tensor, ctx) -> torch.Tensor:
    """This rank's tensor-parallel slice of a full tensor: the rank's rows (or columns) of each fused part."""
    if not getattr(p, "tensor_model_parallel", False) or ctx.tp_size == 1:
        return full
    dim, r = p.partition_dim, ctx.tp_rank
    local = getattr(p, "tp_parts", None) or [p.shape[dim]]
    parts = full.split([n * ctx.tp_size for n in local], dim=dim)
    return torch.cat([part.narrow(dim, r * n, n) for part, n in zip(parts, local)], dim=dim)


@torch.no_grad()
def load_opensora(module: nn.Module, ctx, m: ModelConfig, path: str | Path) -> int:
    """Copy the family's single-file checkpoint into this rank's part of a built model (before
    deepspeed.initialize); returns the number of elements read. Raises ValueError listing every problem, before
    reading any."""
    from safetensors import safe_open
    problems = check_opensora(m, path)
    if problems:
        raise ValueError("\n".join(problems))
    fmt, read = family(m).formats.checkpoint, 0
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name, target in model_tensors(module, m.num_layers):
            if is_adapter(name):                             # LoRA's adapters: model.lora.init_from
                continue
            tensors = [f.get_tensor(n) for n in fmt.names(name, m)]
            full = fmt.from_checkpoint(name, tensors, m)
            target.copy_(_local(full, target, ctx).reshape(target.shape).to(target.dtype))
            read += full.numel()
    return read


def write_opensora(tensors: Iterable[tuple[str, torch.Tensor]], m: ModelConfig, path: str | Path,
                   dtype: torch.dtype = torch.float32, metadata: dict | None = None) -> Path:
    """Write full toolkit tensors ((canonical name, tensor), every one of the model) under the checkpoint's
    names."""
    from safetensors.torch import save_file
    to_checkpoint, out = family(m).formats.checkpoint.to_checkpoint, {}
    for name, full in tensors:
        if not is_adapter(name):
            out.update({n: t.to(dtype) for n, t in to_checkpoint(name, full, m).items()})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path), metadata=metadata)
    return path


def export_problems(m) -> list[str]:
    """Why `python -m parallel.export --format opensora` cannot write this model section, each with its key."""
    lora = ["model.lora: --format opensora writes the base weights alone; fold the adapters in with --format "
            "diffusers --merge-lora, or export without model.lora"] if getattr(m, "lora", None) else []
    return format_problems(m) + lora


def export_opensora(module: nn.Module, ctx, cfg, out: str | Path, value=None, zero3: bool = False,
                    dtype: torch.dtype = torch.float32, metadata: dict | None = None) -> list[Path]:
    """Write this model (or `value(param)`, its EMA) of any layout as its family's single-file checkpoint, `out`
    (a .safetensors path); call on every rank. Each stage's full tensors are gathered over tp (one at a time) and
    sent to rank 0, which writes the file: it holds the whole model once, as Open-Sora's single file does."""
    import torch.distributed as dist

    from parallel.weights.gather import full_tensors
    m = cfg.model
    problems = format_problems(m)
    if problems:
        raise ValueError("\n".join(problems))
    local = dict(full_tensors(module, ctx, m.num_layers, value, zero3))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local if ctx.stage_writer else {})       # one replica's stages suffice
    written = []
    if dist.get_rank() == 0:
        merged = {k: v for part in parts for k, v in part.items()}
        written.append(write_opensora(merged.items(), m, out, dtype, metadata))
    dist.barrier()
    return written
