"""Write the LoRA adapters of any layout as diffusers' `pytorch_lora_weights.safetensors`.

The adapters are small (2 r (in + out) per adapted layer), so each pipeline stage's first tp and dp rank
gathers its stage's full adapters (tensor-parallel shards over the tp group) and rank 0 writes one file,
with diffusers' keys and the peft config in the header (parallel/lora.py), which
`CogVideoXPipeline.load_lora_weights` and `CogVideoXTransformer3DModel.load_lora_adapter` read.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from torch import nn

from parallel.lora import ADAPTER_PARAMS, LORA_WEIGHTS_NAME, part_rows, peft_metadata, to_diffusers_lora, tp_linears
from parallel.weights.gather import full_tensors


def export_lora(module: nn.Module, ctx, cfg, out: str | Path, value: Optional[Callable] = None,
                zero3: bool = False, metadata: Optional[dict] = None) -> list[Path]:
    """Write out/pytorch_lora_weights.safetensors (fp32) from every rank's adapters; call on every rank.
    `value(param)`: e.g. the adapters' EMA (parallel.train.ema.full_ema)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    m, out = cfg.model, Path(out)
    if m.lora is None:
        raise ValueError("--format diffusers-lora needs a LoRA run (model.lora); this config has none")
    held: dict[str, dict] = {}
    for name, full in full_tensors(module, ctx, m.num_layers, value, zero3):
        layer, _, leaf = name.rpartition(".")
        if leaf in ADAPTER_PARAMS:
            held.setdefault(layer, {})[leaf] = full
    local = {}
    if ctx.stage_writer:
        rows = {name: part_rows(layer) for name, layer in tp_linears(module, m.num_layers)}
        for layer, ab in held.items():
            local.update(to_diffusers_lora(layer, ab["lora_A"], ab["lora_B"], m, rows[layer]))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    written = []
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v for part in parts for k, v in sorted(part.items())}
        path = out / LORA_WEIGHTS_NAME
        save_file(tensors, str(path), metadata={**peft_metadata(m), **(metadata or {})})
        written.append(path)
    dist.barrier()
    return written
