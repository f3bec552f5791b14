"""LoRA: which tensor-parallel layers get adapters (`model.lora.targets`), the frozen base, and the adapters
in diffusers' file format (`pytorch_lora_weights.safetensors`) both ways.

Targets are the released model's module names (peft's `target_modules`: `to_q` matches every module whose
dotted name ends in `.to_q`), translated through the family's ReleasedFormat name map (models/spec.py):
CogVideoX's fused `blocks.i.attn.to_qkv` is `transformer_blocks.i.attn1.to_{q,k,v}`, so `to_q` adapts the
q part of it. The adapters themselves live in parallel/distributed/layers.py (`add_lora`); each layer's are drawn
from a generator seeded by (train.seed, its canonical name), so every layout and pipeline stage draws the
same ones.

Checkpoints: DeepSpeed's module state holds the frozen base too, so a run resumes exactly as a full
fine-tune does, without model.init_from; only the adapters reach the optimizer (and its EMA).

diffusers' keys: `transformer.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r] per adapted
module (`transformer.transformer_blocks.0.attn1.to_q.lora_A.weight`), with the peft config (r, lora_alpha,
target_modules) as `lora_adapter_metadata` in the safetensors header, which `load_lora_weights` and
`load_lora_adapter` read. Wan 2.2 A14B with both experts (model.experts.train both): each expert's adapters,
drawn and trained on their own (an expert no sample chose keeps them, parallel/train/optim.py), go to a file
per transformer under its release subfolder, `transformer/` and `transformer_2/`, both with `transformer.`
keys, as WanPipeline loads them (`load_lora_weights(OUT/transformer_2, load_into_transformer_2=True)`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from models.config import ModelConfig
from models.registry import family
from parallel.distributed.layers import ColumnParallelLinear, RowParallelLinear
from parallel.distributed.pipeline import canonical_name
from parallel.distributed.seed import derive_seed

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
METADATA_KEY = "lora_adapter_metadata"
PREFIX = "transformer."
ADAPTER_PARAMS = ("lora_A", "lora_B")


def released_format(m: ModelConfig):
    """The family's name map; LoRA's targets are released module names, so a family needs one."""
    fmt = family(m).formats.released
    if fmt is None:
        raise ValueError(f"model.family={m.family} has no released-weights format (models/spec.py): model.lora's "
                         f"targets are its released module names")
    return fmt.bind(m) if hasattr(fmt, "bind") else fmt     # a name map that depends on the config


def is_adapter(name: str) -> bool:
    return name.rpartition(".")[2] in ADAPTER_PARAMS


def released_modules(fmt, module: str) -> list[str]:
    """The released module names behind one toolkit linear layer, in fused-part order."""
    return [n[:-len(".weight")] for n in fmt.names(f"{module}.weight")]


def matches(released: str, target: str) -> bool:
    """peft's rule for a string target: the whole name, or its dotted tail; the name within its transformer
    (Wan 2.2 A14B's `transformer_2/blocks.0.attn1.to_q` is `blocks.0.attn1.to_q` of transformer_2)."""
    released = released.rpartition("/")[2]
    return released == target or released.endswith("." + target)


def lora_key(released: str, leaf: str) -> str:
    """diffusers' key of one adapter matrix; a released name in a subfolder (`transformer_2/blocks.0...`) keeps
    the folder in front (`transformer_2/transformer.blocks.0...lora_A.weight`): that transformer's own file."""
    folder, _, name = released.rpartition("/")
    return f"{folder + '/' if folder else ''}{PREFIX}{name}.{leaf}.weight"


def split_files(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """diffusers keys (lora_key) -> {subfolder ("" for none): that file's tensors, keys under `transformer.`}."""
    files: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        folder, _, name = key.rpartition("/")
        files.setdefault(folder, {})[name] = t
    return files


def tp_linears(model: nn.Module, num_blocks: int, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """(canonical module name, layer) of every tensor-parallel linear layer: what can take an adapter.
    `prefix`: the canonical name of `model` when it is one stage (`blocks.0.`), not the whole network."""
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            yield (prefix + name if prefix else canonical_name(name, num_blocks)), module


def plan_adapters(model: nn.Module, m: ModelConfig, prefix: str = "") -> tuple[dict[str, list[int]], set[str], list[str]]:
    """Adapted layers -> their adapted parts; targets that matched; every released name that could."""
    fmt, lora = released_format(m), m.lora
    plan, hit, names = {}, set(), []
    for module, layer in tp_linears(model, m.num_layers, prefix):
        released = released_modules(fmt, module)
        names += released
        parts = [j for j, r in enumerate(released) if any(matches(r, t) for t in lora.targets)]
        hit |= {t for r in released for t in lora.targets if matches(r, t)}
        if parts:
            plan[module] = parts
    return plan, hit, names


def apply_lora(model: nn.Module, m: ModelConfig, seed: int, prefix: str = "") -> int:
    """Freeze every parameter and add the adapters model.lora names; returns the adapter parameter count
    this rank holds. `prefix`: see tp_linears (the planner's tracer adapts one stage)."""
    for p in model.parameters():
        p.requires_grad_(False)
    plan, _, _ = plan_adapters(model, m, prefix)
    lora, count = m.lora, 0
    for module, layer in tp_linears(model, m.num_layers, prefix):
        if module not in plan:
            continue
        generator = torch.Generator().manual_seed(derive_seed(seed, "lora", module))
        alpha = lora.scaling * lora.rank
        if isinstance(layer, ColumnParallelLinear):
            layer.add_lora(lora.rank, alpha, plan[module], generator, lora.dropout)
        else:
            layer.add_lora(lora.rank, alpha, generator, lora.dropout)
        count += layer.lora_A.numel() + layer.lora_B.numel()
    for name, stage in model.named_modules():
        if canonical_name(f"{name}.weight", m.num_layers) == "embed.weight":       # pipeline: module "0"
            stage.register_forward_hook(_outputs_need_grad)
    return count


def apply_fp8_base(model: nn.Module, m: ModelConfig, prefix: str = "") -> int:
    """model.lora.base_dtype: every tensor-parallel linear weight (all frozen, adapted or not) stored as fp8
    with one fp32 scale per tensor, each tp rank's shard scaled by itself (parallel/distributed/layers.py).
    After the base and adapters are loaded, before deepspeed.initialize. Returns the fp8 elements."""
    if m.lora is None or m.lora.base_dtype is None:
        return 0
    count = 0
    for _, layer in tp_linears(model, m.num_layers, prefix):
        layer.quantise_base()
        count += layer.weight.numel()
    return count


def _outputs_need_grad(module, inputs, outputs):
    """The embed stage's outputs, computed from frozen weights only, marked as requiring a gradient: a
    reentrant activation checkpoint whose inputs need none returns outputs without a graph (the adapters
    inside would get no gradient), and DeepSpeed's pipeline backpropagates into every stage output."""
    return tuple(t.requires_grad_() if t.is_floating_point() and not t.requires_grad else t for t in outputs)


def _module_parts(m: ModelConfig, module: str) -> tuple[list[str], list[int]]:
    released = released_modules(released_format(m), module)
    return released, [j for j, r in enumerate(released) if any(matches(r, t) for t in m.lora.targets)]


def part_rows(layer: nn.Module) -> list[int]:
    """Full output rows of each fused part of a layer (one part: all of them)."""
    return list(getattr(layer, "parts", [layer.out_features]))


def to_diffusers_lora(module: str, a: torch.Tensor, b: torch.Tensor, m: ModelConfig, rows: list[int]
                      ) -> dict[str, torch.Tensor]:
    """One layer's full adapters (A [k r, in], B [rows of the k adapted parts, r]) as diffusers' keys;
    `rows`: part_rows of the layer."""
    released, parts = _module_parts(m, module)
    r = m.lora.rank
    b_parts = b.split([rows[j] for j in parts])
    out = {}
    for k, j in enumerate(parts):
        out[lora_key(released[j], "lora_A")] = a[k * r:(k + 1) * r].contiguous()
        out[lora_key(released[j], "lora_B")] = b_parts[k].contiguous()
    return out


def _merge(module: str, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, m: ModelConfig, sizes: list[int]
           ) -> torch.Tensor:
    """W + s B A for the full weight of one layer, part by part (fused QKV: each adapted part's rows)."""
    _, parts = _module_parts(m, module)
    rows = list(weight.split(sizes))
    r, b_parts = m.lora.rank, b.split([sizes[j] for j in parts])
    for k, j in enumerate(parts):
        rows[j] = rows[j] + m.lora.scaling * (b_parts[k].double() @ a[k * r:(k + 1) * r].double()).to(weight.dtype)
    return torch.cat(rows)


def merged_tensors(tensors: Iterator[tuple[str, torch.Tensor]], model: nn.Module, m: ModelConfig, merge: bool
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Full (canonical name, tensor) pairs of the base: adapters dropped, or (merge) folded into their weights."""
    adapted = {name: part_rows(layer) for name, layer in tp_linears(model, m.num_layers) if layer.lora_A is not None}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        module, _, leaf = name.rpartition(".")
        if module not in adapted or leaf not in ADAPTER_PARAMS + ("weight",):
            yield name, t
        elif not merge:
            if leaf == "weight":
                yield name, t
        else:                                    # held until A, B and the weight have all arrived
            held = pending.setdefault(module, {})
            held[leaf] = t
            if len(held) == 3:
                merged = _merge(module, held.pop("weight"), held["lora_A"], held["lora_B"], m, adapted[module])
                yield f"{module}.weight", merged
                del pending[module]


def peft_metadata(m: ModelConfig) -> dict[str, str]:
    """safetensors header: the peft LoraConfig diffusers builds the adapter from (keys under `transformer.`)."""
    config = {"r": m.lora.rank, "lora_alpha": m.lora.alpha or m.lora.rank, "target_modules": sorted(m.lora.targets),
              "lora_dropout": m.lora.dropout}
    return {"format": "pt", METADATA_KEY: json.dumps({PREFIX + k: v for k, v in config.items()}, sort_keys=True)}


def lora_file(path: str | Path) -> Path:
    path = Path(path)
    return path / LORA_WEIGHTS_NAME if path.is_dir() else path


@torch.no_grad()
def load_lora(model: nn.Module, ctx, m: ModelConfig, path: str | Path) -> int:
    """Copy a diffusers LoRA file's adapters into this rank's shards (before deepspeed.initialize); raises
    ValueError naming missing or mis-shaped keys. Returns the elements read."""
    from safetensors.torch import load_file
    path = lora_file(path)
    if not path.is_file():
        raise ValueError(f"model.lora.init_from={path}: no such file (a {LORA_WEIGHTS_NAME}, or a folder with one)")
    tensors = load_file(str(path))
    problems, read = [], 0
    for module, layer in tp_linears(model, m.num_layers):
        if layer.lora_A is None:
            continue
        released, parts = _module_parts(m, module)
        keys = [(lora_key(released[j], "lora_A"), lora_key(released[j], "lora_B")) for j in parts]
        absent = [k for pair in keys for k in pair if k not in tensors]
        if absent:
            problems.append(f"{path}: missing {', '.join(absent)}")
            continue
        a = torch.cat([tensors[ka] for ka, _ in keys])                  # [k r, in]
        b = torch.cat([_rows(tensors[kb], layer, k) for k, (_, kb) in enumerate(keys)])
        if isinstance(layer, RowParallelLinear):                           # this rank's columns of A
            n = layer.in_features_per_partition
            a = a[:, ctx.tp_rank * n:(ctx.tp_rank + 1) * n]
        if a.shape != layer.lora_A.shape or b.shape != layer.lora_B.shape:
            problems.append(f"{path}: {module}'s adapters are {list(a.shape)} / {list(b.shape)}, this rank expects "
                            f"{list(layer.lora_A.shape)} / {list(layer.lora_B.shape)} (model.lora.rank="
                            f"{m.lora.rank})")
            continue
        layer.lora_A.copy_(a)
        layer.lora_B.copy_(b)
        read += a.numel() + b.numel()
    if problems:
        raise ValueError("\n".join(problems))
    return read


def _rows(b: torch.Tensor, layer: nn.Module, k: int) -> torch.Tensor:
    """This tp rank's rows of a column-parallel layer's k-th adapted part (the whole B when row-parallel)."""
    if not isinstance(layer, ColumnParallelLinear):
        return b
    n, r = layer.lora_B.tp_parts[k], layer.ctx.tp_rank
    return b[r * n:(r + 1) * n]
