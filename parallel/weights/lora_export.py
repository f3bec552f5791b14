"""Write the LoRA adapters of any layout as diffusers' `pytorch_lora_weights.safetensors`.

The adapters are small (2 r (in + out) per adapted layer), so each pipeline stage's first tp and dp rank
gathers its stage's full adapters (tensor-parallel shards over the tp group) and rank 0 writes one file,
with diffusers' keys and the peft config in the header (parallel/model/lora.py), which
`CogVideoXPipeline.load_lora_weights` and `CogVideoXTransformer3DModel.load_lora_adapter` read. Wan 2.2 A14B
with both experts: out/transformer/ and out/transformer_2/ hold one such file each (parallel/model/lora.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from parallel.model.lora import (ADAPTER_PARAMS, LORA_WEIGHTS_NAME, part_rows, peft_metadata, split_files,
                                 to_diffusers_lora, tp_linears)
from parallel.weights.gather import full_tensors


def export_lora(module: nn.Module, ctx, cfg, out: str | Path, value: Optional[Callable] = None,
                zero3: bool = False, metadata: Optional[dict] = None) -> list[Path]:
    """Write out/pytorch_lora_weights.safetensors (fp32) from every rank's adapters; call on every rank.
    `value(param)`: e.g. the adapters' EMA (parallel.weights.ema.full_ema)."""
    import torch.distributed as dist

    m = cfg.model
    if m.lora is None:
        raise ValueError("--format diffusers-lora needs a LoRA run (model.lora); this config has none")
    local = lora_tensors(module, ctx, m, value, zero3)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local if ctx.stage_writer else {})
    written = []
    if dist.get_rank() == 0:
        written = write_lora({k: v for part in parts for k, v in part.items()}, out, m, metadata)
    dist.barrier()
    return written


def lora_tensors(module: nn.Module, ctx, m, value: Optional[Callable] = None, zero3: bool = False
                 ) -> dict[str, torch.Tensor]:
    """This rank's stage's full adapters under diffusers' keys (parallel/model/lora.py lora_key); every tp rank of
    the stage takes part (the gather), the stage writer's result is the one to keep."""
    held: dict[str, dict] = {}
    for name, full in full_tensors(module, ctx, m.num_layers, value, zero3):
        layer, _, leaf = name.rpartition(".")
        if leaf in ADAPTER_PARAMS:
            held.setdefault(layer, {})[leaf] = full
    rows = {name: part_rows(layer) for name, layer in tp_linears(module, m.num_layers)}
    local = {}
    for layer, ab in held.items():
        local.update(to_diffusers_lora(layer, ab["lora_A"], ab["lora_B"], m, rows[layer]))
    return local


def write_lora(tensors: dict[str, torch.Tensor], out: str | Path, m, metadata: Optional[dict] = None) -> list[Path]:
    """out/pytorch_lora_weights.safetensors with the peft config in the header; Wan 2.2 A14B with both experts:
    out/transformer/ and out/transformer_2/ one each (the keys' folders)."""
    from safetensors.torch import save_file

    written = []
    for folder, file in sorted(split_files(tensors).items()):
        path = Path(out) / folder / LORA_WEIGHTS_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(dict(sorted(file.items())), str(path), metadata={**peft_metadata(m), **(metadata or {})})
        written.append(path)
    return written
