"""Megatron-style tensor-parallel linear layers.

For Y = X W^T + b with W of shape [out, in] and a tp group of size p:

    ColumnParallelLinear  W = [W_1; ...; W_p] split along out (dim 0); rank i computes Y_i = X W_i^T + b_i.
                          Input: replicated X (its gradient is all-reduced). Output: Y_i, or all of Y
                          with gather_output=True.
    RowParallelLinear     W = [W_1 ... W_p] split along in (dim 1); rank i computes X_i W_i^T, the
                          partial sums are all-reduced, then b (replicated) is added once.

A Column -> Row pair (attention QKV -> out, MLP in -> out) thus costs one all-reduce forward and one
backward. Weights are initialised on the full [out, in] shape from the current RNG state and sliced,
so for the same seed the shards of tp=p concatenate to exactly the tp=1 weight. Sharded parameters
carry `tensor_model_parallel=True` and `partition_dim`, which DeepSpeed's gradient-norm code reads.

LoRA (`add_lora`, parallel/model/lora.py decides where): y = x W^T + b + s (x A^T) B^T, A [r, in], B [out, r],
s = alpha / r, split so that the adapter adds no collective (the adapter's r-wide activation u rides on
the layer's existing all-reduce, concatenated to it along the last dim):

    column  B = [B_1; ...; B_p] split like W's rows, A replicated. u = x A^T is the same on every rank;
            rank i adds s u B_i^T. Backward: du = s dy_i B_i is a partial sum over ranks, like dx, so
            [x, u] passes copy_to_tp together: its one all-reduce (of b x s x (in + r)) sums dx and du,
            and dA = du^T x is then the full, replicated gradient. (Adding u to the layer after
            copy_to_tp instead would leave dA partial: an extra all-reduce of A's gradient.)
    row     A = [A_1 ... A_p] split like W's columns, B replicated. u_i = x_i A_i^T is a partial sum;
            [x_i W_i^T, u_i] is all-reduced together (b x s x (out + r)), then s u B^T is added once.
            du = s dy B is full on every rank and dB = s dy^T u is full too. (Adding s u_i B^T before
            the all-reduce instead would leave dB partial: an extra all-reduce of B's gradient.)

Dropout on the adapter's input (model.lora.dropout): the tp ranks' generators agree (parallel/distributed/seed.py
training_seed), so the column layer's replicated x is dropped alike on every rank; the row layer's x_i is a shard
of x, and `ShardDropout` draws the mask of the full x there and keeps rank i's columns, so tp = p drops what tp = 1
drops (one shard's draw on each rank would repeat one pattern p times along the features).

Fused column layers (QKV) get one adapter per part, as peft puts one on each of to_q, to_k, to_v. The
adapters start as peft's (A kaiming-uniform a=sqrt(5), B zero), drawn full from a generator and sliced,
so every layout starts from the tp = 1 adapters.

fp8 base (`quantise_base`, model.lora.base_dtype): the frozen W becomes a float8_e4m3fn buffer `weight` and an
fp32 buffer `weight_scale` s = amax|W| / 448 over the full, unsharded W (the shards' amax all-reduced, MAX, over the
tp group), so rank i holds W8_i = fp8(W_i / s), the slice of tp = 1's W8, and every tp rank the same s: tp = p
quantises as tp = 1 does, and a checkpoint's fp8 shards re-cut for another tp keep their scale
(parallel/checkpoints/relayout.py). The forward uses W_i ~ W8_i s, dequantised to the input's dtype (no fp8 matmul).
Buffers: no gradient, no optimizer state, not cast by DeepSpeed (it casts parameters); a device move re-makes them
without the tensor-parallel marks, so the layer keeps the weight's (`tp_marks`).

Float8 (`float8`, train.float8): x W^T through torchao's float8 casts and gemm, each per-tensor scale over the full
tensor (its amax all-reduced over the ranks holding the other shards: parallel/distributed/float8.py), so tp = p
quantises as tp = 1 does; parallel/model/float8.py picks the layers.

Block swap (`host_base`, train.block_swap): the frozen W (or fp8 W and scale) in host memory, `base_linear`
fetching it for each use (parallel/distributed/block_swap.py).

Skipped init (`skip_init`): layers built inside it hold torch.empty W and b, no full fp32 tensor drawn and sliced
(every tp rank draws the whole W of each layer to keep its slice: on one CPU thread Wan 2.1 1.3B builds in 11.4 s
with the draws, in 0.14 s without, bench/init_skip.py), for callers that overwrite every one: model.init_from, whose
readers refuse a release that lacks any tensor before reading one, and a resume, whose checkpoint load writes every
parameter and buffer (parallel/train/engine.py overwrites_init). The adapters (add_lora) draw from their own
generator and are never skipped.
"""
from __future__ import annotations

import contextlib
import math
from contextvars import ContextVar
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from parallel.distributed.comm import all_reduce_max, copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp

InitFn = Callable[[torch.Tensor], None]
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max                                   # 448
TP_MARKS = ("tensor_model_parallel", "partition_dim", "tp_parts")   # how a tensor's shard sits in the full one

# Inside skip_init: what each skipped W and b gets instead of its init (nothing, or a test's fill); None outside.
_SKIPPED: ContextVar[Optional[InitFn]] = ContextVar("skip_init", default=None)


@contextlib.contextmanager
def skip_init(fill: Optional[float] = None):
    """Tensor-parallel layers built inside hold uninitialised (torch.empty) weights and biases: no RNG draw, no full
    fp32 tensor. Only for a model whose every parameter is overwritten next (model.init_from, a checkpoint resumed:
    parallel/train/engine.py build_trainer, parallel/train/sampling.py sampling_model). `fill`: written into them
    instead, so a test sees (NaN) a tensor that nothing overwrote."""
    token = _SKIPPED.set((lambda t: None) if fill is None else (lambda t: t.fill_(fill)))
    try:
        yield
    finally:
        _SKIPPED.reset(token)


def quantise_fp8(w: torch.Tensor, amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8(w / s), s) with one fp32 scale s = amax / 448 (1 for an all-zero w); `amax`: amax|w| unless given (the
    full tensor's, where w is a shard of it)."""
    amax = w.detach().abs().amax().float() if amax is None else amax
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w.detach().float() / scale).to(FP8), scale


def dequantise_fp8(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w8 s in fp32, then rounded once to `dtype`."""
    return (w8.float() * scale).to(dtype)


def default_weight_init(weight: torch.Tensor) -> None:
    """nn.Linear's initialisation (kaiming uniform, a=sqrt(5)) on the full, unsharded weight."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def _default_bias_init(bias: torch.Tensor, fan_in: int) -> None:
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    nn.init.uniform_(bias, -bound, bound)


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim


def own_marks(t: torch.Tensor) -> dict:
    """The tensor-parallel marks (TP_MARKS) set on `t` itself; {} for a replicated tensor or a re-made buffer."""
    return {k: getattr(t, k) for k in TP_MARKS if hasattr(t, k)}


def tp_marks(module: nn.Module, leaf: str) -> dict:
    """The tensor-parallel marks (TP_MARKS) of `module`'s tensor `leaf`: the tensor's own, else those the layer
    recorded for it (the fp8 base's `weight`, a buffer that a device move re-makes without attributes); {} for a
    replicated tensor."""
    return own_marks(getattr(module, leaf)) or getattr(module, "buffer_marks", {}).get(leaf, {})


def marked_buffers(module: nn.Module):
    """(dotted name, buffer, tp_marks) of every buffer (the fp8 base's weight and scale, a family's stored tables), in
    named_buffers' order."""
    for prefix, owner in module.named_modules():
        for leaf, b in owner.named_buffers(recurse=False):
            yield f"{prefix}.{leaf}" if prefix else leaf, b, tp_marks(owner, leaf)


def _divide(n: int, p: int, what: str) -> int:
    if n % p:
        raise ValueError(f"{what}={n} is not divisible by tp_size={p}")
    return n // p


def _full_init(shape: tuple[int, ...], init: InitFn, device, dtype) -> Optional[torch.Tensor]:
    """The unsharded tensor initialised by `init`, or None (the layer then takes `_uninitialised`) on the meta
    device (shapes only) and inside skip_init."""
    if _SKIPPED.get() is not None or torch.device(device or torch.get_default_device()).type == "meta":
        return None
    full = torch.empty(shape, dtype=torch.float32, device=device)
    init(full)
    return full.to(dtype) if dtype is not None else full


def _uninitialised(shape: tuple[int, ...], device, dtype) -> torch.Tensor:
    """The local tensor where `_full_init` gave None: torch.empty, with skip_init's fill where one is given."""
    t = torch.empty(shape, device=device, dtype=dtype)
    fill = _SKIPPED.get()
    if fill is not None:
        fill(t)
    return t


def _lora_a(shape: tuple[int, int], generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """peft's A: kaiming-uniform (a=sqrt(5)) of the full [r, in], from `generator` only."""
    full = torch.empty(shape, dtype=torch.float32)
    if like.device.type != "meta":
        nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
    return full


class ShardDropout(nn.Dropout):
    """Dropout of a row-parallel adapter's input shard x_i [..., in / p] (parts concatenated, as the weight's columns).

    Every tp rank draws the mask of the full [..., in] from its generator, which the tp ranks share, and keeps its
    columns of each part: the p shards are dropped by one full mask, the one tp = 1 draws in its place (bit for bit
    on CPU, where dropout is x * bernoulli / (1 - p); on a device the fused kernel may map the draws to other entries,
    the same in distribution). The cost: p times the random numbers, drawn only at tp > 1 in training; at tp 1 it is
    nn.Dropout."""

    def __init__(self, p: float, parts: Sequence[int], ctx):
        super().__init__(p)
        self.parts, self.ctx = list(parts), ctx             # this rank's columns of each part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp, r = self.ctx.tp_size, self.ctx.tp_rank
        if tp == 1 or not self.training:
            return super().forward(x)
        scale = F.dropout(x.new_ones(*x.shape[:-1], sum(self.parts) * tp), self.p)  # (..., in): 0 or 1 / (1 - p)
        mine = torch.cat([piece[..., r * n:(r + 1) * n]
                          for piece, n in zip(scale.split([n * tp for n in self.parts], -1), self.parts)], -1)
        return x * mine                                                             # (..., in / p)


class _Lora(nn.Module):
    """What both layers share: no adapter until `add_lora`; the dropout on the adapter's input."""

    def __init__(self):
        super().__init__()
        self.register_parameter("lora_A", None)
        self.register_parameter("lora_B", None)
        self.register_buffer("weight_scale", None)
        self.host_base = None     # block swap: (BlockSwap, block, layer) while the base lives in host memory
        self.float8 = None        # train.float8: a Float8Matmul (parallel/distributed/float8.py) for x W^T

    def quantise_base(self) -> None:
        """The frozen weight as fp8 + one scale over the full weight (module docstring): a MAX all-reduce of one fp32
        scalar over the tp group where the weight is split, so every tp rank calls it, layer by layer in the same
        order. After the adapters and weights exist."""
        w = self.weight
        if w.requires_grad:
            raise ValueError("an fp8 base must be frozen (model.lora freezes it)")
        attrs = own_marks(w)
        amax = w.detach().abs().amax().float()
        if attrs.get("tensor_model_parallel") and self.ctx.tp_size > 1 and self.ctx.tp_group is not None:
            amax = all_reduce_max(amax, self.ctx.tp_group)       # (none in a planning context: no process group)
        w8, scale = quantise_fp8(w, amax)
        del self.weight
        self.register_buffer("weight", w8)
        self.register_buffer("weight_scale", scale)
        self.buffer_marks = {"weight": attrs}
        for k, v in attrs.items():
            setattr(self.weight, k, v)

    def base_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W (this rank's shard) for the matmul: the parameter, or the fp8 base dequantised to `dtype`."""
        if self.weight_scale is None:
            return self.weight
        return dequantise_fp8(self.weight, self.weight_scale, dtype)

    def base_linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x W^T + b with this rank's base W: the parameter, the fp8 base dequantised, or (block swap) W fetched
        from host memory for the call (parallel/distributed/block_swap.py)."""
        if self.host_base is not None:
            swap, block, layer = self.host_base
            return swap.linear(x, bias, block, layer)
        if self.float8 is not None:
            return self.float8.linear(x, self.weight, bias, self.ctx, isinstance(self, ColumnParallelLinear))
        return F.linear(x, self.base_weight(x.dtype), bias)

    def _lora_setup(self, rank: int, alpha: float, dropout: float, a: torch.Tensor, b: torch.Tensor) -> None:
        like = self.weight
        self.lora_rank, self.lora_scaling = rank, alpha / rank
        self.lora_A = nn.Parameter(a.to(device=like.device, dtype=like.dtype))
        self.lora_B = nn.Parameter(b.to(device=like.device, dtype=like.dtype))
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()


class ColumnParallelLinear(_Lora):
    """Linear layer split along its output features; `out_features` may be a list of fused outputs.

    With `out_features=[d_q, d_k, d_v]` each part is split separately and rank i holds
    [Wq_i; Wk_i; Wv_i], so one layer (one input all-reduce in backward) serves Q, K and V.
    """

    def __init__(self, in_features: int, out_features: Union[int, Sequence[int]], *, ctx, bias: bool = True,
                 gather_output: bool = False, init_method: InitFn = default_weight_init,
                 device=None, dtype=None):
        super().__init__()
        parts = [out_features] if isinstance(out_features, int) else list(out_features)
        if gather_output and len(parts) > 1:
            raise ValueError("gather_output=True needs a single output part")
        self.ctx, self.in_features, self.parts = ctx, in_features, parts
        self.out_features = sum(parts)
        self.gather_output = gather_output
        p, r = ctx.tp_size, ctx.tp_rank
        local = [_divide(n, p, "out_features") for n in parts]
        self.out_features_per_partition = sum(local)

        full_w = _full_init((self.out_features, in_features), init_method, device, dtype)
        full_b = _full_init((self.out_features,), lambda b: _default_bias_init(b, in_features), device, dtype) \
            if bias else None
        self.weight = nn.Parameter(self._shard(full_w, parts, local, r, (self.out_features_per_partition, in_features),
                                               device, dtype))
        mark_tensor_parallel(self.weight, 0)
        self.weight.tp_parts = self.local_parts = local      # on the module too: a moved fp8 buffer loses attributes
        if bias:
            self.bias = nn.Parameter(self._shard(full_b, parts, local, r, (self.out_features_per_partition,),
                                                 device, dtype))
            mark_tensor_parallel(self.bias, 0)
            self.bias.tp_parts = local
        else:
            self.register_parameter("bias", None)

    @staticmethod
    def _shard(full, parts, local, rank, shape, device, dtype):
        if full is None:
            return _uninitialised(shape, device, dtype)
        pieces = full.split(parts, dim=0)
        return torch.cat([piece[rank * n:(rank + 1) * n] for piece, n in zip(pieces, local)]).clone()

    def add_lora(self, rank: int, alpha: float, parts: Sequence[int], generator: torch.Generator,
                 dropout: float = 0.0) -> None:
        """Adapters on the fused parts `parts` (indices into out_features' list): A [len(parts) r, in]
        replicated (part j's rows j r ..), B [sum of those parts' local rows, r] split like the weight."""
        if self.gather_output:
            raise ValueError("LoRA on a ColumnParallelLinear with gather_output=True is not supported")
        local = [self.weight.tp_parts[j] for j in parts]
        a = _lora_a((len(parts) * rank, self.in_features), generator, self.weight)
        self._lora_setup(rank, alpha, dropout, a, torch.zeros(sum(local), rank))   # B = 0: slices of zeros
        mark_tensor_parallel(self.lora_B, 0)
        self.lora_B.tp_parts, self.lora_parts = local, tuple(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_A is None:
            x = copy_to_tp(x, self.ctx)                          # (..., in)
            y = self.base_linear(x, self.bias)                   # (..., out / p)
            return gather_from_tp(y, self.ctx) if self.gather_output else y
        u = F.linear(self.lora_dropout(x), self.lora_A)          # (..., k r), the same on every tp rank
        if self.ctx.tp_size > 1:                                 # one backward all-reduce for dx and du
            x, u = copy_to_tp(torch.cat([x, u], dim=-1), self.ctx).split([self.in_features, u.shape[-1]], -1)
        y = self.base_linear(x, self.bias)                       # (..., out / p)
        local = self.local_parts
        pieces = list(y.split(local, dim=-1))
        for u_j, b_j, j in zip(u.chunk(len(self.lora_parts), -1), self.lora_B.split(self.lora_B.tp_parts),
                               self.lora_parts):
            pieces[j] = pieces[j] + F.linear(u_j, b_j) * self.lora_scaling   # (..., out_j / p)
        return torch.cat(pieces, dim=-1)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} ({'+'.join(map(str, self.parts))}), "
                f"tp={self.ctx.tp_size}, local_out={self.out_features_per_partition}")


class RowParallelLinear(_Lora):
    """Linear layer split along its input features; the output is all-reduced over the tp group.

    `in_features` may be a list of fused inputs ([attention, MLP] of a parallel block): each part's columns
    are split separately and rank i holds [W_a,i  W_m,i], taking the concatenation of its parts' shards."""

    def __init__(self, in_features: Union[int, Sequence[int]], out_features: int, *, ctx, bias: bool = True,
                 input_is_parallel: bool = True, init_method: InitFn = default_weight_init,
                 device=None, dtype=None):
        super().__init__()
        parts = [in_features] if isinstance(in_features, int) else list(in_features)
        if not input_is_parallel and len(parts) > 1:
            raise ValueError("input_is_parallel=False needs a single input part")
        in_features = sum(parts)
        self.ctx, self.in_features, self.out_features = ctx, in_features, out_features
        self.input_is_parallel = input_is_parallel
        p, r = ctx.tp_size, ctx.tp_rank
        local_parts = [_divide(n, p, "in_features") for n in parts]
        self.in_features_per_partition = local = sum(local_parts)

        full_w = _full_init((out_features, in_features), init_method, device, dtype)
        weight = _uninitialised((out_features, local), device, dtype) if full_w is None \
            else torch.cat([piece[:, r * n:(r + 1) * n] for piece, n in zip(full_w.split(parts, dim=1), local_parts)],
                           dim=1).clone()
        self.weight = nn.Parameter(weight)
        mark_tensor_parallel(self.weight, 1)
        if len(parts) > 1:
            self.weight.tp_parts = local_parts
        if bias:
            full_b = _full_init((out_features,), lambda b: _default_bias_init(b, in_features), device, dtype)
            self.bias = nn.Parameter(_uninitialised((out_features,), device, dtype) if full_b is None else full_b)
        else:
            self.register_parameter("bias", None)

    def add_lora(self, rank: int, alpha: float, generator: torch.Generator, dropout: float = 0.0) -> None:
        """An adapter: A [r, in / p] (this rank's columns of the full A), B [out, r] replicated."""
        r = self.ctx.tp_rank
        local = getattr(self.weight, "tp_parts", None) or [self.in_features_per_partition]
        full = _lora_a((rank, self.in_features), generator, self.weight)
        a = torch.cat([piece[:, r * n:(r + 1) * n] for piece, n in
                       zip(full.split([n * self.ctx.tp_size for n in local], dim=1), local)], dim=1).contiguous()
        self._lora_setup(rank, alpha, dropout, a, torch.zeros(self.out_features, rank))
        if dropout:                                              # x is this rank's shard: one full mask, sliced
            self.lora_dropout = ShardDropout(dropout, local, self.ctx)
        mark_tensor_parallel(self.lora_A, 1)
        if len(local) > 1:
            self.lora_A.tp_parts = local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.ctx)                       # (..., in / p)
        if self.lora_A is None:
            y = reduce_from_tp(self.base_linear(x, None), self.ctx)   # (..., out), summed over ranks
            return y + self.bias if self.bias is not None else y
        y, u = self.base_linear(x, None), F.linear(self.lora_dropout(x), self.lora_A)   # (..., out), (..., r)
        if self.ctx.tp_size > 1:                                 # one all-reduce for both partial sums
            y, u = reduce_from_tp(torch.cat([y, u], dim=-1), self.ctx).split([self.out_features, u.shape[-1]], -1)
        y = y + self.bias if self.bias is not None else y
        return y + F.linear(u, self.lora_B) * self.lora_scaling

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.ctx.tp_size}, "
                f"local_in={self.in_features_per_partition}")
