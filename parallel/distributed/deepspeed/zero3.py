"""ZeRO-3 parameter attributes, read (not patched; 0.19.8): ZeRO-3 replaces each parameter's data by an
empty placeholder and marks it with `ds_id`; `ds_shape` is its full shape, `ds_tensor` this rank's
partition (the same slice on tensor-parallel peers, whose full tensors are equal).

    relies   deepspeed.runtime.zero.partition_parameters setting param.ds_id, param.ds_shape and
             param.ds_tensor (tests/unit/test_deepspeed_compat.py)
"""
from __future__ import annotations

import torch


def is_partitioned(param: torch.nn.Parameter) -> bool:
    """True for a ZeRO-3 parameter (its data lives in partitions; read it under GatheredParameters)."""
    return hasattr(param, "ds_id")


def full_shape(param: torch.nn.Parameter) -> torch.Size:
    """The parameter's shape as the model declares it (ZeRO-3: `ds_shape`, its data being a placeholder)."""
    return param.ds_shape if hasattr(param, "ds_shape") else param.shape


def local_data(param: torch.nn.Parameter) -> torch.Tensor:
    """What this rank holds of the parameter: its ZeRO-3 partition, else its data."""
    part = getattr(param, "ds_tensor", None)
    return param.data if part is None else part.data
