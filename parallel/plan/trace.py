"""Run the model's own stage code on the meta device and record what autograd saves for backward.

The memory planner reads activation sizes from here instead of from a hand formula, so the plan and
the model cannot disagree. Two pieces make that possible without devices or process groups:

- A planning context, `ParallelContext.single(tp, sp)`: the layout's sizes and no process group. The
  model is built and run at the layout's `tp_size` (a family may branch on it: Wan's q/k RMSNorm), so
  `ColumnParallelLinear` / `RowParallelLinear` allocate their shards, and the four regions of
  `parallel/distributed/comm.py` return what their collective would, in shape, without calling a group.
  This changes nothing that is saved: none of those autograd functions saves a tensor for backward
  (they keep only the group, size and rank), and an all-reduce returns a tensor of its input's size.
- The meta device (shapes only, no storage): a CogVideoX-5B block at 17,776 tokens traces in tens of
  milliseconds. One thing differs from an accelerator: on meta, `scaled_dot_product_attention` picks
  its math fallback, which saves the S x S scores (30 GB for that block). `fused_attention_on_meta()`
  routes it to the fused flash-attention op instead, which saves q, k, v, the output and the
  log-sum-exp, as the flash / memory-efficient kernels of CUDA and `npu_fusion_attention` do (and as
  CPU fake tensors under FakeTensorMode dispatch by themselves, about ten times slower to trace).
  One small difference remains: LayerNorm statistics are saved in fp32 here, as CUDA does, where the
  CPU kernel keeps them in bf16 (1.3% of a bf16 debug block).

`record_saved()` collects saved tensors through `torch.autograd.graph.saved_tensors_hooks`, one entry
per storage (views of one tensor are counted once); `held_storages()` finds tensors a module keeps
outside its parameters (position tables cached on first use), which are model state, not activations.
`ActivationTracer` puts these together per stage kind (embed, one block, final + loss), tp size and
micro-batch, for any model family: the inputs of a block and of the final stage are the embed stage's
own outputs on meta, x [B, S, H] first (LTX-2: x and the audio stream, `FamilySpec.network.streams`), then the
tensors a stage's blocks share and pass on unchanged (CogVideoX: temb; STDiT: t, t_mlp, y), called side
tensors here. tests/unit/test_plan.py checks it against
real CPU forwards at tp = 1 and tp = 2.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from models.diffusion import mse_loss
from models.geometry import PositionCache, latent_shape, token_grid
from models.registry import family, ring_fits, sequence_tokens
from parallel.experiment.config import ExperimentConfig
from parallel.model.build import expert_of_parameter, layer_specs
from parallel.distributed.block_swap import BlockSwap, swappable_bytes
from parallel.distributed.offload import HostOffload
from parallel.distributed.sequence import sp_pairs
from parallel.distributed.topology import ParallelContext
from parallel.model.lora import apply_fp8_base, apply_lora
from parallel.model.recompute import packed_nbytes, wrap_layer


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (the StorageImpl address), equal for all views of one storage.

    `untyped_storage()` returns a fresh Python wrapper each call; `_cdata` is the address underneath.
    Callers keep the tensors alive while they compare keys, so an address is never reused meanwhile.
    """
    return t.untyped_storage()._cdata


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class _FusedAttentionOnMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].device.type == "meta":
            q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_arguments(*args, **kwargs)
            if mask is None and not gqa:
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, dropout_p, is_causal, scale=scale)[0]
        return func(*args, **kwargs)


def fused_attention_on_meta():
    """Inside: meta-device SDPA saves what the fused kernels save (see the module docstring)."""
    return _FusedAttentionOnMeta()


@contextlib.contextmanager
def record_saved() -> Iterator[dict[int, torch.Tensor]]:
    """Collect every tensor autograd saves inside the block: {storage key: one tensor of that storage}."""
    found: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        found.setdefault(storage_key(t), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield found


def _walk(obj, found: dict[int, int], seen: set[int], depth: int) -> None:
    if id(obj) in seen or depth > 4:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        found.setdefault(storage_key(obj), storage_bytes(obj))
    elif isinstance(obj, dict):
        for value in obj.values():
            _walk(value, found, seen, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _walk(value, found, seen, depth + 1)
    elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("models", "parallel"):
        for value in vars(obj).values():
            _walk(value, found, seen, depth + 1)


def held_storages(module: nn.Module) -> dict[int, int]:
    """Tensors a module holds besides its parameters: registered buffers and caches in plain attributes
    (the models' `PositionCache` tables). {storage key: bytes}."""
    found: dict[int, int] = {}
    seen: set[int] = set()
    for m in module.modules():
        for buf in m.buffers(recurse=False):
            found.setdefault(storage_key(buf), storage_bytes(buf))
        for name, value in vars(m).items():
            if name not in ("_parameters", "_buffers", "_modules") and not name.startswith("_forward") \
                    and not name.startswith("_backward") and not name.startswith("_state_dict"):
                _walk(value, found, seen, 0)
    return found


def table_storages(module: nn.Module) -> dict[int, int]:
    """The position tables among `held_storages`: one table serves every module that asks for it (every
    block of a stage), so a stage holds each once. {storage key: bytes}."""
    found: dict[int, int] = {}
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, PositionCache):
                for table in value.tables.values():
                    for t in table if isinstance(table, tuple) else (table,):
                        found.setdefault(storage_key(t), storage_bytes(t))
    return found


def fp8_base_bytes(module: nn.Module) -> int:
    """Bytes of the fp8 base (model.lora.base_dtype): each quantised layer's weight (1 byte an element) and
    its fp32 scale."""
    return sum(storage_bytes(m.weight) + storage_bytes(m.weight_scale) for m in module.modules()
               if getattr(m, "weight_scale", None) is not None)


def fp8_numel(module: nn.Module) -> int:
    """Elements of the fp8 base's weights (model.lora.base_dtype)."""
    return sum(m.weight.numel() for m in module.modules() if getattr(m, "weight_scale", None) is not None)


def parameter_storages(module: nn.Module) -> set[int]:
    return {storage_key(p) for p in module.parameters()}


@dataclass(frozen=True)
class StageTrace:
    """What one stage kind (embed, block, final) saves for one micro-batch on one tp rank."""

    activations: int          # saved bytes, without parameters, cached tables and the side tensors
    input_bytes: int          # bytes of its hidden-state input x [B, S, H] (what a checkpoint keeps; LTX-2: x and
                              # the audio stream a [B, A, Da], FamilySpec.network.streams)
    side_bytes: tuple         # bytes of each side tensor (shared by the stage's blocks, passed on)
    side_saved: tuple         # whether it saves each side tensor for backward
    buffers: int              # registered buffers and tables cached in attributes (position tables)
    params: tuple             # ((numel, ndim, expert or None), ...) of this tp rank's parameters
    tables: int = 0           # the position tables among `buffers`: shared by a stage's blocks, held once
    trainable: Optional[tuple] = None   # LoRA: ((numel, ndim, expert), ...) of the adapters (None: every parameter)
    host_bytes: int = 0       # train.offload_activations: what its checkpoints put in host memory (not in activations)
    fp8_base: int = 0         # model.lora.base_dtype: bytes of the fp8 weights and their scales (among `buffers`)
    fp8_numel: int = 0        # model.lora.base_dtype: elements of those fp8 weights (not among `params`)
    swap_bytes: int = 0       # train.block_swap: bytes of its frozen base that a swapped block keeps on the host

    @property
    def side_total(self) -> int:
        return sum(self.side_bytes)

    @property
    def side_saved_bytes(self) -> int:
        return sum(n for n, saved in zip(self.side_bytes, self.side_saved) if saved)


def sequence_length(cfg: ExperimentConfig) -> int:
    """Tokens of the sequence x per sample: text tokens + video patches (CogVideoX-5B at 49 x 480 x 720:
    226 + 17,550); STDiT's x holds the video patches only (the text enters through cross-attention)."""
    return sequence_tokens(cfg.model, cfg.data)


def attention_pairs(cfg: ExperimentConfig) -> int:
    """(query, key) pairs one layer's attention scores per sample (the family's count: S^2 for CogVideoX's
    full attention; STDiT: spatial t (hw)^2 + temporal hw t^2 + two cross-attentions 2 t hw L)."""
    return family(cfg.model).costs.attention_pairs(cfg.model, token_grid(cfg.model, cfg.data))


def _affine(a: int, b: int, n: int) -> int:
    """Value at micro-batch n from the traces at 1 and 2 (every saved tensor is affine in the batch)."""
    return a + (n - 1) * (b - a)


def ring_of(cfg: ExperimentConfig, tp: int, sp: int, explicit: bool = True) -> int:
    """The ring share of sp at (tp, sp): parallel.ring_size at the config's own tp and sp (`explicit`), else
    the checker's default (all Ulysses where it divides the heads of a tp rank, ring for the rest)."""
    p = cfg.parallel
    if sp == 1:
        return 1
    if explicit and p.ring_size is not None and (tp, sp) == (p.tp_size, p.sp_size):
        return p.ring_size
    heads, ring_ok = cfg.model.num_heads // tp, getattr(type(cfg.model), "RING_ATTENTION", True)
    return min((r for _, r in sp_pairs(heads, sp, ring_ok) if ring_fits(cfg.model, cfg.data, sp, r)), default=1)


class ActivationTracer:
    """Traces embed, one block and final at (tp, micro-batch) on the meta device, cached."""

    def __init__(self, cfg: ExperimentConfig, dtype: torch.dtype):
        self.cfg, self.dtype = cfg, dtype
        self._modules: dict = {}
        self._traces: dict = {}
        self._embedded: dict = {}            # (tp, b, sp) -> the embed stage's outputs' (shape, dtype)

    def _module(self, kind: str, tp: int, sp: int = 1, granularity: Optional[str] = None, offload: bool = False,
                swapped: bool = False):
        """The stage module on meta; a block with `granularity` checkpointed as train.recompute would (`offload`:
        its checkpoints' inputs moved to the host as train.offload_activations does; what moves is recorded);
        `swapped`: its linear layers computing as train.block_swap's do (no weight saved, no fp8 copy)."""
        key = (kind, tp, sp, granularity, offload, swapped)
        if key not in self._modules:
            # Traced at the default ring for (tp, sp): every (ulysses, ring) pair saves the same elements
            # (q, k, v, out of b S/sp H/tp), so one trace serves all; ring's own buffers are memory.ring_buffers.
            ctx = ParallelContext.single(tp, sp, ring_of(self.cfg, tp, sp, explicit=False))
            specs = layer_specs(self.cfg, ctx)
            spec = {"embed": specs[0], "block": specs[1], "final": specs[-1]}[kind]
            with torch.device("meta"):
                module = spec.build()
                if self.cfg.model.lora is not None:       # frozen base + adapters, as parallel/model/build.py does
                    apply_lora(module, self.cfg.model, self.cfg.train.seed, prefix=f"{spec.name}.")
                    apply_fp8_base(module, self.cfg.model, prefix=f"{spec.name}.")
                for param in module.parameters():     # as DeepSpeed 0.19 casts: parameters, not buffers
                    param.data = param.data.to(self.dtype)
            if swapped:
                BlockSwap([module], in_place=True)
            moved: list[int] = []
            if granularity is not None:
                hooks = HostOffload(lambda t, host: moved.append(t.numel() * t.element_size())) if offload else None
                net = family(self.cfg.model).network
                wrap_layer(module, net.recompute_parts, granularity, None, offload=hooks, streams=net.streams)
            self._modules[key] = (module, ctx, moved)
        return self._modules[key]

    def _inputs(self, kind: str, tp: int, b: int, sp: int = 1):
        """Meta tensors of the stage's input; a block's and final's are the embed stage's outputs, as leaves
        (with sp, one sp rank's part of the sequence). The embed stage runs once per (tp, b, sp), its outputs'
        shapes kept: a search traces a block at several recompute options (HunyuanVideo 1.5's embed stage, its
        token refiner, was half of a search's time)."""
        m = self.cfg.model
        raw = (torch.empty(b, m.transformer_in_channels, *latent_shape(m, self.cfg.data)),
               torch.zeros(b, dtype=torch.long), torch.empty(b, m.max_text_len, m.text_embed_dim),
               *(torch.empty(b, *shape) for shape in m.clip_input_shapes(self.cfg.data)))
        if kind == "embed":
            return raw
        if (tp, b, sp) not in self._embedded:
            embed, *_ = self._module("embed", tp, sp)
            with torch.no_grad():
                out = embed(raw)
            self._embedded[(tp, b, sp)] = tuple((t.shape, t.dtype) for t in out)
        return tuple(torch.empty(shape, dtype=dtype, requires_grad=dtype.is_floating_point)
                     for shape, dtype in self._embedded[(tp, b, sp)])

    def _trace(self, kind: str, tp: int, b: int, sp: int = 1, granularity: Optional[str] = None,
               compression: Optional[str] = None, offload: bool = False, swapped: bool = False) -> StageTrace:
        module, _, moved = self._module(kind, tp, sp, granularity, offload, swapped)
        moved.clear()
        with torch.device("meta"), fused_attention_on_meta():
            inputs = self._inputs(kind, tp, b, sp)
            with record_saved() as saved:
                out = module(inputs)
                if kind == "final":                  # the last stage's loss (LTX-2: one per stream, summed)
                    out = sum(mse_loss(o, torch.empty(o.shape)) for o in (out if isinstance(out, tuple) else (out,)))
        skip = parameter_storages(module)
        held = held_storages(module)
        stage = out if kind == "embed" else inputs
        streams = family(self.cfg.model).network.streams                  # x (LTX-2: x and the audio stream) first
        hidden, side = stage[:streams], stage[streams:]
        side_keys = [storage_key(t) for t in side]
        size = (lambda t: packed_nbytes(t, compression)) if compression else storage_bytes
        acts = sum(size(t) for k, t in saved.items() if k not in skip and k not in held and k not in side_keys)
        params = tuple((p.numel(), p.dim(), expert_of_parameter(n)) for n, p in module.named_parameters())
        trainable = tuple((p.numel(), p.dim(), expert_of_parameter(n)) for n, p in module.named_parameters()
                          if p.requires_grad) \
            if self.cfg.model.lora is not None else None
        return StageTrace(acts, sum(storage_bytes(t) for t in hidden), tuple(storage_bytes(t) for t in side),
                          tuple(kind != "embed" and k in saved for k in side_keys), sum(held.values()), params,
                          sum(table_storages(module).values()), trainable, sum(moved), fp8_base_bytes(module),
                          fp8_numel(module), swappable_bytes(module))

    def trace(self, kind: str, tp: int, b: int, sp: int = 1, granularity: Optional[str] = None,
              compression: Optional[str] = None, offload: bool = False, swapped: bool = False) -> StageTrace:
        """The trace at micro-batch b (one sp rank's tokens): traced at 1 and 2, extrapolated linearly beyond.
        A block's with train.recompute's `granularity` checkpointed (its kept inputs count as saved, or with
        `offload` as host bytes) and/or with train.activation_compression's `compression` (each saved
        activation at its packed size); `swapped`: as a train.block_swap block computes."""
        option = (granularity, compression, offload and granularity is not None, swapped) if kind == "block" \
            else (None, None, False, False)
        for n in (1, 2):
            if (kind, tp, n, sp, option) not in self._traces:
                self._traces[(kind, tp, n, sp, option)] = self._trace(kind, tp, n, sp, *option)
        if b in (1, 2):
            return self._traces[(kind, tp, b, sp, option)]
        one, two = self._traces[(kind, tp, 1, sp, option)], self._traces[(kind, tp, 2, sp, option)]
        return StageTrace(_affine(one.activations, two.activations, b), _affine(one.input_bytes, two.input_bytes, b),
                          tuple(_affine(a, c, b) for a, c in zip(one.side_bytes, two.side_bytes)), one.side_saved,
                          one.buffers, one.params, one.tables, one.trainable,
                          _affine(one.host_bytes, two.host_bytes, b), one.fp8_base, one.fp8_numel, one.swap_bytes)

    def layer_parameters(self, start: int, n: int, tp: int, sp: int = 1) -> tuple[list, Optional[list]]:
        """(params, trainable) as in StageTrace, of layers [start, start + n) at tp: the traced block's n times,
        or, for a family whose layers differ by index (its layer class `indexed`: HunyuanVideo's dual- and
        single-stream blocks), each layer built on meta by itself."""
        block = self.trace("block", tp, 1, sp)
        if not getattr(family(self.cfg.model).network.layer, "indexed", False):
            return list(block.params) * n, (list(block.trainable) * n if block.trainable is not None else None)
        params, trainable = [], [] if block.trainable is not None else None
        specs = layer_specs(self.cfg, ParallelContext.single(tp, sp))
        for i in range(start, start + n):
            key = ("layer", i, tp, sp)
            if key not in self._traces:
                with torch.device("meta"):
                    module = specs[1 + i].build()
                    if self.cfg.model.lora is not None:
                        apply_lora(module, self.cfg.model, self.cfg.train.seed, prefix=f"{specs[1 + i].name}.")
                        apply_fp8_base(module, self.cfg.model, prefix=f"{specs[1 + i].name}.")
                named = [(p.numel(), p.dim(), expert_of_parameter(n), p.requires_grad)
                         for n, p in module.named_parameters()]
                self._traces[key] = (tuple(t[:3] for t in named), tuple(t[:3] for t in named if t[3]))
                for param in module.parameters():     # in the run's dtype, as _module casts them
                    param.data = param.data.to(self.dtype)
                self._traces[("fp8", i, tp, sp)] = (fp8_base_bytes(module), fp8_numel(module))
                self._traces[("swap", i, tp, sp)] = swappable_bytes(module)
            params += self._traces[key][0]
            if trainable is not None:
                trainable += self._traces[key][1]
        return params, trainable

    def layer_fp8(self, start: int, n: int, tp: int, sp: int = 1) -> tuple[int, int]:
        """model.lora.base_dtype: (bytes, elements) of the fp8 base of layers [start, start + n) at tp, each
        layer its own for a family whose layers differ by index (as layer_parameters)."""
        block = self.trace("block", tp, 1, sp)
        if not getattr(family(self.cfg.model).network.layer, "indexed", False):
            return block.fp8_base * n, block.fp8_numel * n
        self.layer_parameters(start, n, tp, sp)
        per_layer = [self._traces[("fp8", i, tp, sp)] for i in range(start, start + n)]
        return sum(b for b, _ in per_layer), sum(e for _, e in per_layer)

    def layer_swap(self, start: int, n: int, tp: int, sp: int = 1) -> list[int]:
        """train.block_swap: the bytes each of layers [start, start + n) keeps on the host when swapped, at tp
        (parallel/distributed/block_swap.py swappable_bytes; each layer its own, as layer_parameters)."""
        block = self.trace("block", tp, 1, sp)
        if not getattr(family(self.cfg.model).network.layer, "indexed", False):
            return [block.swap_bytes] * n
        self.layer_parameters(start, n, tp, sp)
        return [self._traces[("swap", i, tp, sp)] for i in range(start, start + n)]

    def recompute_fraction(self, granularity: str, tp: int = 1, sp: int = 1) -> float:
        """FLOPs a checkpointed block repeats in backward, as a fraction of its forward's: (forward + backward
        with `granularity` checkpointed - without) / forward, counted by torch's FlopCounterMode on meta
        (block: 1; CogVideoX debug: attention 0.06, mlp 0.29)."""
        key = ("flops", granularity, tp, sp)
        if key not in self._traces:
            totals = []
            for g in (None, granularity):
                module, *_ = self._module("block", tp, sp, g)
                with torch.device("meta"):
                    inputs = self._inputs("block", tp, 1, sp)         # the embed stage's FLOPs not counted
                with torch.device("meta"), FlopCounterMode(display=False) as count:
                    out = module(inputs)[0]
                    forward = count.get_total_flops()
                    out.sum().backward()
                totals.append((forward, count.get_total_flops()))
            (forward, plain), (_, with_recompute) = totals
            self._traces[key] = (with_recompute - plain) / forward
        return self._traces[key]
