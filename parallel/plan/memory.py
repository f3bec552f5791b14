"""Per-rank memory of a layout: model states per ZeRO stage and precision, activations from a traced
block, communication buckets, pipeline buffers and a margin, for the worst rank of each pipeline stage.

Model states are what DeepSpeed 0.19 holds at the optimizer step, their peak (read from its source
and checked against the tensors it holds in tests/unit/test_plan.py). P = this rank's parameters after tp
sharding, d = dp_size, lp = 2 bytes for bf16/fp16 and 4 for fp32, P' = P padded per optimizer group
(matrices / the rest) to a multiple of 2d, G' = the largest group's part of P'/d, W = the rank's
gradient partition as whole parameters (a parameter straddling two ranks' slices is held by both):

    optimizer path (engine._do_optimizer_sanity_check)   params         grads              master  moments
    fp32, ZeRO-0: torch AdamW                             4P             4P                 -       8P
    bf16/fp16, ZeRO-0, pp = 1: FP16_UnfusedOptimizer      lp P           lp P + 4P          4P      8P
    bf16, ZeRO-1 + fp32 accumulation: BF16_Optimizer      lp P'          lp P + 4P'         4P'/d   8P'/d
    ZeRO-1/2 otherwise: DeepSpeedZeroOptimizer            lp P'          lp W + 4G'         4P'/d   8P'/d
    ZeRO-3, c = ceil(numel / d) per parameter             lp (Σc + Σs)   lp Σc + 4 max-grp  4Σc     8Σc

(ZeRO-1 of DeepSpeedZeroOptimizer keeps the full lp gradients until the boundary reduce, so it takes
the larger of lp P and its step figure; s are the parameters under stage3_param_persistence_threshold,
kept whole on every rank.) EmaAdamW (optimizer.type FusedEmaAdam) adds one fp32 shadow per element
the optimizer steps, half the moments. Optimizer offload moves master, moments, EMA and the fp32
gradients to host memory (ZeRO-3: all its gradients, lp Σc + 4 Σc, since Stage3 then allocates the lp
partitions on the host and keeps every sub-group's fp32 gradient; measured in
tests/distributed/test_ds_json_distributed.py); parameter offload moves the ZeRO-3 partitions. ZeRO-1/2
offload (DeepSpeedZeroOptimizer's cpu_offload) also holds on the host an lp copy of the partition, every
group's fp32 gradient, a largest-parameter gradient buffer and, with several micro-batches, their
accumulated gradients as whole parameters (lp W).

Activations per micro-batch come from `parallel.plan.trace` (the model's own forward on the meta device),
at sequence parallel size sp for one sp rank's S / sp tokens. The sp ranks are DeepSpeed data-parallel
ranks, so ZeRO shards over d = dp x sp.
With activation checkpointing a stage keeps only each segment's input (divided by tp with
`partition_activations`, in host memory with `cpu_checkpointing`) plus, during backward, one
segment's full activations for the recompute. Under 1F1B stage s holds min(pp - s, m) micro-batches.
With train.offload_activations what each checkpoint keeps (x per segment; with train.recompute what the traced
checkpoints keep, `StageTrace.host_bytes`) is host memory instead, and during one checkpoint's backward its
inputs and the previous checkpoint's (prefetched) are back on the device, on the recompute line.
With train.block_swap the frozen base of each stage's last N blocks (`ActivationTracer.layer_swap`: their tensor-
parallel linear weights, fp8 ones with their scales) leaves the parameters line for host memory, and the copies of
two of them at a time (the block computing, the next arriving) are the "swapped blocks' copies" line.
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field

import torch

from parallel.experiment import ds_config as dsc
from parallel.experiment.config import ExperimentConfig
from parallel.distributed.topology import Layout
from parallel.experiment.manifest import bucket_configs
from models.registry import sequence_tokens
from parallel.distributed.deepspeed.accounting import ENGINE_ALLREDUCE_BUCKET
from parallel.model.build import blocks_per_stage, checkpoint_interval
from parallel.plan.trace import ActivationTracer, StageTrace, ring_of
from parallel.model.recompute import checkpointed_blocks
from parallel.experiment.units import BYTES, DTYPES, GiB

DEFAULT_BUCKET = 500_000_000              # DeepSpeed 0.19's reduce bucket default (elements)
DEFAULT_PREFETCH = 50_000_000
DEFAULT_PERSISTENCE = 100_000
DEFAULT_MAX_LIVE = 1_000_000_000
DEFAULT_SUB_GROUP = 1_000_000_000
# (key, label) of each line of the breakdown, in report order.
LINES = (("parameters", "parameters"), ("block_swap", "swapped blocks' copies"), ("gradients", "gradients"),
         ("adam_moments", "Adam moments"),
         ("master_weights", "fp32 master weights"), ("ema_shadow", "EMA shadow"), ("buffers", "position tables"),
         ("activations", "activations"), ("recompute", "recompute (1 segment)"),
         ("zero_buckets", "gradient reduce buffers"), ("zero3_gathered", "ZeRO-3 gathered params"),
         ("pipeline_buffers", "pipeline buffers"), ("ring_buffers", "ring attention buffers"), ("margin", "margin"))
# Lines reports leave out when they are zero on every stage (a layout without them).
OPTIONAL_LINES = {"ring_buffers", "block_swap"}


def ring_buffers(block_input: int, tp: int, ring: int, lp: int) -> int:
    """Transient bytes of one ring attention's backward (parallel/distributed/ring.py), c = this rank's
    b x S/sp x H/tp chunk (the block input over tp, lp bytes an element): the stacked key/value chunk and the
    next one arriving (4 c lp), this rank's fp32 dK/dV, the accumulator arriving and the one still being
    sent (3 x 2 c x 4), and the fp32 dQ (4 c). Zero without a ring."""
    if ring == 1:
        return 0
    c = block_input // tp // lp
    return 4 * c * lp + 6 * c * 4 + c * 4


@dataclass
class EngineSettings:
    """The DeepSpeed settings the memory depends on, read once from the JSON."""

    zero: int
    precision: str
    grad_accum_fp32: bool
    checkpoint_every: int       # blocks per checkpointed segment, 0 = no checkpointing
    partition_activations: bool
    cpu_checkpointing: bool
    reduce_bucket: int
    prefetch_bucket: int
    persistence_threshold: int
    max_live: int
    sub_group: int
    overlap_comm: bool
    contiguous_gradients: bool
    offload_optimizer: bool
    offload_param: bool
    ema: bool = False
    comm_bytes: int = 2         # element size of the gradient all-reduce (communication_data_type)
    quantized_weights: bool = False      # ZeRO++ zero_quantized_weights: int8 forward all-gather
    quantized_gradients: bool = False    # ZeRO++ zero_quantized_gradients: int8 gradient reduce-scatter
    hpz: int = 1                         # ZeRO++ zero_hpz_partition_size: the secondary partition's ranks

    @classmethod
    def from_ds(cls, ds: dict, num_layers: int) -> "EngineSettings":
        z = ds.get("zero_optimization") or {}
        ac = ds.get("activation_checkpointing") or {}
        stage = dsc.zero_stage(ds)
        off = lambda key: (z.get(key) or {}).get("device", "none") in ("cpu", "nvme")
        return cls(stage, dsc.precision(ds), dsc.grad_accum_dtype(ds) == "fp32",
                   checkpoint_interval(ds, num_layers), bool(ac.get("partition_activations")),
                   bool(ac.get("cpu_checkpointing")), int(z.get("reduce_bucket_size", DEFAULT_BUCKET)),
                   int(z.get("stage3_prefetch_bucket_size", DEFAULT_PREFETCH)),
                   int(z.get("stage3_param_persistence_threshold", DEFAULT_PERSISTENCE)),
                   int(z.get("stage3_max_live_parameters", DEFAULT_MAX_LIVE)),
                   int(z.get("sub_group_size", DEFAULT_SUB_GROUP)),
                   bool(z.get("overlap_comm", stage == 3)), bool(z.get("contiguous_gradients", True)),
                   off("offload_optimizer"), off("offload_param"),
                   str((ds.get("optimizer") or {}).get("type", "AdamW")).lower() in dsc.EMA_OPTIMIZERS,
                   BYTES.get(ds.get("communication_data_type") or dsc.precision(ds), 2),
                   z.get("zero_quantized_weights") is True, z.get("zero_quantized_gradients") is True,
                   int(z.get("zero_hpz_partition_size") or 1))

    @property
    def lp(self) -> int:
        return self.dtype.itemsize

    @property
    def dtype(self) -> torch.dtype:
        """The precision's dtype; fp32 for the refused 'bf16+fp16' too (plan mode traces before checking)."""
        return DTYPES.get(self.precision, torch.float32)

    def optimizer_path(self, pp: int) -> str:
        """The optimizer class DeepSpeed 0.19 wraps around ours for these settings."""
        if self.zero == 0:
            if self.precision == "fp32":
                return "torch AdamW"
            return "BF16_Optimizer" if pp > 1 and self.precision == "bf16" else "FP16_UnfusedOptimizer"
        if self.zero == 1 and self.precision == "bf16" and self.grad_accum_fp32 and not self.offload_optimizer:
            return "BF16_Optimizer"
        return "DeepSpeedZeroOptimizer_Stage3" if self.zero == 3 else "DeepSpeedZeroOptimizer"


def _worst_partition(numels: list[int], dp: int, align: int) -> int:
    """Largest sum, over dp ranks, of the parameters overlapping a rank's slice of the flat group:
    DeepSpeedZeroOptimizer keeps a rank's gradient partition as whole parameters (`grads_in_partition`),
    so a parameter straddling two slices is held by both."""
    ends = list(itertools.accumulate(numels))             # parameter i spans [ends[i] - n_i, ends[i])
    part = math.ceil(ends[-1] / align) * align // dp
    worst = 0
    for r in range(dp):
        first = bisect.bisect_right(ends, r * part)           # first parameter ending after the slice start
        last = bisect.bisect_left(ends, (r + 1) * part)       # last parameter starting before the slice end
        if first < len(ends):
            last = min(last, len(ends) - 1)
            worst = max(worst, ends[last] - (ends[first - 1] if first else 0))
    return worst


def optimizer_groups(params: list) -> list[list[int]]:
    """The numels of each optimizer group, as parallel/train/optim.py's param_groups makes them from (numel,
    ndim, expert) in module order: per expert (none last), matrices then the rest."""
    experts = sorted({e for _, _, e in params}, key=lambda e: (e is None, e))
    return [[n for n, nd, e in params if e == expert and (nd >= 2) == matrix]
            for expert in experts for matrix in (True, False)]


def frozen_bytes(params: list, trainable: list, eng: EngineSettings, dp: int, pp: int) -> int:
    """Bytes of the parameters no optimizer steps (LoRA's frozen base): the weights alone, in the engine's
    dtype (fp32 for torch AdamW), ZeRO-3 partitioned over dp like the rest (small ones whole)."""
    frozen = list(params)
    for item in trainable:                # params minus trainable, as a multiset of (numel, ndim, expert)
        frozen.remove(item)
    size = 4 if eng.optimizer_path(pp) == "torch AdamW" else eng.lp
    if eng.zero == 3:
        return size * sum(n if n < eng.persistence_threshold else math.ceil(n / dp) for n, *_ in frozen)
    return size * sum(n for n, *_ in frozen)


def model_states(params: list, eng: EngineSettings, dp: int, pp: int,
                 micro_batches: int = 1) -> tuple[dict[str, int], dict[str, int]]:
    """(device bytes, host bytes) of parameters, gradients, optimizer (Adam moments) and master weights.

    `params` lists this rank's parameters as (numel, ndim, expert) in module order; build_optimizer puts
    matrices (ndim >= 2) and the rest in two groups (per expert for a model of several), which DeepSpeed
    flattens and pads separately and steps one at a time (so one group's fp32 gradient exists at a time).
    """
    lp, path = eng.lp, eng.optimizer_path(pp)
    if not params:                        # LoRA: a stage without adapters steps nothing
        zero = dict.fromkeys(("parameters", "gradients", "adam_moments", "master_weights", "ema_shadow"), 0)
        return zero, dict(zero)
    total = sum(n for n, *_ in params)
    groups = [g for g in optimizer_groups(params) if g]
    align = 2 * dp
    parts = [math.ceil(sum(g) / align) * align // dp for g in groups]
    padded, part = sum(p * dp for p in parts), sum(parts)
    if path == "torch AdamW":
        dev = {"parameters": 4 * total, "gradients": 4 * total, "adam_moments": 8 * total, "master_weights": 0}
    elif path == "FP16_UnfusedOptimizer":
        dev = {"parameters": lp * total, "gradients": lp * total + 4 * total, "adam_moments": 8 * total,
               "master_weights": 4 * total}
    elif path == "BF16_Optimizer":
        acc = 4 if eng.grad_accum_fp32 else lp
        dev = {"parameters": lp * padded, "gradients": lp * total + acc * padded, "adam_moments": 8 * part,
               "master_weights": 4 * part}
    elif path == "DeepSpeedZeroOptimizer":
        # At the step: the rank's lp gradient partition plus the fp32 copy of the group being stepped.
        fp32_grad = 4 * max(parts)
        at_step = lp * sum(_worst_partition(g, dp, align) for g in groups) + fp32_grad
        grads = at_step if eng.zero == 2 else max(lp * total, at_step)  # ZeRO-1: full grads until the reduce
        dev = {"parameters": lp * padded, "gradients": grads, "adam_moments": 8 * part, "master_weights": 4 * part}
    else:
        shards = [sum(math.ceil(n / dp) for n in g) for g in groups]
        shard = sum(shards)
        small = sum(n for n, *_ in params if n < eng.persistence_threshold)
        fp32_grad = 4 * min(max(shards), eng.sub_group)                 # one sub-group stepped at a time
        # The step first releases every gathered parameter, persistent ones too (release_and_reset_all):
        # the fp32 gradient of the stepped sub-group and the whole small parameters never coexist.
        on_device_at_step = max(fp32_grad - lp * small, 0)
        dev = {"parameters": lp * (shard + small), "gradients": lp * shard + on_device_at_step,
               "adam_moments": 8 * shard, "master_weights": 4 * shard}
    # EmaAdamW keeps one fp32 shadow per element it steps, beside the two moments.
    dev["ema_shadow"] = dev["adam_moments"] // 2 if eng.ema else 0
    host = {k: 0 for k in dev}
    if eng.offload_optimizer and eng.zero >= 1:
        for key in ("adam_moments", "master_weights", "ema_shadow"):
            host[key], dev[key] = dev[key], 0
        if path == "DeepSpeedZeroOptimizer":
            # cpu_offload keeps every group's fp32 gradient on the host, an lp copy of the partition
            # (its step's staging), a largest-parameter gradient buffer and, over several micro-batches,
            # their accumulated gradients as whole parameters (W, like the device partition).
            whole = lp * sum(_worst_partition(g, dp, align) for g in groups) if micro_batches > 1 else 0
            host["gradients"] = 4 * part + lp * max(n for n, *_ in params) + whole
            host["parameters"] = lp * part
            dev["gradients"] -= fp32_grad
        elif path == "DeepSpeedZeroOptimizer_Stage3":
            # Stage3 allocates its gradient partitions on the offload device, and keeps every sub-group's
            # fp32 gradient there (not only the one being stepped): nothing of the gradients stays on device.
            host["gradients"], dev["gradients"] = (lp + 4) * shard, 0
    if eng.offload_param and eng.zero == 3:
        host["parameters"] = lp * shard
        dev["parameters"] -= lp * shard
    return dev, host


def _bucket_copies(sizes: list[int], bucket: int, grad_bytes: int, comm_bytes: int) -> int:
    """Largest temporary of DeepSpeed's buffered all-reduce (engine.allreduce_no_retain): gradients are
    packed into buckets until one exceeds `bucket` elements; a bucket of several tensors is flattened
    (a copy), and a bucket in another dtype than the communication dtype is converted (a copy)."""
    worst = numel = count = 0
    for n in sizes + [None]:
        if n is not None:
            numel, count = numel + n, count + 1
        if count and (n is None or numel > bucket):
            copies = (grad_bytes * numel if count > 1 else 0) + (comm_bytes * numel if comm_bytes != grad_bytes else 0)
            worst, numel, count = max(worst, copies), 0, 0
    return worst


def zero_buckets(eng: EngineSettings, pp: int, params: list, dp: int) -> int:
    """Gradient-reduction buffers, DeepSpeed 0.19. ZeRO-2/3 keep a reduce bucket of the JSON's
    reduce_bucket_size elements (two with overlap_comm; ZeRO-1's DeepSpeedZeroOptimizer an fp32 one).
    ZeRO-0 and BF16_Optimizer go through the engine's buffered all-reduce, buckets of 5e8 elements
    (MEMORY_OPT_ALLREDUCE_SIZE, not the JSON's), in the communication dtype (bf16 when bf16 is on):
    for BF16_Optimizer that is a bf16 copy of its largest fp32 gradient group. allgather_bucket_size
    only splits the in-place parameter all-gather: no buffer of its own."""
    path = eng.optimizer_path(pp)
    comm = eng.comm_bytes
    if path in ("torch AdamW", "FP16_UnfusedOptimizer"):
        return _bucket_copies([n for n, *_ in params], ENGINE_ALLREDUCE_BUCKET, eng.lp, comm)
    if path == "BF16_Optimizer":
        align = 2 * dp
        groups = [sum(g) for g in optimizer_groups(params)]
        flat = [math.ceil(g / align) * align for g in groups if g]
        return _bucket_copies(flat, ENGINE_ALLREDUCE_BUCKET, 4 if eng.grad_accum_fp32 else eng.lp, comm)
    if eng.zero == 3:
        return eng.lp * eng.reduce_bucket
    if not eng.contiguous_gradients:
        return 0
    dtype_bytes = 4 if eng.zero == 1 else eng.lp
    return dtype_bytes * eng.reduce_bucket * (2 if eng.overlap_comm else 1)


@dataclass(frozen=True)
class BlockTraces:
    """One block's traces at a micro-batch: `whole` as written, `plain` with train.activation_compression,
    `selected` with train.recompute's checkpoints too (and train.offload_activations' host copies)."""

    whole: StageTrace
    plain: StageTrace
    selected: StageTrace


def _block_traces(cfg: ExperimentConfig, tracer: ActivationTracer, b: int, swapped: bool = False) -> BlockTraces:
    """The block's traces for cfg at micro-batch b; `swapped`: as a train.block_swap block computes."""
    tp, sp, rc, comp = cfg.parallel.tp_size, cfg.parallel.sp_size, cfg.train.recompute, cfg.train.activation_compression
    compression = comp.dtype if comp is not None else None
    plain = tracer.trace("block", tp, b, sp, None, compression, swapped=swapped)
    selected = plain if rc is None else tracer.trace("block", tp, b, sp, rc.granularity, compression,
                                                     cfg.train.offload_activations, swapped)
    return BlockTraces(tracer.trace("block", tp, b, sp, swapped=swapped), plain, selected)


def _kept(traces: BlockTraces, blocks: int, chosen: int) -> tuple[int, int, int]:
    """(device bytes, host bytes, recompute bytes) of `blocks` blocks under train.recompute / compression, `chosen` of
    them checkpointed: those keep `selected`'s bytes, the others `plain`'s; one block's recompute re-creates its
    activations less what it kept (on the device or the host), and with offload its kept inputs are back on the
    device and the previous checkpoint's arriving (2 x)."""
    whole, plain, selected = traces.whole, traces.plain, traces.selected
    recompute = max(whole.activations - selected.activations - selected.host_bytes, 0) + 2 * selected.host_bytes
    return (chosen * selected.activations + (blocks - chosen) * plain.activations, chosen * selected.host_bytes,
            recompute if chosen else 0)


@dataclass
class StageMemory:
    """Memory of the worst rank of one pipeline stage, by line, in bytes."""

    stage: int
    blocks: int
    in_flight: int
    lines: dict[str, int]
    host: dict[str, int] = field(default_factory=dict)
    params: int = 0                       # parameters held by this rank (after tp sharding)

    @property
    def total(self) -> int:
        return sum(self.lines.values())


@dataclass
class MemoryPlan:
    stages: list[StageMemory]
    device_memory: int
    optimizer_path: str
    per_block: dict[str, int]              # activation figures per micro-batch, for the report

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def fits(self) -> bool:
        return self.worst.total <= self.device_memory

    @property
    def headroom(self) -> int:
        return self.device_memory - self.worst.total


def plan_memory(cfg: ExperimentConfig, ds: dict, dp: int, device_memory: int, tracer: ActivationTracer,
                margin: float = 0.10, workspace: int = GiB) -> MemoryPlan:
    """Memory per pipeline stage of the layout in cfg.parallel with ds's engine settings (dp: data replicas)."""
    tp, pp, m = cfg.parallel.tp_size, cfg.parallel.pp_size, cfg.train.grad_accum_steps
    b, sp = cfg.train.micro_batch_size, cfg.parallel.sp_size
    dp = dp * sp                        # DeepSpeed's data axis: ZeRO partitions over dp x sp
    eng = EngineSettings.from_ds(ds, cfg.model.num_layers)
    embed, block, final = (tracer.trace(kind, tp, b, sp) for kind in ("embed", "block", "final"))
    k = eng.checkpoint_every
    # train.recompute / train.activation_compression: blocks i % every == 0 keep `selected`'s bytes, the others
    # `plain`'s (both compressed when compression is on); recomputing one block re-creates its uncompressed
    # activations less what it kept, once at a time during backward (`_kept`).
    rc, comp = cfg.train.recompute, cfg.train.activation_compression
    # train.offload_activations: what each checkpoint keeps (traced: `host_bytes`; the JSON's: x) is in host memory.
    off = cfg.train.offload_activations
    ours = _block_traces(cfg, tracer, b)
    plain, selected = ours.plain, ours.selected
    every = rc.every if rc is not None else 1
    # train.block_swap: a swapped block's linear layers save no weight (an fp8 base no dequantised copy): traced so
    swapped_traces = _block_traces(cfg, tracer, b, swapped=True) if cfg.train.block_swap else ours
    # Checkpoint inputs: x per segment (the side tensors, temb or STDiT's t, t_mlp, y, pass as views of the
    # shared ones unless DeepSpeed copies inputs for partitioning or host offload), divided over tp ranks
    # when partitioned.
    copies = eng.partition_activations or eng.cpu_checkpointing
    seg_input = (block.input_bytes + (block.side_total if copies else 0)) // (tp if eng.partition_activations else 1)
    stages = []
    counts = blocks_per_stage(cfg)
    for s, n in enumerate(counts):
        start = sum(counts[:s])
        chosen = checkpointed_blocks(cfg.model.num_layers, every, start, start + n) if rc is not None else 0
        ns = min(cfg.train.block_swap, n)          # swapped: the stage's last ns blocks, chosen_sw of them chosen
        chosen_sw = checkpointed_blocks(cfg.model.num_layers, every, start + n - ns, start + n) if rc is not None else 0
        first, last = s == 0, s == pp - 1
        flight = min(pp - s, m)
        layers, layers_trainable = tracer.layer_parameters(start, n, tp, sp)
        params = list(embed.params if first else ()) + layers + list(final.params if last else ())
        # LoRA: the optimizer, its master weights and gradients hold the adapters; the frozen base is weights only.
        trainable = params if block.trainable is None else \
            list(embed.trainable if first else ()) + layers_trainable + list(final.trainable if last else ())
        dev, host = model_states(trainable, eng, dp, pp, m)
        frozen = frozen_bytes(params, trainable, eng, dp, pp)
        if eng.offload_param and eng.zero == 3:       # ZeRO-3 parameter offload moves the frozen partitions too
            host["parameters"] += frozen
        else:
            dev["parameters"] += frozen
        own = (embed.activations if first else 0) + (final.activations if last else 0)
        # Side tensors are held once per stage: those its blocks save (all of them when checkpoints keep
        # views of them) or its final layer saves.
        saves_side = block.side_saved if rc is None else tuple(a or c for a, c in zip(plain.side_saved, selected.side_saved))
        shared = sum(size for size, in_block, in_final in zip(block.side_bytes, saves_side, final.side_saved)
                     if (n and (k or in_block)) or (last and in_final))
        # sp: the first block's input x is this rank's view of the embed's whole (padded) sequence
        # (split_sequence narrows it), so what the first block keeps of x holds that whole storage:
        # measured at tp 2 x sp 2 (tests/cli/test_family_matrix.py). Unless the checkpoint copies its inputs.
        # Offload copies the first block's x too (its view, not the storage under it).
        own += embed.input_bytes - block.input_bytes if first and n and not copies and not off else 0
        host_acts = 0
        if k:
            segments = math.ceil(n / k)
            on_host = eng.cpu_checkpointing or off
            kept = 0 if on_host else segments * seg_input
            host_acts = flight * segments * seg_input if on_host else 0
            # offload: during a segment's backward its input is back on the device and the next one arriving
            acts = flight * (kept + shared + own)
            recompute = min(k, n) * (swapped_traces if ns == n else ours).whole.activations \
                + (2 * seg_input if off else 0)
        elif rc is not None or comp is not None:
            (kept, held, recompute), (kept_sw, held_sw, recompute_sw) = \
                _kept(ours, n - ns, chosen - chosen_sw), _kept(swapped_traces, ns, chosen_sw)
            acts, host_acts = flight * (kept + kept_sw + shared + own), flight * (held + held_sw)
            recompute = max(recompute, recompute_sw)
        else:
            acts = flight * ((n - ns) * block.activations + ns * swapped_traces.whole.activations + shared + own)
            recompute = 0
        boundary = block.input_bytes + block.side_total
        pipe = (boundary if not first else 0) + ((1 + flight) * boundary if not last else 0) if pp > 1 else 0
        numel = sum(n_ for n_, *_ in params)
        gathered = 0
        if eng.zero == 3:
            big = sum(n_ for n_, *_ in block.params if n_ >= eng.persistence_threshold)
            gathered = eng.lp * min(eng.max_live, big + eng.prefetch_bucket)
        # model.lora.base_dtype: the fp8 base (1 byte an element + a scale a tensor) is a buffer in the module,
        # whole on every rank under each ZeRO stage; counted as parameters, not as buffers.
        dev["parameters"] += tracer.layer_fp8(start, n, tp, sp)[0] + (embed.fp8_base if first else 0) \
            + (final.fp8_base if last else 0)
        # train.block_swap: the stage's last N blocks keep their frozen base on the host; the device holds the copies
        # of two of them at a time (the one computing and the next arriving)
        swapped = tracer.layer_swap(start, n, tp, sp)[-cfg.train.block_swap:] if cfg.train.block_swap else []
        dev["parameters"] -= sum(swapped)
        own_buffers = block.buffers - block.tables - block.fp8_base       # registered buffers; tables once a stage
        lines = {**dev, "block_swap": max((a + b for a, b in zip(swapped, swapped[1:] + [0])), default=0),
                 "buffers": own_buffers * n + (block.tables if n else 0)
                 + (embed.buffers - embed.fp8_base if first else 0) + (final.buffers - final.fp8_base if last else 0),
                 "activations": acts, "recompute": recompute,
                 "zero_buckets": zero_buckets(eng, pp, trainable, dp), "zero3_gathered": gathered,
                 "pipeline_buffers": pipe,
                 "ring_buffers": ring_buffers(block.input_bytes, tp, ring_of(cfg, tp, sp), eng.lp) if n else 0}
        lines["margin"] = int(margin * sum(lines.values())) + workspace
        stages.append(StageMemory(s, n, flight, {key: lines[key] for key, _ in LINES},
                                  {**host, "activations": host_acts, "block_swap": sum(swapped)}, numel))
    per_block = {"block_activations": block.activations, "block_input": block.input_bytes,
                 "selected_block_activations": selected.activations, "plain_block_activations": plain.activations,
                 "checkpoint_input": seg_input, "side_inputs": block.side_total, "embed_activations": embed.activations,
                 "offloaded_per_block": (seg_input if k else selected.host_bytes) if off else 0,
                 "final_activations": final.activations, "block_params": sum(n_ for n_, *_ in block.params)}
    return MemoryPlan(stages, device_memory, eng.optimizer_path(pp), per_block)


def run_plan(cfg: ExperimentConfig, ds: dict, layout: Layout, device_memory: int,
             tokens: int | None = None) -> MemoryPlan:
    """The memory planner's prediction for a training run's own layout (parallel/plan/cli.py prints the table;
    train.py hands this function to the Trainer, which prints `plan_line` and checks a step against it):
    at the longest bucket of a directory of several shapes, or at a bucket of `tokens` tokens (a step's:
    the memory check compares a step with the plan of its own shape; shapes of equal tokens plan alike)."""
    shaped = [c for _, _, c in bucket_configs(cfg)]
    cfg = next((c for c in shaped if tokens == sequence_tokens(c.model, c.data)), shaped[0])
    tracer = ActivationTracer(cfg, EngineSettings.from_ds(ds, 1).dtype)
    return plan_memory(cfg, ds, layout.dp_size, device_memory, tracer)
