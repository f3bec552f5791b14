"""Float8 matmuls for the tensor-parallel linear layers (train.float8): torchao's casts and float8 gemm, with each
per-tensor scale taken over the full, unsharded tensor.

torchao's tensorwise recipe (`Float8LinearConfig.from_recipe_name("tensorwise")`) computes, for Y = X W^T,

    s_t = 448 / amax|t|  (e4m3: X, W)   or   57344 / amax|t|  (e5m2: dY)      one fp32 scale per tensor
    Y  = (fp8(s_X X) fp8(s_W W)^T) / (s_X s_W)
    dX = (fp8(s_dY dY) fp8(s_W W)) / (s_dY s_W)         dW = (fp8(s_dY dY)^T fp8(s_X X)) / (s_dY s_X)

with the float8 gemm `torch._scaled_mm` (emulate: dequantised and multiplied in high precision: the same casts,
slow). Its `Float8Linear` is an nn.Linear swap; the toolkit's layers are not nn.Linear and hold shards, so
`Float8Matmul` below is the thin autograd Function of that recipe, calling torchao for every cast
(`tensor_to_amax`, `amax_to_scale`, `hp_tensor_and_scale_to_float8`) and for the gemm (`torch.mm` on its
Float8TrainingTensor dispatches to its scaled mm).

The scaling rule: amax is a MAX over every element of the unsharded tensor, so an amax of a shard is all-reduced
(MAX) over the ranks that hold the other shards, and tp = p (and sp = q) quantise exactly as tp = 1 does:

    tensor        column layer (W split along out)      row layer (W split along in)
    W             tp                                    tp
    X             sp (replicated over tp)               tp, sp (X split along in)
    dY            tp, sp (split along out)              sp (replicated over tp: y was all-reduced)

Sequence parallelism splits tokens, not features: X and dY of a rank are its tokens' rows, so their amax spans the
sp group too (else sp = 2 would scale each half of the sequence on its own). Exact when sp divides the token count:
sp's padding rows (parallel.distributed.sequence) are inputs no sp = 1 run has. Pipeline stages hold different
layers: nothing to reduce. Data-parallel ranks hold different samples: their amax is not reduced, as torchao does
not for tensorwise; a dp = 2 run's scales are each rank's micro-batch's (as two dp = 1 runs on those micro-batches
would have), so equivalence across layouts is exact at equal dp.

Per layer and step: forward one all-reduce of the two amaxes [X, W] over tp and one over sp, backward one of dY's
(over tp for a column layer, over sp), each of 2 or 1 fp32 scalars on the compute device (NCCL/HCCL carry no CPU
tensors); none where the group has one rank. X's and W's amax are kept for backward, not reduced again; W is
re-cast there from its high-precision copy (torchao's default: it saves X and W in high precision, as F.linear
does, so the saved bytes are the unquantised layer's). A checkpointed block's recomputed forward recomputes the
same amaxes from the same inputs.

torchao is imported only here, and this module only when train.float8 is set.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from parallel.distributed.comm import all_reduce_max

TORCHAO_PIN = "torchao==0.18.0"
RECIPES = ("tensorwise",)
ALIGN = 16          # the float8 gemm's dims (torch._scaled_mm): in and out features multiples of 16


def torchao_problem() -> Optional[str]:
    """Why torchao's float8 training cannot be imported here, or None."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:      # ImportError, or a torchao built for another torch failing inside its import
        return f"{type(e).__name__}: {e}"
    return None


@dataclass(frozen=True)
class Float8Matmul:
    """torchao's config of one recipe and its gemm settings (a layer's `float8`); `linear` is the layer's x W^T + b."""

    config: object              # torchao.float8.Float8LinearConfig
    mm_config: object           # torchao.float8.LinearMMConfig: output, grad_input, grad_weight gemms

    @classmethod
    def build(cls, recipe: str = "tensorwise", emulate: bool = False) -> "Float8Matmul":
        """As torchao's Float8Linear builds them (float8_linear.py), for `recipe` (tensorwise only), but for the
        weight-gradient gemm's inner dimension, padded with zeros to a multiple of 16 (torchao's pad_inner_dim,
        the same sums): it is the token count (dW = dY^T X), which CUDA's torch._scaled_mm needs to be one (Wan at
        81 x 480 x 832 has 32,760 tokens) and the layer filter cannot choose; the other two are the layer's in
        and out features, multiples of 16 by that filter (parallel/model/float8.py)."""
        import dataclasses

        from torchao.float8 import Float8LinearConfig, LinearMMConfig, ScaledMMConfig
        if recipe not in RECIPES:
            raise ValueError(f"float8 recipe {recipe!r}: the tensor-parallel layers implement {', '.join(RECIPES)}")
        c = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
        mm = LinearMMConfig(*(ScaledMMConfig(emulate, g.use_fast_accum, False, pad) for g, pad in
                              ((c.gemm_config_output, c.pad_inner_dim), (c.gemm_config_grad_input, c.pad_inner_dim),
                               (c.gemm_config_grad_weight, True))))
        return cls(c, mm)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], ctx,
               grad_output_sharded: bool) -> torch.Tensor:
        """x W^T (+ b): W this rank's shard, x (..., in_local), the amax groups by the module docstring's table
        (grad_output_sharded: a column layer's dY, split along out over tp)."""
        tp, sp = _group(ctx, "tp"), _group(ctx, "sp")
        y = _Float8Linear.apply(x, weight, self, tp, sp, grad_output_sharded)
        return y if bias is None else y + bias.to(y.dtype)


def _group(ctx, axis: str):
    """The process group of `axis` when it has ranks to reduce over; None for one rank or a planning context."""
    size, group = getattr(ctx, f"{axis}_size", 1), getattr(ctx, f"{axis}_group", None)
    return group if size > 1 and group is not None else None


def _reduced_amax(tensors: list[torch.Tensor], groups: list) -> torch.Tensor:
    """[amax|t| for t in tensors] as one fp32 tensor, each the MAX over `groups` (its shards' ranks)."""
    from torchao.float8.float8_utils import tensor_to_amax
    amax = torch.stack([tensor_to_amax(t).float() for t in tensors])    # fp32 holds every bf16/fp16 amax exactly
    for group in groups:
        if group is not None and dist.is_initialized():
            amax = all_reduce_max(amax, group)
    return amax


def _cast(t: torch.Tensor, amax: torch.Tensor, cast_config, mm_config, role, round_pow2: bool):
    """torchao's dynamic cast (hp_tensor_to_float8_dynamic) with the given, reduced amax."""
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale
    scale = amax_to_scale(amax, cast_config.target_dtype, round_scales_to_power_of_2=round_pow2)
    return hp_tensor_and_scale_to_float8(t, scale, cast_config.target_dtype, mm_config, role)


class _Float8Linear(torch.autograd.Function):
    """torchao's matmul_with_hp_or_float8_args for the tensorwise recipe, with the amaxes all-reduced."""

    @staticmethod
    def forward(ctx, x, weight, spec: Float8Matmul, tp, sp, grad_output_sharded: bool):
        from torchao.float8.float8_training_tensor import GemmInputRole
        c = spec.config
        amax = _reduced_amax([x, weight], [tp, sp])                     # [X, W]
        ctx.save_for_backward(x, weight, amax)
        ctx.spec, ctx.groups = spec, ([tp] if grad_output_sharded else []) + [sp]
        x8 = _cast(x, amax[0], c.cast_config_input, spec.mm_config, GemmInputRole.INPUT,
                   c.round_scales_to_power_of_2)
        w8_t = _cast(weight.t(), amax[1], c.cast_config_weight, spec.mm_config, GemmInputRole.WEIGHT,
                     c.round_scales_to_power_of_2)
        y = torch.mm(x8.reshape(-1, x.shape[-1]), w8_t)                 # (tokens, out_local)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        from torchao.float8.float8_training_tensor import GemmInputRole as Role
        x, weight, amax = ctx.saved_tensors
        spec, c = ctx.spec, ctx.spec.config
        pow2, mm = c.round_scales_to_power_of_2, spec.mm_config
        dy = grad_output.reshape(-1, grad_output.shape[-1])            # (tokens, out_local)
        dy_amax = _reduced_amax([dy], ctx.groups)[0]
        dy8 = _cast(dy, dy_amax, c.cast_config_grad_output, mm, Role.GRAD_OUTPUT, pow2)
        w8_t = _cast(weight.t(), amax[1], c.cast_config_weight_for_grad_input, mm, Role.WEIGHT, pow2)
        dx = torch.mm(dy8, w8_t.t()).reshape(*grad_output.shape[:-1], weight.shape[1])
        dy8_w = _cast(dy, dy_amax, c.cast_config_grad_output_for_grad_weight, mm, Role.GRAD_OUTPUT, pow2)
        x8_w = _cast(x.reshape(-1, x.shape[-1]), amax[0], c.cast_config_input_for_grad_weight, mm, Role.INPUT,
                     pow2)
        dw = torch.mm(dy8_w.t(), x8_w)                                   # (out_local, in_local)
        return dx, dw, None, None, None, None
