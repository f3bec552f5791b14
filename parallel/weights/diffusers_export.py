"""Write a model of any layout (its weights or EMA) as a diffusers folder of its family's released class.

The inverse of parallel/weights/diffusers.py's loading, with the same name map: config.json, and
diffusion_pytorch_model.safetensors or shards with diffusion_pytorch_model.safetensors.index.json.
Tensor-parallel shards are gathered one tensor at a time (ZeRO-3 parameters one at a time too), and each
pipeline stage writes its own shards, so no rank holds more than one shard of full tensors.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from models.config import ModelConfig
from parallel.weights.diffusers import (CONFIG_NAME, INDEX_NAME, PIPELINE_INDEX, WEIGHTS_NAME, diffusers_config,
                                        folders, pipeline_index, released_format, stored_name)
from parallel.weights.gather import exporting, full_tensors


def to_diffusers(name: str, full: torch.Tensor, m: ModelConfig) -> dict[str, torch.Tensor]:
    """One full toolkit tensor as its released tensor(s)."""
    shapes = released_format(m).shapes(name, tuple(full.shape), m)
    if len(shapes) == 1:
        (source, shape), = shapes.items()
        return {source: full.reshape(shape).contiguous()}
    rows = [shape[0] for shape in shapes.values()]          # fused parts, not always equal ([q; k; v; MLP])
    return {s: piece.contiguous() for s, piece in zip(shapes, full.split(rows, dim=0))}


def _name_shards(out: Path, shards: list, m: ModelConfig, data) -> list[Path]:
    """Rename one folder's stage shards (in stage order) to diffusers' names, with the index when several, and
    write its config.json; the files written."""
    weight_map, total, result = {}, 0, []
    for k, (tmp, names, nbytes) in enumerate(shards):
        final = WEIGHTS_NAME if len(shards) == 1 else \
            f"diffusion_pytorch_model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(out / tmp, out / final)
        weight_map.update({n: final for n in names})
        total += nbytes
        result.append(out / final)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        result.append(out / INDEX_NAME)
    (out / CONFIG_NAME).write_text(json.dumps(diffusers_config(m, data), indent=2) + "\n")
    return result + [out / CONFIG_NAME]


def export_diffusers(module: nn.Module, ctx, cfg, out: str | Path, value: Optional[Callable] = None,
                     zero3: bool = False, max_shard_bytes: int = 5 * 10**9, dtype=torch.float32,
                     metadata: Optional[dict] = None, merge_lora: bool = False) -> list[Path]:
    """Write this model (or `value(param)`, e.g. its EMA) of experiment `cfg` as a diffusers folder; call on
    every rank.

    Tensor-parallel shards are gathered one tensor at a time; one rank of each pipeline stage
    (`ctx.stage_writer`: data rank 0 over dp and sp, tp rank 0) writes the stage's shards of at most
    max_shard_bytes, and rank 0 names them
    diffusion_pytorch_model-0000k-of-0000n.safetensors with the index (or one file when n = 1) and
    config.json. Returns the files written (on rank 0). With model.lora the base is written, or with
    `merge_lora` the base with the adapters folded in (W + alpha/r B A).
    """
    import torch.distributed as dist
    from safetensors.torch import save_file


    m, out = cfg.model, Path(out)
    # Released-name prefix -> the subfolder it is written to (Wan 2.2 A14B: transformer/, transformer_2/).
    subs = {prefix: out / sub if (sub and prefix) else out for prefix, sub in folders(m).items()}
    writer = ctx.stage_writer
    if dist.get_rank() == 0:
        for folder in subs.values():
            folder.mkdir(parents=True, exist_ok=True)
            for old in folder.glob("diffusion_pytorch_model*.safetensors*"):     # an earlier export's shards
                old.unlink()
    dist.barrier()
    meta = {"format": "pt", **(metadata or {})}
    written = {prefix: [] for prefix in subs}
    shard = {prefix: {} for prefix in subs}
    size = dict.fromkeys(subs, 0)

    def flush(prefix):
        if shard[prefix]:
            path = subs[prefix] / f".stage{ctx.pp_rank}-{len(written[prefix])}.safetensors"
            save_file(shard[prefix], str(path), metadata=meta)
            written[prefix].append((path.name, sorted(shard[prefix]), size[prefix]))
        shard[prefix], size[prefix] = {}, 0

    tensors = exporting(full_tensors(module, ctx, m.num_layers, value, zero3), module, dist.get_rank() == 0)
    if m.lora is not None:
        from parallel.model.lora import merged_tensors
        tensors = merged_tensors(tensors, module, m, merge_lora)
    for name, full in tensors:
        if not writer:
            continue
        for source, t in to_diffusers(name, full, m).items():
            t, stored = t.to(dtype), stored_name(source)
            prefix = source[:len(source) - len(stored)]
            if shard[prefix] and size[prefix] + t.numel() * t.element_size() > max_shard_bytes:
                flush(prefix)
            shard[prefix][stored] = t
            size[prefix] += t.numel() * t.element_size()
    if writer:
        for prefix in subs:
            flush(prefix)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (ctx.pp_rank, written) if writer else None)
    result = []
    if dist.get_rank() == 0:
        for prefix, folder in subs.items():
            result += _name_shards(folder, [s for _, stage in sorted(p for p in parts if p is not None)
                                            for s in stage[prefix]], m, cfg.data)
        index = pipeline_index(m)
        if index is not None:          # several transformers: what routes between them, beside their folders
            (out / PIPELINE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
            result.append(out / PIPELINE_INDEX)
    dist.barrier()
    return result
