"""train.float8: which tensor-parallel linear layers compute in float8 (parallel/distributed/float8.py says how).

The blocks' ColumnParallelLinear / RowParallelLinear layers whose local shard has in and out features that are
multiples of 16 (torch._scaled_mm's alignment; a shard, not the full layer, is what a rank multiplies); the embed
and final stages (patch embedding, time and text projections, the output projection) stay in the run's precision,
as torchao's recipes keep the first and last layers out. torchao's own auto filter (_auto_filter_for_recipe) also
leaves out layers it finds too small to gain on an H100 (tensorwise: in <= 4096 and out <= 1024); here every
aligned block layer is converted: the user asked for float8, and small layers are what the CPU tests run.
"""
from __future__ import annotations

from torch import nn

from parallel.distributed.float8 import ALIGN, Float8Matmul
from parallel.distributed.layers import ColumnParallelLinear, RowParallelLinear
from parallel.experiment.config import ExperimentConfig
from parallel.model.recompute import layers_of


def local_features(layer: nn.Module) -> tuple[int, int]:
    """(in, out) of this rank's shard of a tensor-parallel linear layer."""
    if isinstance(layer, ColumnParallelLinear):
        return layer.in_features, layer.out_features_per_partition
    return layer.in_features_per_partition, layer.out_features


def eligible(layer: nn.Module) -> bool:
    return isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) and \
        all(n % ALIGN == 0 for n in local_features(layer))


def apply_float8(model: nn.Module, cfg: ExperimentConfig) -> tuple[list[str], list[str]]:
    """Set `float8` on every eligible linear layer of this stage's blocks; (converted, left out) module names,
    block-relative (`3.attn.to_qkv`)."""
    spec = Float8Matmul.build(cfg.train.float8, cfg.train.float8_emulate)
    converted, left = [], []
    for index, block in layers_of(model, cfg):
        for name, module in block.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                (converted if eligible(module) else left).append(f"{index}.{name}")
                if eligible(module):
                    module.float8 = spec
    return converted, left
