"""The divisibility checker: every split dimension, the grid, the batch and DeepSpeed's own limits.

Runs before any process group or parameter exists and reports every violation at once, each naming
the keys and values involved and the sizes that would work:

    python -m parallel.check --config configs/cogvideox-2b.yaml --set parallel.tp_size=4
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from parallel.experiment import ds_config as dsc
from parallel.experiment.ds_keys import ZERO_QUANTIZED, key_problems
from models.registry import family, sequence_tokens
from parallel.experiment.config import ConfigError, ExperimentConfig, load_config
from parallel.distributed.sequence import padded_length
from parallel.distributed.extensions import check_build_locks
from parallel.distributed.topology import Layout, read_launch_env
from parallel.experiment.splits import (divisors, ring_capable, ring_fits, ring_frames, ring_size, sp_pairs,
                             tp_split_dims, valid_sp_sizes, valid_tp_sizes)
from parallel.experiment.host_memory import host_available, host_problems, uses_host
from parallel.train.schedule import scheduler_problems


@dataclass(frozen=True)
class DeviceDtypes:
    """Which reduced precisions the accelerator a run will use supports (DeepSpeed's own answer)."""

    name: str
    fp16: bool
    bf16: bool
    quantizer: bool = True        # DeepSpeed's QuantizerBuilder kernels (ZeRO++ quantisation): CUDA, Ascend
    capability: Optional[tuple[int, int]] = None     # a CUDA device's compute capability (float8 needs 8.9+)

    @classmethod
    def here(cls) -> "DeviceDtypes":
        """This machine's accelerator (DS_ACCELERATOR or DeepSpeed's auto-detection); imports deepspeed."""
        from deepspeed.accelerator import get_accelerator

        from parallel.distributed import accelerator
        # each accelerator's op_builder package has its own NotImplementedBuilder class (cpu, hpu, xpu, mlu...)
        builder = get_accelerator().create_op_builder("QuantizerBuilder")
        quantizer = builder is not None and type(builder).__name__ != "NotImplementedBuilder"
        return cls(accelerator.name(), accelerator.is_fp16_supported(), accelerator.is_bf16_supported(), quantizer,
                   accelerator.compute_capability())


def _fmt(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes))


def _nearest(sizes: list[int], size: int) -> int:
    """The largest of `sizes` (ascending, starting at 1) not above `size`: the advice keeps as much of the
    asked-for parallelism as works."""
    return max(s for s in sizes if s <= size)


def _check_model_splits(cfg: ExperimentConfig) -> list[str]:
    tp, problems = cfg.parallel.tp_size, []
    for key, value in tp_split_dims(cfg.model).items():
        if value % tp:
            shown = f"{value} (4 x model.hidden_size)" if key == "model.ffn_hidden_size" and \
                cfg.model.ffn_hidden_size is None else str(value)
            sizes = valid_tp_sizes(cfg.model)
            problems.append(f"{key}={shown} is not divisible by parallel.tp_size={tp}; tp sizes that divide "
                            f"every split dimension of this model: {_fmt(sizes)}; set --set parallel.tp_size="
                            f"{_nearest(sizes, tp)}")
    return problems


def _check_objective(cfg: ExperimentConfig) -> list[str]:
    """model.objective among those the family samples (FamilySpec.sampling.samplers)."""
    offered = family(cfg.model).sampling.samplers
    if cfg.model.objective in offered:
        return []
    return [f"model.objective={cfg.model.objective}: model.family={cfg.model.family} samples "
            f"{' or '.join(offered)} only; set --set model.objective={next(iter(offered))}"]


def _pairs_text(pairs: list[tuple[int, int]]) -> str:
    return ", ".join(f"ulysses {u} x ring {r}" for u, r in pairs) or "none"


def _check_sequence(cfg: ExperimentConfig) -> list[str]:
    """Ulysses splits each tp rank's heads over the ulysses ranks inside attention, ring attention passes
    key/value chunks over the ring ranks (the token sequence outside it is padded to a multiple of sp:
    `sequence_padding`)."""
    sp, tp, heads, ring = cfg.parallel.sp_size, cfg.parallel.tp_size, cfg.model.num_heads, cfg.parallel.ring_size
    if heads % tp:                                          # _check_model_splits says it
        return []
    pairs = sp_pairs(cfg)
    if ring is not None and sp % ring:
        return [f"parallel.ring_size={ring} does not divide parallel.sp_size={sp} (sp = ulysses x ring); "
                f"(ulysses, ring) pairs for sp {sp}: {_pairs_text(pairs)}"]
    if ring is not None and ring > 1 and not ring_capable(cfg):
        return [f"parallel.ring_size={ring}: model.family={cfg.model.family}'s attention does not run under ring "
                f"attention (it regroups the sequence); set --set parallel.ring_size=1 with an sp size that divides "
                f"its heads: {_fmt(valid_sp_sizes(cfg))}"]
    frames = ring_frames(cfg)
    if ring is not None and not ring_fits(cfg, sp, ring):
        return [f"parallel.ring_size={ring}: model.family={cfg.model.family}'s ring attention splits whole frames "
                f"(spatial attention within a frame, temporal across frames): parallel.ring_size must divide the "
                f"{frames[0]} latent frames and parallel.sp_size={sp} the {frames[1]:,} tokens; (ulysses, ring) "
                f"pairs for sp {sp}: {_pairs_text(pairs)}"]
    u = sp // ring_size(cfg)
    if (heads // tp) % u == 0:
        return []
    if ring is None:
        return [f"model.num_heads={heads} / parallel.tp_size={tp} = {heads // tp} heads per tp rank is not divisible "
                f"by parallel.sp_size={sp} (attention splits them over sp ranks); sp sizes that work with "
                f"parallel.tp_size={tp}: {_fmt(valid_sp_sizes(cfg))}; set --set parallel.sp_size="
                f"{_nearest(valid_sp_sizes(cfg), sp)}"]
    hint = f"; set --set parallel.ring_size={pairs[-1][1]}" if pairs else ""
    return [f"model.num_heads={heads} / parallel.tp_size={tp} = {heads // tp} heads per tp rank is not divisible "
            f"by the Ulysses degree parallel.sp_size / parallel.ring_size = {sp} / {ring} = {u}; (ulysses, ring) "
            f"pairs that work for sp {sp}: {_pairs_text(pairs)}{hint}"]


def sequence_padding(cfg: ExperimentConfig) -> str:
    """The padding sp adds to the token sequence ("53,266 tokens padded to 53,268 for sp 4"), or ""."""
    sp, tokens = cfg.parallel.sp_size, sequence_tokens(cfg.model, cfg.data)
    padded = padded_length(tokens, sp)
    return f"{tokens:,} tokens padded to {padded:,} for sp {sp}" if padded != tokens else ""


def _check_pipeline(cfg: ExperimentConfig) -> list[str]:
    layers, pp, part = cfg.model.num_layers, cfg.parallel.pp_size, cfg.parallel.pp_partition
    if part is not None:
        if len(part) != pp or sum(part) != layers or min(part) < 1:
            return [f"parallel.pp_partition={part} must list {pp} stage sizes (parallel.pp_size), each >= 1, "
                    f"summing to model.num_layers={layers}"]
        return []
    if layers % pp:
        return [f"model.num_layers={layers} is not divisible by parallel.pp_size={pp}; pp sizes with equal "
                f"stages: {_fmt(divisors(layers))}; set --set parallel.pp_size={_nearest(divisors(layers), pp)}, "
                f"or give parallel.pp_partition (blocks per stage)"]
    return []


def _resolve_dp(cfg: ExperimentConfig, world_size: Optional[int]) -> tuple[int, list[str]]:
    tp, sp, pp, dp = cfg.parallel.tp_size, cfg.parallel.sp_size, cfg.parallel.pp_size, cfg.parallel.dp_size
    if world_size is None:
        return dp or 1, []
    model_size = tp * sp * pp
    keys = "parallel.tp_size x parallel.pp_size" + (" x parallel.sp_size" if sp > 1 else "")
    sizes = f"{tp} x {pp}" + (f" x {sp}" if sp > 1 else "")
    if world_size % model_size:
        return dp or 1, [f"world size {world_size} is not divisible by {keys} = {sizes} = {model_size}; "
                         f"world sizes that work are multiples of {model_size}"]
    derived = world_size // model_size
    if dp is not None and dp != derived:
        shown = f"tp {tp} x pp {pp}" + (f" x sp {sp}" if sp > 1 else "")
        return dp, [f"parallel.dp_size={dp} but world size {world_size} = {shown} x dp {derived}; "
                    f"set --set parallel.dp_size={derived} (or null), or launch {model_size * dp} processes"]
    return derived, []


def _check_batch(cfg: ExperimentConfig, ds: dict, src: str, dp: int) -> list[str]:
    problems, t = [], cfg.train
    ours = {"train_micro_batch_size_per_gpu": ("train.micro_batch_size", t.micro_batch_size),
            "gradient_accumulation_steps": ("train.grad_accum_steps", t.grad_accum_steps)}
    for ds_key, (key, value) in ours.items():
        if ds.get(ds_key, "auto") not in ("auto", value):
            problems.append(f"{src}: {ds_key}={ds[ds_key]} != {key}={value}; remove it from the JSON "
                            f"(the toolkit fills it in from the experiment) or set it to {value}")
    want = cfg.global_batch_size(dp)
    if ds.get("train_batch_size", "auto") not in ("auto", want):
        problems.append(f"{src}: train_batch_size={ds['train_batch_size']} != train.micro_batch_size x "
                        f"train.grad_accum_steps x dp_size = {t.micro_batch_size} x {t.grad_accum_steps} x {dp} "
                        f"= {want}; remove it (it is derived) or set it to {want}")
    return problems


def _check_engine(cfg: ExperimentConfig, ds: dict, src: str) -> list[str]:
    problems, pp = [], cfg.parallel.pp_size
    stage, prec = dsc.zero_stage(ds), dsc.precision(ds)
    if stage not in (0, 1, 2, 3):
        problems.append(f"{src}: zero_optimization.stage={stage}; use 0, 1, 2 or 3")
    if prec == "bf16+fp16":
        problems.append(f"{src}: bf16.enabled and fp16.enabled are both true; enable one of them")
    if pp > 1 and stage >= 2:
        problems.append(f"{src}: zero_optimization.stage={stage} with parallel.pp_size={pp}: DeepSpeed's pipeline "
                        f"engine supports ZeRO stage 0 or 1 only; use stage 1 (ds_configs/zero1_bf16.json) "
                        f"or --set parallel.pp_size=1")
    if stage >= 2 and cfg.model.trained_experts > 1:
        # measured (tests/distributed/test_wan22_idle_expert.py): ZeRO-2 at sp 2 x dp 2 trains other weights than
        # one process; ZeRO-3 fails in the forward of a rank whose micro-batch chose one expert
        problems.append(f"{src}: zero_optimization.stage={stage} with {cfg.model.trained_experts} experts trained "
                        f"together (model.experts.train=both) is refused: each rank runs only the experts its "
                        f"samples chose, so ZeRO-2 receives the gradients in another order on each data-parallel "
                        f"rank and its bucketed reduction mixes them, and ZeRO-3 gathers an expert's weights only "
                        f"while it runs; use stage 1 (or 0), or train one expert per run at any stage (--set "
                        f"model.experts.train=high_noise, then low_noise)")
    if pp == 1 and prec == "bf16" and stage == 0 and dsc.grad_accum_dtype(ds) == "fp32":
        problems.append(f"{src}: bf16 with zero_optimization.stage=0 and data_types.grad_accum_dtype=\"fp32\" is "
                        f"not implemented in DeepSpeed 0.19; use stage 1 (ds_configs/zero1_bf16.json) or drop "
                        f"grad_accum_dtype")
    if pp > 1 and prec == "bf16" and (stage != 1 or dsc.grad_accum_dtype(ds) != "fp32"):
        problems.append(f"{src}: bf16.enabled=true with parallel.pp_size={pp} needs zero_optimization.stage=1 and "
                        f"data_types.grad_accum_dtype=\"fp32\" on DeepSpeed 0.19 (found stage={stage}, "
                        f"grad_accum_dtype={dsc.grad_accum_dtype(ds)!r}); see ds_configs/zero1_bf16.json")
    if cfg.train.recompute is not None and ds.get("activation_checkpointing") is not None:
        problems.append(f"train.recompute={cfg.train.recompute.model_dump()} and {src}: activation_checkpointing "
                        f"both ask for recomputation; keep one: drop the JSON's activation_checkpointing section "
                        f"(train.recompute granularity=block every=1 does the same) or set train.recompute=null")
    optimizer = ds.get("optimizer") or {}
    kind = str(optimizer.get("type", "AdamW"))
    if kind.lower() not in dsc.ADAM_OPTIMIZERS + dsc.EMA_OPTIMIZERS:
        problems.append(f"{src}: optimizer.type={kind!r} is not built by the toolkit; use AdamW, Adam, "
                        f"FusedEmaAdam or EmaAdamW (the last two keep an EMA of the weights)")
    lr = (optimizer.get("params") or {}).get("lr")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float))):
        problems.append(f"{src}: optimizer.params.lr={lr!r}: give a number (train.lr={cfg.train.lr}), \"auto\" "
                        f"(filled from train.lr) or remove it")
    elif lr is not None and float(lr) != cfg.train.lr:
        problems.append(f"{src}: optimizer.params.lr={lr} != train.lr={cfg.train.lr}; the schedule starts from "
                        f"train.lr: set --set train.lr={lr} or remove optimizer.params.lr")
    return problems + scheduler_problems(ds, cfg.train, src) + key_problems(
        ds, src, pp, cfg.train.max_steps, cfg.parallel.tp_size, cfg.parallel.sp_size)


def _check_offload(cfg: ExperimentConfig, ds: dict, src: str) -> list[str]:
    """train.offload_activations moves what checkpoints keep: it needs checkpoints, and does what DeepSpeed's
    cpu_checkpointing does (with partition_activations DeepSpeed keeps its own partitions, which it cannot move)."""
    if not cfg.train.offload_activations:
        return []
    ac = ds.get("activation_checkpointing")
    if cfg.train.recompute is None and ac is None:
        return [f"train.offload_activations=true with train.recompute=null and no activation_checkpointing in "
                f"{src}: it moves the inputs checkpoints keep, and nothing is checkpointed; set --set "
                f"train.recompute.granularity=block (or add the JSON's activation_checkpointing section)"]
    both = [k for k in ("cpu_checkpointing", "partition_activations") if (ac or {}).get(k)]
    if both:
        return [f"train.offload_activations=true and {src}: activation_checkpointing.{' and .'.join(both)}=true both "
                f"decide where checkpoint inputs live; keep one: set {' and '.join(both)} false in the JSON, or "
                f"train.offload_activations=false"]
    return []


def _check_block_swap(cfg: ExperimentConfig, ds: dict, src: str) -> list[str]:
    """train.block_swap moves frozen weights, per pipeline stage (parallel/distributed/block_swap.py): it needs a
    frozen base, weights that DeepSpeed does not own (ZeRO-3 partitions every parameter), at most a stage's blocks,
    uncompiled blocks and one expert a block."""
    n = cfg.train.block_swap
    if not n:
        return []
    key, problems = f"train.block_swap={n}", []
    if cfg.model.lora is None:
        problems.append(f"{key} without model.lora: full fine-tuning trains the blocks' weights, which the optimizer "
                        f"updates on the device every step, and block swap moves frozen weights only; set "
                        f"model.lora.rank (a frozen base with adapters), or keep trainable weights in host memory "
                        f"with ZeRO-3's offload_param (ds_configs/zero3_bf16_offload.json) and train.block_swap=0")
    if dsc.zero_stage(ds) == 3:
        problems.append(f"{key} with zero_optimization.stage=3 in {src}: ZeRO-3 partitions every parameter, the "
                        f"frozen base too, and gathers it for each use; its offload_param keeps those partitions in "
                        f"host memory, as block swap would: use ZeRO-3 with offload_param (ds_configs/"
                        f"zero3_bf16_offload.json) and train.block_swap=0, or block swap with ZeRO stage 0-2")
    layers, pp, part = cfg.model.num_layers, cfg.parallel.pp_size, cfg.parallel.pp_partition
    counts = list(part) if part is not None and len(part) == pp else [layers // pp] * pp
    if n > min(counts):
        problems.append(f"{key} is more than the {min(counts)} blocks of a pipeline stage (model.num_layers={layers} "
                        f"over parallel.pp_size={pp}: {' + '.join(map(str, counts))}): it counts per stage; set "
                        f"--set train.block_swap={min(counts)} or less")
    if cfg.train.compile:
        problems.append(f"{key} with train.compile=true: a swapped layer fetches its weight through an autograd "
                        f"Function that copies between host and device, which a compiled block would break its graph "
                        f"on; set train.compile=false, or train.block_swap=0")
    if cfg.model.trained_experts > 1:
        problems.append(f"{key} with {cfg.model.trained_experts} experts trained (model.experts.train=both): a block "
                        f"holds each expert's weights and a sample uses one, so the next block's copy would often be "
                        f"the wrong expert's; train one expert a run (model.experts.train=high_noise or low_noise), or "
                        f"train.block_swap=0")
    return problems


FLOAT8_CAPABILITY = (8, 9)        # CUDA devices with float8 tensor cores: Ada (L40S, RTX 4090), Hopper (H100, H200)
FLOAT8_DEVICES = "a CUDA device of compute capability 8.9 or above (H100, H200, L40S, RTX 4090)"


def _check_float8(cfg: ExperimentConfig, device: Optional[DeviceDtypes]) -> list[str]:
    """train.float8: what the float8 layers are not combined with, and (with `device`, emulation off) a device with
    float8 tensor cores. torchao itself is load_and_check's (the run's environment)."""
    t = cfg.train
    if t.float8 is None:
        return []
    key, problems = f"train.float8={t.float8}", []
    if cfg.model.lora is not None:
        problems.append(f"{key} with model.lora: LoRA trains adapters beside a frozen base (model.lora.base_dtype=fp8 "
                        f"already stores that base in float8), and the float8 layers are for full fine-tuning; "
                        f"set train.float8=null with model.lora, or drop model.lora to train every weight in float8")
    if device is None or t.float8_emulate:
        return problems
    emulate = "--set train.float8_emulate=true for a slow emulated check of the same casts"
    cap = device.capability
    if device.name == "cuda" and cap is not None and cap >= FLOAT8_CAPABILITY:
        return problems
    if device.name == "cuda":
        have = f"compute capability {cap[0]}.{cap[1]}" if cap else "an unknown compute capability"
        why = f"a CUDA device of {have}, which has no float8 tensor cores (torch._scaled_mm needs 8.9+)"
    elif device.name == "cpu":
        why = "the cpu accelerator, which has no float8 matmul units"
    elif device.name == "npu":
        why = "the npu accelerator: torchao's float8 gemm (torch._scaled_mm) is CUDA's, Ascend NPUs have none"
    else:
        why = f"the {device.name} accelerator, which torchao's float8 training does not support"
    problems.append(f"{key} on {why}; set {emulate}, or run on {FLOAT8_DEVICES}")
    return problems


def _check_device(ds: dict, src: str, device: DeviceDtypes) -> list[str]:
    """bf16 / fp16 against what the accelerator supports: DeepSpeed would otherwise fail inside initialize."""
    fp32 = "fp32 (drop the section, e.g. ds_configs/zero0_fp32.json)"
    problems = []
    if dsc.precision(ds) == "fp16" and not device.fp16:
        bf16 = "bf16 (\"bf16\": {\"enabled\": true}, e.g. ds_configs/zero1_bf16.json)"
        alt = f"{bf16} or {fp32}" if device.bf16 else fp32
        problems.append(f"{src}: fp16.enabled=true but the {device.name} accelerator on this machine has no fp16 "
                        f"(DeepSpeed's is_fp16_supported() is false); use {alt}")
    if dsc.precision(ds) == "bf16" and not device.bf16:
        key = "bf16" if dsc.enabled(ds, "bf16") else "bfloat16"
        alt = f"fp16 (\"fp16\": {{\"enabled\": true}}) or {fp32}" if device.fp16 else fp32
        problems.append(f"{src}: {key}.enabled=true but the {device.name} accelerator on this machine has no bf16 "
                        f"(DeepSpeed's is_bf16_supported() is false); use {alt}")
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    for key in ZERO_QUANTIZED:
        if zero.get(key) is True and not device.quantizer:
            problems.append(f"{src}: zero_optimization.{key}=true but the {device.name} accelerator on this machine "
                            f"has no DeepSpeed quantizer kernels (its QuantizerBuilder is not implemented; DeepSpeed "
                            f"has them for CUDA and Ascend NPUs): run it there, or remove it and use "
                            f"communication_data_type=\"bf16\" (half of fp32's gradient bytes on any device)")
    return problems


def check_torchao(cfg: ExperimentConfig) -> list[str]:
    """train.float8's torchao, importable by this environment (torch imported with it)."""
    from parallel.distributed.float8 import TORCHAO_PIN, torchao_problem
    why = torchao_problem()
    if why is None:
        return []
    return [f"train.float8={cfg.train.float8} needs torchao's float8 training, which this environment cannot import "
            f"({why}); pip install {TORCHAO_PIN} (the version the toolkit is tested with; also pip install "
            f"'video-dit-parallel[float8]'), or set train.float8=null"]


def check_unconditional(cfg: ExperimentConfig) -> list[str]:
    """The unconditional text embedding (T5 of "") of a prepared folder, where caption dropout or guidance
    needs it and no data.text_encoder can encode it; synthetic data has its own."""
    from parallel.experiment.config import UNCOND_FILE
    needs = []
    if cfg.data.caption_dropout > 0 and cfg.data.kind == "directory":
        needs.append((cfg.data.path, f"data.caption_dropout={cfg.data.caption_dropout}", "data.caption_dropout=0"))
    v = cfg.val
    if v.every and v.num_prompts and v.guidance_scale != 1 and v.path:
        needs.append((v.path, f"val.guidance_scale={v.guidance_scale}", "val.guidance_scale=1"))
    problems = []
    for folder, why, off in needs:
        path = Path(folder) / UNCOND_FILE
        if not cfg.data.text_encoder and not path.is_file():
            problems.append(f"{path} does not exist: {why} needs the unconditional text embedding (T5 of the empty "
                            f"prompt); python -m parallel.prepare_data --t5 writes it, or set data.text_encoder to "
                            f"encode it, or set {off}")
    return problems


def check_data_files(cfg: ExperimentConfig) -> list[str]:
    """Directory datasets (data.path, and val.path when validation runs): every listed file exists and its
    shape, read from its header, is what the model takes; synthetic data is made to fit."""
    folders = [("data.path", cfg.data.path)] if cfg.data.kind == "directory" else []
    if cfg.val.every and cfg.val.path:
        folders.append(("val.path", cfg.val.path))
    if not folders and not cfg.data.buckets:
        return []
    missing = [p for key, folder in folders for p in [_folder_problem(key, folder)] if p]
    if missing:                  # the shape and bucket checks would only say the manifest is missing again
        return missing
    from parallel.experiment.manifest import bucket_problems      # the manifest's buckets and data.buckets
    from parallel.train.data import check_shapes
    return bucket_problems(cfg) + _ring_bucket_problems(cfg) + [
        p for key, folder in folders for p in
        check_shapes(folder, cfg.model, cfg.data, key, captions=bool(cfg.data.text_encoder))]


def _ring_bucket_problems(cfg: ExperimentConfig) -> list[str]:
    """A ring of whole frames (STDiT) in every bucket of the manifest: ring_size divides each bucket's latent
    frames and sp its tokens (`ring_fits`; the config's own shape is _check_sequence's)."""
    sp, ring = cfg.parallel.sp_size, ring_size(cfg)
    if ring == 1 or ring_frames(cfg) is None or cfg.data.kind != "directory":
        return []
    from parallel.experiment.manifest import bucket_configs
    from parallel.experiment.shapes import format_shape
    bad = [f"{format_shape(s)} ({ring_frames(c)[0]} latent frames, {ring_frames(c)[1]:,} tokens)"
           for s, _, c in bucket_configs(cfg) if s is not None and not ring_fits(c, sp, ring)]
    if not bad:
        return []
    return [f"{cfg.data.path}: parallel.ring_size={ring}: model.family={cfg.model.family}'s ring attention splits "
            f"whole frames, and these buckets do not split into {ring} (or their tokens into parallel.sp_size={sp}): "
            f"{', '.join(bad)}; set --set parallel.ring_size=1 (Ulysses only) or keep those shapes out of the "
            f"manifest"]


def check_outputs(cfg: ExperimentConfig) -> list[str]:
    """What validation sampling needs (val.every with val.num_prompts): the sampler fits the objective, the
    decoder loads, MP4 has its encoder."""
    v = cfg.val
    if not v.every or not v.num_prompts:
        return []
    from models.sampling import check_sampler
    from parallel.validation.media import load_decoder
    problems = []
    try:
        if check_sampler(cfg.model.objective, v.sampler, family(cfg.model).sampling.samplers) == "opensora" and \
                v.use_dynamic_cfg:
            problems.append("val.use_dynamic_cfg is CogVideoX's guidance; val.sampler=opensora oscillates its own: "
                            "set --set val.use_dynamic_cfg=false, or another sampler")
    except ValueError as e:
        problems.append(f"val.sampler={v.sampler}: {e}")
    try:
        load_decoder(v.decoder)
    except ValueError as e:
        problems.append(f"val.decoder: {e}")
    if "mp4" in v.formats:
        try:
            import imageio_ffmpeg  # noqa: F401
        except ImportError:
            problems.append("val.formats has mp4, which needs imageio-ffmpeg: pip install imageio-ffmpeg, "
                            "or use val.formats=[gif]")
    return problems


def _folder_unusable(path: Path) -> Optional[str]:
    """Why a run cannot write into the folder `path`, or None. Probed with a temporary folder made in it (or in
    its nearest existing parent, when it is still to be created) and removed again: nothing is left behind, and
    a read-only or virtual file system (/proc) answers as it would to the run."""
    path = Path(os.path.abspath(path))
    existing = path
    while not existing.exists():
        existing = existing.parent
    if existing == path and not path.is_dir():
        return "is a file, not a folder"
    if not existing.is_dir():
        return f"cannot be created: {existing} is a file"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".vdp-write-check-", dir=existing))
    except OSError as e:
        return f"cannot be written ({e.strerror})" if existing == path else \
            f"cannot be created in {existing} ({e.strerror})"
    return None


def check_run_dirs(cfg: ExperimentConfig) -> list[str]:
    """train.output_dir and the checkpoint folder (ckpt.dir, default <train.output_dir>/checkpoints): each a folder
    this process can create and write, found now rather than by the first write (the announce after DeepSpeed
    started, the first checkpoint after every step trained)."""
    out, problems = cfg.train.output_dir, []
    default_out = type(cfg.train).model_fields["output_dir"].default
    why = _folder_unusable(Path(out))
    if why:
        fix = f"set --set train.output_dir={default_out} (the default)" if out != default_out and \
            not _folder_unusable(Path(default_out)) else \
            "give train.output_dir a folder this user can create and write"
        problems.append(f"train.output_dir={out} {why}: metrics, samples and (by default) checkpoints are written "
                        f"there; {fix}")
    if cfg.ckpt.dir is None and why:              # its default lies under the output folder, said above
        return problems
    why = _folder_unusable(Path(cfg.ckpt_dir))
    if why:
        key = "ckpt.dir" if cfg.ckpt.dir is not None else f"ckpt.dir (default {out}/checkpoints)"
        fallback = f"{out}/checkpoints"
        fix = f"set --set ckpt.dir=null (the default, {fallback})" if cfg.ckpt.dir is not None and \
            cfg.ckpt.dir != fallback and not _folder_unusable(Path(fallback)) else \
            "give ckpt.dir a folder this user can create and write"
        problems.append(f"{key}={cfg.ckpt_dir} {why}: every checkpoint is written there; {fix}")
    return problems


def check_resume(cfg: ExperimentConfig, layout: Layout, step: Optional[int] = None) -> None:
    """The checkpoint train.py --checkpoint latest (or --checkpoint `step`) continues, found now, before any process
    group: raise ConfigError when ckpt.dir holds one this run cannot continue (parallel.checkpoints.checkpoint.
    find_resume says what is wrong with it and what would work). Sizes only: the checksums are read by
    the run's ranks together (checkpoint.verified_resume)."""
    from parallel.checkpoints.checkpoint import find_resume, model_signature
    saved = {**layout.as_dict(), "zero_stage": layout.zero_stage, "global_batch": layout.global_batch}
    try:
        find_resume(Path(cfg.ckpt_dir), saved, quiet=True, model=model_signature(cfg.model), step=step,
                    release=cfg.model.init_from)
    except ValueError as e:
        raise ConfigError(str(e)) from None


PREPARE = "python -m parallel.prepare_data --config CONFIG --videos VIDEOS --vae VAE --t5 T5 --out {}"


def _folder_problem(key: str, folder: str) -> Optional[str]:
    """A data folder that does not exist, or has no manifest, with the command that makes one (CONFIG: this
    experiment with the same --set; VIDEOS, VAE, T5: the clips and the family's VAE and text encoder)."""
    path, make = Path(folder), PREPARE.format(folder)
    how = (f"{make} prepares it (CONFIG: this experiment, with the same --set; VIDEOS: a folder of clips with "
           f"captions; VAE, T5: the model family's VAE and text encoder folders; docs/data.md)")
    if not path.exists():
        return f"{key}={folder}: no such folder; {how}"
    if not path.is_dir():
        return f"{key}={folder}: not a folder; {how}"
    if not (path / "manifest.jsonl").is_file():
        return f"{key}={folder}: no manifest.jsonl in it (the list of prepared samples); {how}"
    return None


def check(cfg: ExperimentConfig, ds: Optional[dict[str, Any]] = None, ds_source: str = "deepspeed config",
          world_size: Optional[int] = None, device: Optional[DeviceDtypes] = None) -> tuple[Layout, list[str]]:
    """Return the layout and every problem found (an empty list means the layout is valid); with `device`,
    the precision is checked against it too. The layout's verdict, which the planner and its search read: what
    a family cannot run yet (ModelConfig.unsupported) is load_and_check's, a run's."""
    ds = ds or {}
    problems = _check_model_splits(cfg) + _check_objective(cfg) + _check_sequence(cfg) + _check_pipeline(cfg)
    dp, grid_problems = _resolve_dp(cfg, world_size)
    auto = dsc.fill_auto(ds, cfg, ds_source, dp)          # HF's "auto" values, from the experiment
    ds = auto.ds
    problems += grid_problems + auto.problems + _check_batch(cfg, ds, ds_source, dp) + _check_engine(cfg, ds,
                                                                                                    ds_source)
    problems += _check_offload(cfg, ds, ds_source) + _check_block_swap(cfg, ds, ds_source)
    if device is not None:
        problems += _check_device(ds, ds_source, device)
    problems += _check_float8(cfg, device)
    if cfg.train.compile:             # torch imported only for a compiled run
        from parallel.distributed.compile import compile_problems
        problems += compile_problems(True, cfg.train.compile_backend, cpu=device is None or device.name == "cpu")
        if cfg.train.activation_compression is not None:
            # measured (tests/distributed/test_compile_layouts.py): a compiled block saves its tensors inside
            # AOTAutograd's function, where saved_tensors_hooks do not reach: the losses are the uncompressed ones
            problems.append(f"train.activation_compression (dtype {cfg.train.activation_compression.dtype}) with "
                            f"train.compile=true: compiled blocks save their tensors inside AOTAutograd, where the "
                            f"compression hooks do not reach; set train.compile=false to compress, or "
                            f"train.activation_compression=null to compile")
    p = cfg.parallel
    layout = Layout(tp_size=p.tp_size, sp_size=p.sp_size, pp_size=p.pp_size, dp_size=dp, zero_stage=dsc.zero_stage(ds),
                    ring_size=ring_size(cfg) if p.sp_size % ring_size(cfg) == 0 else 1,
                    precision=dsc.precision(ds), global_batch=cfg.global_batch_size(dp))
    return layout, problems


NO_DS_CONFIG = "no --deepspeed-config: DeepSpeed's defaults, its engine keys unchecked"


def summary(cfg: ExperimentConfig, layout: Layout, deepspeed_config: Optional[str] = "") -> str:
    """The one-line verdict; `deepspeed_config` None: the engine is DeepSpeed's default (ZeRO-0 fp32), said so;
    a JSON's "auto" values with what filled each (dsc.fill_auto)."""
    t, tp = cfg.train, layout.tp_size
    filled = dsc.fill_auto(dsc.read_ds_config(deepspeed_config), cfg, deepspeed_config, layout.dp_size).filled \
        if deepspeed_config else []
    splits = ", ".join(f"{k.split('.')[-1]} {v}/{tp}" for k, v in tp_split_dims(cfg.model).items())
    padding = sequence_padding(cfg)
    buckets = ""
    if cfg.data.kind == "directory":
        from parallel.experiment.manifest import bucket_configs
        from parallel.experiment.shapes import format_shape
        found = bucket_configs(cfg)
        if len(found) > 1:               # each bucket's tokens and padding; the first (longest) is planned for
            buckets = "; buckets (longest first, the memory plan's): " + ", ".join(
                f"{format_shape(s)} x {n} -> {sequence_tokens(c.model, c.data):,} tokens"
                + (f" ({sequence_padding(c)})" if sequence_padding(c) else "") for s, n, c in found)
    return (f"ok: {cfg.model.name} {layout.describe()} (world {layout.world_size}), "
            f"ZeRO-{layout.zero_stage} {layout.precision}"
            + (f" ({NO_DS_CONFIG})" if deepspeed_config is None else "") + f", global batch {layout.global_batch} = micro "
            f"{t.micro_batch_size} x accum {t.grad_accum_steps} x dp {layout.dp_size}; tp splits {splits}"
            + (f"; sp pads the sequence: {padding}" if padding else "")
            + (f"; (ulysses, ring) pairs for sp {layout.sp_size}: {_pairs_text(sp_pairs(cfg))}" if layout.sp_size > 1
               else "") + buckets + (f"; \"auto\" filled in {deepspeed_config}: {', '.join(filled)}" if filled else ""))


def load_and_check(config: str, overrides: list[str], deepspeed_config: Optional[str],
                   world_size: Optional[int], device_check: bool = True,
                   run_dirs: bool = False, planner=None, purpose: str = "train") -> tuple[ExperimentConfig, dict, Layout]:
    """Load both files and check them; raise ConfigError listing every problem (used by train.py).
    The dict returned is the JSON with its "auto" values filled in (dsc.fill_auto).

    run_dirs: the folders a training run writes (check_run_dirs). purpose: the command's job ("train", "sample",
    "export", "verify"), which a family that cannot do one yet refuses (ModelConfig.unsupported).

    planner: (cfg, ds, layout, device memory) -> the memory plan (train.py passes parallel/plan/memory.py's
    run_plan; the planner sits above the checker): where the run keeps anything in host memory, the node's
    processes' planned host bytes against what the host has free.

    device_check: bf16/fp16 against this machine's accelerator (asked only when the JSON enables one), and the
    JIT build locks DeepSpeed's start would wait on (a stale one refused, a live one noted: parallel/distributed/
    extensions.py)."""
    problems: list[str] = []
    if device_check:
        problems += check_build_locks(read_launch_env().local_rank)
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        problems.append(str(e))
        cfg = None
    ds: dict = {}
    if deepspeed_config:
        try:
            ds = dsc.read_ds_config(deepspeed_config)
        except ConfigError as e:
            problems.append(str(e))
    if cfg is None:
        raise ConfigError("\n".join(problems))
    src = deepspeed_config or "deepspeed config"
    float8_device = cfg.train.float8 is not None and not cfg.train.float8_emulate
    device = DeviceDtypes.here() if device_check and (float8_device or dsc.precision(dsc.fill_auto(ds, cfg, src).ds)
                                                      != "fp32") else None
    layout, found = check(cfg, ds, src, world_size, device)
    ds = dsc.fill_auto(ds, cfg, src, layout.dp_size).ds        # what the run reads: "auto" filled (check says how)
    # What the family cannot run yet (LTX-2: sampling, export); `check` alone, the planner's verdict on a layout,
    # plans it.
    problems += found + cfg.model.unsupported(cfg, purpose)
    problems += check_unconditional(cfg) + check_data_files(cfg) + check_outputs(cfg)
    if run_dirs:
        problems += check_run_dirs(cfg)
    if cfg.model.init_from:                   # config.json and safetensors headers only, no tensor data
        from parallel.weights.diffusers import check_released
        from parallel.weights.scheduler import check_scheduler
        problems += check_released(cfg.model, cfg.model.init_from) + check_scheduler(cfg.model, cfg.model.init_from)
    if cfg.train.float8 is not None:          # torchao, imported only for a float8 run
        problems += check_torchao(cfg)
    if cfg.model.lora is not None:            # targets against the model built on the meta device
        from parallel.model.lora_check import check_lora
        problems += check_lora(cfg.model)
    if not problems and planner is not None and uses_host(cfg, ds):     # offload: the node's host memory, planned
        plan = planner(cfg, ds, layout, 0)
        problems += host_problems(plan, read_launch_env().local_world_size, host_available())
    if problems:
        raise ConfigError("\n".join(problems))
    return cfg, ds, layout


def parser() -> argparse.ArgumentParser:
    from parallel.experiment.cli import Parser, add_experiment_args, add_world_size

    ap = Parser(prog="python -m parallel.check", description=__doc__.splitlines()[0])
    # --deepspeed-config stays optional here (the model, layout and data checks need none); without it the
    # engine is DeepSpeed's default, ZeRO-0 fp32, and the summary says so.
    add_experiment_args(ap, deepspeed_required=False)
    add_world_size(ap, help="number of processes, every node's together (default: parallel.dp_size, else 1)")
    ap.add_argument("--device-check", action=argparse.BooleanOptionalAction, default=True,
                    help="check bf16/fp16 against this machine's accelerator (--no-device-check when checking "
                         "a run for another machine)")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    # The output is the report alone: DeepSpeed, imported for the device check, logs its accelerator
    # auto-detection to stdout (a refusal names the accelerator itself).
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            cfg, _, layout = load_and_check(args.config, args.overrides, args.deepspeed_config, args.world_size,
                                            args.device_check)
    except ConfigError as e:
        from parallel.experiment.cli import refused
        return refused(parser().prog, str(e))
    print(summary(cfg, layout, args.deepspeed_config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
