"""Layout search: every (tp, sp, pp, dp, ZeRO stage, checkpointing, micro-batch) for a device count, checked
by `parallel.check`, sized by `parallel.plan.memory`, and ranked by an estimated step time.

Step time of one optimizer step (m = train.grad_accum_steps micro-batches of b samples, S tokens,
L blocks of hidden size H, N parameters):

    compute  m b (6 N S + 12 L A H) / (tp sp pp) / (peak x utilisation)  x (1 + f/3) with recompute, f the
             fraction of the blocks' forward FLOPs repeated in backward: 1 with full checkpointing; with
             train.recompute, (checkpointed blocks / L) x the granularity's FLOP fraction, counted on the
             traced block (ActivationTracer.recompute_fraction: attention core, MLP or 1 for a block)
             (A = attention pairs per layer: S^2; STDiT: t (hw)^2 + hw t^2 + 2 S L_text, whose text
             K/V projections, 1/8 of a block's weights, 6 N S counts over S tokens instead of L: an overestimate)
    TP       m (L / pp) (4 [+2 f]) all-reduces of b S/sp H, ring 2 (tp-1)/tp, intra-node bandwidth
             (STDiT: 12 [+6] per layer, 3 row-parallel outputs in each of its two blocks)
    SP       sp = u x r (Ulysses x ring). Ulysses: m (L / pp) a (8 [+4 f]) all-to-alls of b S/sp H/tp (q, k, v,
             out forward and their gradients backward; a = self-attentions per layer), each moving (u-1)/u of
             it, intra-node while tp x u fits a node. Ring: per attention, forward r - 1 key/value chunks
             (2 b S/sp H/tp each) and backward r - 1 more plus r fp32 dK/dV accumulators (`ring_traffic`),
             over the inter-node link when tp x sp spans nodes; each transfer overlaps one chunk's attention
             (4 b (S/sp)(S/r) H/(u tp) FLOPs forward, twice that backward), so only the excess counts.
             STDiT's ring holds whole frames: only its temporal attention rings (one per layer), a query
             meeting T/r keys a chunk (4 b (S/sp)(T/r) H/(u tp) FLOPs to hide behind)
    PP       m x 2 (activation forward, gradient backward) of the stage boundary, p2p
    bubble   (compute + TP + PP) x (m + pp - 1) / m                   (1F1B: bubble (pp-1)/(m+pp-1))
    DP       gradient reduce 2 (d-1)/d x grad bytes once a step over d = dp x sp ranks (ZeRO-3 adds two
             parameter all-gathers per micro-batch), over the inter-node network when the group spans nodes;
             grad bytes in communication_data_type, ZeRO++ (`dp_bytes`): int4 gradients, int8 forward weights,
             and hpz's backward all-gather over (h-1)/h of the weights on the intra-node link

Recomputed collectives are scaled by f too: an approximation for selective recomputation (an attention
core repeats its all-to-alls and no all-reduce, an MLP one all-reduce), exact for whole blocks.
Each layout and ZeRO stage is tried with every recompute option (RECOMPUTE_OPTIONS: none, the JSON's
full checkpointing, attention core, MLP, every second block); activation compression is lossy and so
is never chosen here: the user's train.activation_compression is planned as set. When nothing fits, the offload
options (OFFLOAD_OPTIONS, ZeRO-3 offload) are tried, with LoRA each micro-batch also with the least train.block_swap
that fits it (`fewest_swapped`); parallel/plan/cli.py then tries LoRA's base in fp8 (PASSES).

Layouts are ranked by samples per second (global batch / step time), since the micro-batch and dp
(and so the global batch) differ between layouts.
"""
from __future__ import annotations

import copy
import json
import math
import sys
from dataclasses import dataclass
from typing import Optional

from tqdm import tqdm

from models.registry import family
from parallel.check import check
from parallel.experiment.cli import DS_CONFIG_DIR      # was parallel/ds_configs here: no shipped file ever matched
from parallel.experiment.config import ExperimentConfig, RecomputeConfig
from parallel.distributed.topology import ParallelDims
from parallel.model.build import blocks_per_stage
from parallel.plan.memory import EngineSettings, MemoryPlan, plan_memory
from parallel.plan.trace import ActivationTracer, attention_pairs, ring_of, sequence_length
from parallel.model.recompute import checkpointed_blocks
from parallel.experiment.splits import divisors, ring_fits, ring_frames

MAX_MICRO_BATCH = 64
# (JSON activation_checkpointing on, train.recompute granularity, every): the options the search compares.
RECOMPUTE_OPTIONS = ((True, None, 1), (False, None, 1), (False, "attention", 1), (False, "mlp", 1),
                     (False, "block", 2))
# With `offload` (tried when nothing fits): each train.recompute option that checkpoints, its kept inputs on the host
# (train.offload_activations; the JSON's full checkpointing is block/1 here), and ZeRO-3 with optimizer and
# parameter offload (OFFLOAD_KEYS) beside the user's engine.
OFFLOAD_OPTIONS = ((False, "block", 1), (False, "attention", 1), (False, "mlp", 1), (False, "block", 2))
OFFLOAD_KEYS = {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                "offload_param": {"device": "cpu", "pin_memory": True}}


@dataclass(frozen=True)
class Device:
    """Public peak figures (dense, per device) and link bandwidths per direction, in bytes/s."""

    name: str
    bf16_flops: float
    fp32_flops: float
    intra_bw: float        # within a node (NVLink / HCCS)
    inter_bw: float        # between nodes, per device (InfiniBand / RoCE)
    host_bw: float = float("inf")   # device <-> host memory (PCIe); inf: host copies cost nothing


# host_bw: the datasheets' PCIe figure per direction (A100 SXM "PCIe Gen4: 64 GB/s", H100 / H200 SXM "PCIe Gen5:
# 128 GB/s", both directions together); Ascend 910B assumed PCIe 4.0 x16.
DEVICES = {
    "a100-80gb": Device("NVIDIA A100 80GB SXM", 312e12, 19.5e12, 300e9, 25e9, 32e9),      # NVLink3, 8 x HDR 200G
    "h100-80gb": Device("NVIDIA H100 80GB SXM", 989e12, 67e12, 450e9, 50e9, 64e9),        # NVLink4, 8 x NDR 400G
    "h200": Device("NVIDIA H200 141GB SXM", 989e12, 67e12, 450e9, 50e9, 64e9),
    "ascend-910b": Device("Huawei Ascend 910B", 313e12, 313e12 / 4, 196e9, 25e9, 32e9),   # HCCS, 200G RoCE; fp32 1/4
    "cpu": Device("CPU (nominal)", 1e12, 1e12, 10e9, 1e9, 10e9),
}


@dataclass
class StepTime:
    compute: float
    tp: float
    pp: float
    dp: float
    sp: float
    bubble: float          # seconds lost to the pipeline bubble
    total: float
    samples_per_s: float
    host: float = 0.0      # host copies not hidden behind compute (host_time)


def count_params(tracer: ActivationTracer) -> tuple[int, int]:
    """(all parameters of one model replica, block parameters) counted on the tp = 1 build."""
    num_layers = tracer.cfg.model.num_layers
    # model.lora.base_dtype: the fp8 weights are buffers, not parameters; they count (and multiply) all the same
    blocks = sum(n for n, *_ in tracer.layer_parameters(0, num_layers, 1)[0]) + tracer.layer_fp8(0, num_layers, 1)[1]
    ends = sum(n for kind in ("embed", "final") for n, *_ in tracer.trace(kind, 1, 1).params) + \
        sum(tracer.trace(kind, 1, 1).fp8_numel for kind in ("embed", "final"))
    return blocks + ends, blocks


# DeepSpeed 0.19's ZeRO++: weights int8 in groups of under 8,000 elements (CUDAQuantizer.target_group_size, "the
# optimal size is 4k"), gradients int4 (all_to_all_quant_reduce's swizzle_quant(..., 4, ...)); one fp32 scale a group
QUANT_GROUP = 4096


def dp_bytes(eng: EngineSettings, params: int) -> tuple[float, float, float]:
    """Bytes of the tensors data parallelism moves per step (before the ring factor), for `params` weights:
    the gradient reduction, and (ZeRO-3) one forward and one backward weight all-gather per micro-batch.

    gradients      params x communication_data_type's size (bf16 halves fp32); ZeRO++ qgZ: int4 + scales
    forward gather params x the weights' size; ZeRO++ qwZ: int8 + one fp32 scale per QUANT_GROUP (~1/2 of bf16)
    backward       params x the weights' size (hpz changes its link, not its size)
    """
    scale = 4 / QUANT_GROUP
    grads = params * (0.5 + scale if eng.quantized_gradients else eng.comm_bytes)
    forward = params * (1 + scale if eng.quantized_weights else eng.lp)
    return grads, forward, params * eng.lp


def ring_traffic(chunk_bytes: int, ring: int, lp: int) -> tuple[int, int]:
    """Bytes one rank sends per ring attention (parallel/distributed/ring.py), forward and backward, for a
    chunk of `chunk_bytes` (b x S/sp x H/tp in lp bytes an element: this rank's q, or its k, or its v): forward
    r - 1 key/value chunks (2 chunks each); backward r - 1 key/value chunks again and r fp32 dK/dV accumulators."""
    kv = 2 * chunk_bytes
    return (ring - 1) * kv, (ring - 1) * kv + ring * kv * 4 // lp


def host_time(host: dict[str, int], offloaded: int, eng: EngineSettings, m: int, compute: float,
              device: Device, swapped_share: float = 0.0) -> float:
    """Seconds of one step's host <-> device copies (the worst stage's `host` lines, bytes) left over after
    compute. train.offload_activations: `offloaded` bytes a micro-batch down in forward and up in backward, on a
    side stream, hidden behind that micro-batch's compute where the link keeps up (DeepSpeed's cpu_checkpointing
    alike). train.block_swap: the swapped blocks' weights (`host["block_swap"]`) up twice a micro-batch (forward,
    backward), each block's copy while its neighbour computes: hidden behind the swapped blocks' share of the
    stage's compute (`swapped_share`: swapped / stage blocks); the two share the link, which is not modelled.
    ZeRO-3 parameter offload:
    the parameter partitions up in forward and in backward, each micro-batch; optimizer offload: the lp gradient
    partition down and the updated lp weights up once a step (master weights 4 B an element: elements =
    master / 4). Neither overlapped, and the host optimizer's own time is not modelled."""
    activations = m * max(2 * offloaded / device.host_bw - compute / m, 0.0)
    activations += m * max(2 * host.get("block_swap", 0) / device.host_bw - swapped_share * compute / m, 0.0)
    params = m * 2 * host.get("parameters", 0) / device.host_bw if eng.offload_param and eng.zero == 3 else 0.0
    states = 2 * eng.lp * host.get("master_weights", 0) / 4 / device.host_bw if eng.offload_optimizer else 0.0
    return activations + params + states


def estimate_step_time(cfg: ExperimentConfig, eng: EngineSettings, dp: int, device: Device, per_node: int,
                       utilisation: float, tracer: ActivationTracer, stage_params: int,
                       memory: Optional[MemoryPlan] = None) -> StepTime:
    """The step time of the module docstring; with `memory` (the layout's plan) its host copies too."""
    m_cfg, t = cfg.model, cfg.train
    tp, pp, m, b = cfg.parallel.tp_size, cfg.parallel.pp_size, t.grad_accum_steps, t.micro_batch_size
    sp = cfg.parallel.sp_size
    trace = tracer.trace("block", tp, b, sp)
    seq = sequence_length(cfg)
    n_all, n_blocks = count_params(tracer)
    f = recompute_fraction(cfg, eng, tracer)
    block_flops = 6 * n_blocks * seq + 12 * m_cfg.num_layers * attention_pairs(cfg) * m_cfg.hidden_size
    flops = b * (block_flops * (1 + f / 3) + 6 * (n_all - n_blocks) * seq)
    peak = device.bf16_flops if eng.lp == 2 else device.fp32_flops
    compute = m * flops / (tp * sp * pp) / (peak * utilisation)
    ring = lambda n: 2 * (n - 1) / n  # (bytes moved per device by a ring all-reduce, x size)
    tp_time = 0.0
    if tp > 1:
        row_parallel = family(m_cfg).row_parallel(m_cfg)        # b S H all-reduces per layer's forward
        per_block = row_parallel * (2 + f) * ring(tp) * trace.input_bytes / device.intra_bw
        tp_time = m * (m_cfg.num_layers / pp) * per_block
    sp_time = 0.0
    if sp > 1:
        r = ring_of(cfg, tp, sp)
        u = sp // r
        attentions = family(m_cfg).costs.attentions_per_layer
        # A ring of whole frames (STDiT): only temporal attention rings, a query meeting T / r keys a chunk.
        frames = ring_frames(cfg)
        rings, keys = (attentions, seq / r) if frames is None else (1, frames[0] / r)
        per_layer = 0.0
        if u > 1:                    # Ulysses peers are neighbouring ranks: inside a node while tp x u fits one
            link = device.inter_bw if tp * u > per_node else device.intra_bw
            per_layer += attentions * (8 + 4 * f) * (u - 1) / u * trace.input_bytes / tp / link
        if r > 1:                    # what ring traffic the chunk's attention does not hide
            chunk_attention = 4 * b * (seq / sp) * keys * m_cfg.hidden_size / (u * tp) / (peak * utilisation)
            fwd, bwd = ring_traffic(trace.input_bytes // tp, r, eng.lp)
            link = device.inter_bw if tp * sp > per_node else device.intra_bw
            per_layer += rings * ((1 + f) * max(fwd / link - (r - 1) * chunk_attention, 0.0)
                                  + max(bwd / link - 2 * (r - 1) * chunk_attention, 0.0))
        sp_time = m * (m_cfg.num_layers / pp) * per_layer
    pp_time = 0.0
    if pp > 1:
        link = device.inter_bw if tp * sp * dp >= per_node else device.intra_bw    # stages are the outer axis
        pp_time = m * 2 * (trace.input_bytes + trace.side_total) / link
    dp_time, d = 0.0, dp * sp
    if d > 1:
        link = device.inter_bw if tp * d > per_node else device.intra_bw
        grads, forward_gather, backward_gather = dp_bytes(eng, stage_params)
        dp_time = ring(d) * grads / link
        if eng.zero == 3:            # two all-gathers per micro-batch, each moving (d-1)/d of the weights
            h = eng.hpz if eng.hpz > 1 else d              # hpz: backward gathers from the node's secondary copy
            backward_link = device.intra_bw if eng.hpz > 1 else link
            dp_time += m * ((d - 1) / d * forward_gather / link + (h - 1) / h * backward_gather / backward_link)
    host = 0.0
    if memory is not None:
        worst = memory.worst
        host = host_time(worst.host, worst.host.get("activations", 0) // worst.in_flight, eng, m, compute, device,
                         min(cfg.train.block_swap, worst.blocks) / max(worst.blocks, 1))
    work = compute + tp_time + sp_time + pp_time
    total = work * (m + pp - 1) / m + dp_time + host
    return StepTime(compute, tp_time, pp_time, dp_time, sp_time, work * (pp - 1) / m, total, b * m * dp / total, host)


def recompute_fraction(cfg: ExperimentConfig, eng: EngineSettings, tracer: ActivationTracer) -> float:
    """f of the module docstring: the share of the blocks' forward FLOPs that backward repeats."""
    rc = cfg.train.recompute
    if eng.checkpoint_every:
        return 1.0
    if rc is None:
        return 0.0
    tp, sp, layers = cfg.parallel.tp_size, cfg.parallel.sp_size, cfg.model.num_layers
    return tracer.recompute_fraction(rc.granularity, tp, sp) * checkpointed_blocks(layers, rc.every) / layers


def ds_variant(ds: dict, zero: int, checkpointing: bool) -> dict:
    """The user's DeepSpeed JSON with another ZeRO stage and checkpointing on or off.

    bf16 with ZeRO-1 gets fp32 gradient accumulation (BF16_Optimizer, which the pipeline needs); the
    other stages drop it, as ds_configs/zero{2,3}_bf16.json do (DeepSpeed 0.19 raises
    NotImplementedError for bf16 + ZeRO-0 + fp32 accumulation).
    """
    out = copy.deepcopy(ds)
    z = out.setdefault("zero_optimization", {})
    z["stage"] = zero
    for key in list(z):
        if (key.startswith("stage3_") or key.startswith("offload_param")) and zero != 3 \
                or key in ("overlap_comm", "contiguous_gradients", "offload_optimizer") and zero == 0:
            z.pop(key)
    if out.get("bf16", {}).get("enabled"):
        if zero == 1:
            out["data_types"] = {**out.get("data_types", {}), "grad_accum_dtype": "fp32"}
        elif "data_types" in out:
            out["data_types"].pop("grad_accum_dtype", None)
            if not out["data_types"]:
                out.pop("data_types")
    if checkpointing:
        out.setdefault("activation_checkpointing", {"partition_activations": False, "cpu_checkpointing": False,
                                                     "contiguous_memory_optimization": False,
                                                     "number_checkpoints": None})
    else:
        out.pop("activation_checkpointing", None)
    return out


def shipped_config(ds: dict) -> Optional[str]:
    """The ds_configs/ file equal to `ds`, if there is one."""
    for path in sorted(DS_CONFIG_DIR.glob("*.json")):
        if json.loads(path.read_text()) == ds:
            return f"ds_configs/{path.name}"
    return None


@dataclass
class Candidate:
    dims: ParallelDims
    zero: int
    checkpointing: bool
    micro_batch: int
    cfg: ExperimentConfig
    ds: dict
    memory: MemoryPlan
    time: Optional[StepTime] = None

    @property
    def recompute(self) -> str:
        """on (the JSON's full checkpointing), off, or train.recompute's granularity (/every when > 1)."""
        rc = self.cfg.train.recompute
        if rc is None:
            return "on" if self.checkpointing else "off"
        swap = self.cfg.train.block_swap
        fp8 = self.cfg.model.lora is not None and self.cfg.model.lora.base_dtype is not None
        return rc.granularity + (f"/{rc.every}" if rc.every > 1 else "") \
            + ("+host" if self.cfg.train.offload_activations else "") + (f"+swap{swap}" if swap else "") \
            + ("+fp8" if fp8 else "")

    @property
    def overrides(self) -> list[str]:
        d, rc = self.dims, self.cfg.train.recompute
        recompute = [f"train.recompute.granularity={rc.granularity}"] + \
            ([f"train.recompute.every={rc.every}"] if rc.every > 1 else []) if rc is not None else []
        return [f"parallel.tp_size={d.tp_size}", f"parallel.pp_size={d.pp_size}"] \
            + ([f"parallel.sp_size={d.sp_size}"] if d.sp_size > 1 else []) \
            + ([f"parallel.ring_size={d.ring_size}"] if d.ring_size > 1 else []) \
            + [f"train.micro_batch_size={self.micro_batch}"] + recompute \
            + (["train.offload_activations=true"] if self.cfg.train.offload_activations else []) \
            + ([f"train.block_swap={self.cfg.train.block_swap}"] if self.cfg.train.block_swap else []) \
            + ([f"model.lora.base_dtype={self.cfg.model.lora.base_dtype}"]
               if self.cfg.model.lora is not None and self.cfg.model.lora.base_dtype else [])

    @property
    def host_memory(self) -> int:
        """Host bytes one process needs (its stage's, the most of any stage)."""
        return max(sum(stage.host.values()) for stage in self.memory.stages)


@dataclass
class SearchResult:
    ranked: list[Candidate]           # fitting, fastest first
    not_fitting: list[Candidate]      # valid layouts whose micro-batch 1 does not fit
    invalid: list[tuple[dict, list[str]]]


def sp_split(heads: int, tp: int, sp: int, node: int, ring_ok: bool = True) -> tuple[int, int]:
    """(ulysses, ring) for sp at tp: the largest Ulysses degree that divides sp, the heads of a tp rank and
    the node's devices left by tp, ring the rest; (sp, 1) when the family takes no ring (the checker then says
    whether the heads allow it)."""
    if not ring_ok or heads % tp:
        return sp, 1
    u = max(u for u in divisors(sp) if (heads // tp) % u == 0 and (node // tp) % u == 0)
    return u, sp // u


def zero3_offload(ds: dict) -> dict:
    """ds at ZeRO-3 with the optimizer and the parameters offloaded to the host (the user's offload keys kept)."""
    out = ds_variant(ds, 3, False)
    z = out["zero_optimization"]
    for key, value in OFFLOAD_KEYS.items():
        if (z.get(key) or {}).get("device", "none") == "none":
            z[key] = dict(value)
    return out


def engine_options(ds: dict, zero: int, offload: bool) -> list[tuple[dict, bool, tuple]]:
    """(DeepSpeed JSON, its activation_checkpointing on, the recompute options) the search tries at `zero`."""
    if not offload:
        return [(ds_variant(ds, zero, ckpt), ckpt, (ckpt, g, e)) for ckpt, g, e in RECOMPUTE_OPTIONS]
    found = [(ds_variant(ds, zero, False), False, (False, g, e)) for _, g, e in OFFLOAD_OPTIONS]
    if zero == 3 and zero3_offload(ds) != found[0][0]:      # unless the user's JSON offloads both already
        found += [(zero3_offload(ds), False, (False, g, e)) for _, g, e in OFFLOAD_OPTIONS]
    return found


def with_block_swap(cfg: ExperimentConfig, n: int) -> ExperimentConfig:
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"block_swap": n})})


def fewest_swapped(cfg: ExperimentConfig, ds: dict, dp: int, device_memory: int, tracer: ActivationTracer,
                   margin: float, workspace: int) -> tuple[ExperimentConfig, MemoryPlan]:
    """cfg with the least train.block_swap at which it fits and its plan (the device bytes fall as N grows: a
    binary search), or with the most a stage allows, which does not fit."""
    plan = lambda n: plan_memory(with_block_swap(cfg, n), ds, dp, device_memory, tracer, margin, workspace)
    low, high = 1, min(blocks_per_stage(cfg))
    if not plan(high).fits:
        return with_block_swap(cfg, high), plan(high)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if plan(mid).fits else (mid + 1, high)
    return with_block_swap(cfg, low), plan(low)


def with_layout(cfg: ExperimentConfig, dims: ParallelDims, micro_batch: int,
                recompute: Optional[tuple] = None, offload: bool = False) -> ExperimentConfig:
    """cfg at this layout and micro-batch; `recompute` (granularity, every) sets train.recompute (None: off);
    `offload`: train.offload_activations."""
    parallel = cfg.parallel.model_copy(update={"tp_size": dims.tp_size, "pp_size": dims.pp_size,
                                               "sp_size": dims.sp_size, "dp_size": None,
                                               "ring_size": dims.ring_size if dims.ring_size > 1 else None,
                                               "pp_partition": None})
    rc = None if recompute is None else RecomputeConfig(granularity=recompute[0], every=recompute[1])
    train = cfg.train.model_copy(update={"micro_batch_size": micro_batch, "recompute": rc,
                                         "offload_activations": offload})
    return cfg.model_copy(update={"parallel": parallel, "train": train})


def search(cfg: ExperimentConfig, ds: dict, devices: int, per_node: int, device_memory: int, device: Device,
           tracer: ActivationTracer, utilisation: float = 0.4, margin: float = 0.10,
           workspace: int = 2 ** 30, source: str = "deepspeed config", progress: bool = False,
           offload: bool = False, swap: bool = False) -> SearchResult:
    """Every layout of `devices` devices; tp and Ulysses stay within a node (tp x ulysses divides the devices per
    node). Each sp runs as `sp_split` gives it: Ulysses as far as the heads and the node allow, ring for the
    rest (only for families whose attention takes a ring), so ring opens the sp sizes Ulysses cannot reach:
    head counts it does not divide, and sequence groups across nodes. `progress`: a bar of the (tp, sp, pp)
    grids on stderr. `offload`: the OFFLOAD_OPTIONS instead of RECOMPUTE_OPTIONS (engine_options). `swap` (LoRA): a
    micro-batch that does not fit is tried with the least train.block_swap that fits it (`fewest_swapped`) where the
    checker takes block swap (ZeRO 0-2: ZeRO-3 owns the frozen base)."""
    node = min(devices, per_node)
    ranked, not_fitting, invalid = [], [], []
    ring_ok = getattr(type(cfg.model), "RING_ATTENTION", True)
    grids = []
    for tp, sp in ((t, s) for t in divisors(node) for s in divisors(devices // t)):
        ulysses, ring = sp_split(cfg.model.num_heads, tp, sp, node, ring_ok)
        if ring == 1 and (node // tp) % sp:            # Ulysses alone stays in a node
            continue
        if not ring_fits(cfg, sp, ring):                # STDiT's ring: whole frames per chunk
            continue
        grids += [(tp, sp, ring, p) for p in divisors(devices // (tp * sp)) if p <= cfg.model.num_layers]
    for tp, sp, ring, pp in tqdm(grids, desc="search", unit="grid", file=sys.stderr, dynamic_ncols=True,
                                 disable=not progress):
        dp = devices // (tp * sp * pp)
        dims = ParallelDims(tp_size=tp, sp_size=sp, pp_size=pp, dp_size=dp, ring_size=ring)
        for zero in range(4):
            swapping = False
            for n, (ds_l, checkpointing, (_, granularity, every)) in enumerate(engine_options(ds, zero, offload)):
                rc = (granularity, every) if granularity else None
                cfg_l = with_layout(cfg, dims, 1, rc, offload)
                # The verdict does not depend on the recompute option (ds_variant drops the JSON's section
                # whenever train.recompute is set): checked and reported once. Block swap checked by itself.
                where = f"{source} at zero_optimization.stage={zero}"
                problems = [] if n else check(cfg_l, ds_l, where, devices)[1]
                if not n and swap and not problems:
                    swapping = not check(with_block_swap(cfg_l, 1), ds_l, where, devices)[1]
                if problems:
                    invalid.append(({"tp": tp, "sp": sp, "pp": pp, "dp": dp, "zero": zero,
                                     **({"ring": ring} if ring > 1 else {})}, problems))
                    break
                best = None
                for b in (2 ** i for i in range(int(math.log2(MAX_MICRO_BATCH)) + 1)):
                    cfg_b = with_layout(cfg, dims, b, rc, offload)
                    memory = plan_memory(cfg_b, ds_l, dp, device_memory, tracer, margin, workspace)
                    if swapping and not memory.fits:
                        cfg_b, memory = fewest_swapped(cfg_b, ds_l, dp, device_memory, tracer, margin, workspace)
                    cand = Candidate(dims, zero, checkpointing, b, cfg_b, ds_l, memory)
                    if not memory.fits:
                        if best is None:
                            not_fitting.append(cand)
                        break
                    best = cand
                if best is not None:
                    eng = EngineSettings.from_ds(best.ds, cfg.model.num_layers)
                    stage_params = max(stage.params for stage in best.memory.stages)
                    best.time = estimate_step_time(best.cfg, eng, dp, device, per_node, utilisation, tracer,
                                                   stage_params, best.memory)
                    ranked.append(best)
    ranked.sort(key=lambda c: -c.time.samples_per_s)
    return SearchResult(ranked, not_fitting, invalid)
