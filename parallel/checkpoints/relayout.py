"""A layout-free copy of the training state, written by every rank beside DeepSpeed's checkpoint and read
back when a run resumes on another (tp, sp, pp, dp, ZeRO stage) layout.

Why not DeepSpeed's universal checkpoint: 0.19's `ds_to_universal` needs `universal_checkpoint_info` and
tensor-parallel patterns set on the module, merges fused-QKV shards as one column split (wrong for
[Wq_i; Wk_i; Wv_i] shards), and is a separate offline pass over every file by one process. The toolkit
already knows how its shards sit in the full tensors (parallel/distributed/layers.py), so it writes them that way.

What is written (`step{N}/layout_free/`, listed in the checkpoint's marker like every other file, so the
copy is published atomically and damage-checked with the rest):
    rank{R:05d}.safetensors  tensors `{canonical name}::{kind}`, kind = param (the fp32 master weight; a frozen
                             parameter in fp32; a buffer in its own dtype) or an optimizer state key
                             (exp_avg, exp_avg_sq, ema, ...), each the full tensor-parallel shard of rank R's
                             tp rank: ZeRO partitions are gathered over the data-parallel group first
                             (DeepSpeed's safe_get_full_* accessors), and the shards of one (stage, tp
                             rank) are spread over its data-parallel ranks, tensor i written by data rank
                             i mod (dp x sp), so every rank writes a part and none holds more than its own
                             tp shard. Replicated parameters and buffers are written by tp rank 0 only (a
                             replicated buffer whose bytes differ between the tp ranks by each of them,
                             and read back at that tp size only). The header's `index` says, per name, how
                             the shard sits in the full tensor: partition dim, the full sizes of its fused
                             parts along it ([q, k, v] or one), tp size and rank.
    state.json               (rank 0) step, optimizer step count, the LR schedule's position, the global
                             sample index (step x global batch), the layout and the state keys; a model
                             of several experts: each expert's step count (an expert sits out a step
                             none of whose samples chose it), an expert never stepped written with zero
                             moments and its EMA at its weights.

Reading at another layout (`load`): each rank builds its model and DeepSpeed engine for the new layout,
reads every file's header, and for each of its parameters and buffers reads only the slices of the old shards
that overlap its own shard (safetensors' partial reads), part by part (the arithmetic: parallel/checkpoints/slicing.py).

Buffers are part of the state too: the frozen base of a LoRA run with model.lora.base_dtype (each tensor-parallel
layer's fp8 `weight`, split like the weight it replaced, and its `weight_scale`, one fp32 scale over the full weight,
so the same on every tp rank: parallel/distributed/layers.py), and a family's stored tables (CogVideoX's norm_k_bias,
the 5B-I2V's pos_embedding), which model.init_from fills and a resume, not reading it, would otherwise leave at their
initial values. The fp8 shards are re-cut for the new tp like any split tensor and keep the scale, so the base is
the one the run trained against, bit for bit; the tensor-parallel marks of a buffer come from its layer
(layers.tp_marks: a device move re-makes buffers without attributes). A frozen base kept as parameters (LoRA
without base_dtype, block swap's host-resident weights, which are read and written in host memory, their device
copies dropped) is restored as every parameter is. A LoRA run whose checkpoints leave the base in its release
(parallel/checkpoints/lora_base.py) writes its trained tensors only (state.json: "lora_base": "release"), and a resume
keeps the base build_trainer read from the release.

It then hands the tensors to DeepSpeed: the module weight (gathered and re-partitioned under ZeRO-3), the
fp32 master and each optimizer state through safe_set_full_fp32_param / safe_set_full_optimizer_state
(ZeRO 1/2/3, BF16_Optimizer: every rank keeps the fragment it owns), or the optimizer's own state (ZeRO-0).
The step count of every optimizer state, the LR schedule (last_epoch, hence the learning rate) and the
engine's step and sample counters are set from state.json.

Random state: nothing to carry but LoRA's dropout. The data order, each sample's noise and timestep and caption
dropout are drawn from (seed, step, global sample position) (parallel/train/data.py), the models themselves have no
dropout, and no other training step draws from a process's global RNG, so the continuation sees what the
uninterrupted run would. model.lora.dropout > 0 draws the adapters' input masks from each rank's generators, one
stream per (stage, dp, sp) coordinate shared by its tp ranks (parallel/distributed/seed.py training_seed): a resume
restores them where the streams are the writer's, at the same layout or another tp size or ZeRO stage
(parallel/checkpoints/rng.py); at another dp, sp or pipeline partition the masks' shapes and owners change, each
rank keeps the stream build_trainer seeded for its new coordinate, and the run continues the uninterrupted one in
distribution, not number for number (docs/lora.md has the measured difference).

The global batch must stay the same across the change (it fixes the sample positions of a step and the meaning of
`step` for the schedule); parallel.checkpoints.checkpoint.find_resume refuses otherwise.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param,
                             safe_set_full_optimizer_state)

from parallel.checkpoints.slicing import Slicing, assemble, local_shape, slicing_of
from parallel.distributed.deepspeed.optimizer import relink_optimizer_fragments, stepped_params, zero_holds_master
from parallel.distributed.deepspeed.zero3 import is_partitioned
from parallel.distributed.layers import marked_buffers
from parallel.distributed.pipeline import canonical_name
from parallel.distributed.replicas import checksum_mismatches
from parallel.model.build import expert_of_parameter

FOLDER = "layout_free"
STATE = "state.json"
PARAM = "param"


def module_tensors(module: torch.nn.Module):
    """(name, tensor, tp marks or None for its own, trained) of every parameter and buffer: what the copy holds."""
    for name, p in module.named_parameters():
        yield name, p, None, p.requires_grad
    for name, b, marks in marked_buffers(module):
        yield name, b, marks, False


# ---------------------------------------------------------------------------------------------- writing

def _state_keys(optimizer) -> list[str]:
    """The optimizer's per-element state (exp_avg, exp_avg_sq, ema, ...), the same on every rank."""
    keys = {k for st in optimizer.state.values() for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(keys))
    return sorted(set().union(*everyone))


def _optimizer_step(optimizer) -> int:
    steps = [int(st["step"]) for st in optimizer.state.values() if "step" in st]
    n = torch.tensor(max(steps, default=0), dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n)


def _expert_steps(optimizer, experts: int) -> dict[str, int]:
    """A model of several experts (parallel/train/optim.py): each expert's step count, which differ once an
    expert sat out an update ({"0": n0, "1": n1}; {} for a model of none)."""
    if not experts:
        return {}
    n = torch.zeros(experts, dtype=torch.int64)
    for g in optimizer.param_groups:
        for q in g["params"]:
            if g.get("expert") is not None and "step" in optimizer.state[q]:
                n[g["expert"]] = max(int(n[g["expert"]]), int(optimizer.state[q]["step"]))
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return {str(e): int(v) for e, v in enumerate(n)}


def _unstepped_value(param, optimizer, key: str) -> torch.Tensor:
    """The state of an expert never stepped yet (no state anywhere): zero moments, the EMA at the weights (its
    first update's start), as its first step would create them."""
    if key == "ema":
        return _full_value(param, optimizer, None).clone()
    return torch.zeros(local_shape(param), dtype=torch.float32)


def _full_value(param, optimizer, key: Optional[str]) -> torch.Tensor:
    """The fp32 tp shard of the master weight (key None) or of an optimizer state, gathered over ZeRO's
    data-parallel partitions (a collective under ZeRO 1/2/3; each data rank gets the same tensor)."""
    if zero_holds_master(param):
        value = safe_get_full_fp32_param(param) if key is None else safe_get_full_optimizer_state(param, key)
    else:                                       # ZeRO-0: the optimizer holds the parameter itself
        value = param if key is None else optimizer.state[param].get(key, torch.zeros_like(param))
    return value.detach().float().reshape(local_shape(param)).cpu()


def _supported(engine, optimizer) -> bool:
    """True on every rank when each trainable parameter's master and state are reachable: through
    DeepSpeed's fragment mapping (ZeRO 1/2/3, BF16_Optimizer) or as the optimizer's own parameter
    (fp32 ZeRO-0). fp16 ZeRO-0 (FP16_Optimizer's private fp32 copies) is not: no copy is written then."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    ok = all(zero_holds_master(p) or id(p) in held
             for p in engine.module.parameters() if p.requires_grad)
    flag = torch.tensor(int(ok))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag)


def _frozen_value(param) -> torch.Tensor:
    """A frozen parameter in fp32 (gathered under ZeRO-3), a buffer in its own dtype (the fp8 base's codes)."""
    if is_partitioned(param):
        import deepspeed
        with deepspeed.zero.GatheredParameters([param]):
            return param.detach().float().cpu().clone()
    return param.detach().float().cpu() if isinstance(param, torch.nn.Parameter) else param.detach().cpu()


def _differing_buffers(module: torch.nn.Module, ctx) -> set[str]:
    """The replicated buffers whose bytes differ between the ranks of this tp group, which each tp rank then writes
    (the same set on every rank of the group). None should: an fp8 base whose scales a toolkit before this one took
    per tp shard (a run started then and resumed at its layout since) is the case this keeps from being read back
    with one rank's scale at another tp."""
    return checksum_mismatches(((name, b) for name, b, marks in marked_buffers(module)
                                if not marks.get("tensor_model_parallel")), ctx)


@torch.no_grad()
def collect(trainer, base: bool = True) -> Optional[dict]:
    """This rank's part of the layout-free copy, gathered in memory (every collective is here, none in
    `write`, so a rank whose disk write fails leaves no other rank waiting in one); None where the
    optimizer is not supported (every rank agrees). `base` False: the trained tensors only, a LoRA run's frozen
    base left in its release (parallel/checkpoints/lora_base.py)."""
    engine, optimizer, ctx = trainer.engine, trainer.optimizer, trainer.ctx
    if not _supported(engine, optimizer):
        return None
    relink_optimizer_fragments(engine.optimizer)
    keys = _state_keys(optimizer)
    experts = _expert_steps(optimizer, trainer.experts)
    differ = _differing_buffers(engine.module, ctx) if base else set()
    tensors, index = {}, {}
    for i, (name, p, marks, trained) in enumerate(t for t in module_tensors(engine.module) if base or t[3]):
        slicing = slicing_of(p, ctx.tp_size, ctx.tp_rank, marks)
        mine = i % ctx.data_size == ctx.data_rank and (slicing.dim is not None or ctx.tp_rank == 0 or name in differ)
        canonical = canonical_name(name, trainer.cfg.model.num_layers)
        if not (mine or trained or is_partitioned(p)):       # no collective to join: nothing to copy off the device
            continue
        unstepped = experts.get(str(expert_of_parameter(name))) == 0
        for key in [None, *keys] if trained else [None]:
            value = _frozen_value(p) if not trained else _unstepped_value(p, optimizer, key) \
                if unstepped and key is not None else _full_value(p, optimizer, key)
            if mine:
                tensors[f"{canonical}::{key or PARAM}"] = value.contiguous()
        if mine:
            index[canonical] = slicing.to_json()
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else {}
    return {"tensors": tensors, "index": index, "keys": keys, "optimizer_step": _optimizer_step(optimizer),
            "expert_steps": experts,
            "schedule": {k: scheduler[k] for k in ("last_epoch", "_step_count", "expert_steps") if k in scheduler},
            "global_batch": engine.train_batch_size() // max(1, ctx.sp_size), "base": base}


def write(part: dict, folder: Path, step: int, layout: dict) -> dict[str, str]:
    """Write what `collect` gathered into `folder`/layout_free (rank 0 also writes state.json); returns the
    CRC-32s of the files this rank wrote ({name under `folder`: crc32}), taken as they were written."""
    import zlib

    from parallel.checkpoints import safetensors_crc

    out = Path(folder) / FOLDER
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rank{dist.get_rank():05d}.safetensors"
    try:
        crcs = {f"{FOLDER}/{path.name}": safetensors_crc.save(part["tensors"], path,
                                                              metadata={"index": json.dumps(part["index"])})}
    except OSError as e:        # a full disk: said with the file, as checkpoint.save reports it with the figures
        raise (OSError(e.errno, f"{path}: {e.strerror}") if e.errno else OSError(f"{path}: {e}")) from e
    if dist.get_rank() == 0:
        state = {"step": step, "optimizer_step": part["optimizer_step"], "schedule": part["schedule"],
                 "global_samples": step * part["global_batch"], "global_batch": part["global_batch"],
                 "state_keys": part["keys"], "layout": layout,
                 **({} if part.get("base", True) else {"lora_base": "release"}),
                 **({"expert_steps": part["expert_steps"]} if part["expert_steps"] else {})}
        text = (json.dumps(state, indent=1) + "\n").encode()
        (out / STATE).write_bytes(text)
        crcs[f"{FOLDER}/{STATE}"] = f"{zlib.crc32(text):08x}"
    return crcs


# ---------------------------------------------------------------------------------------------- reading

class Stored:
    """The headers of a layout-free copy: which files hold which shard of each canonical name."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.folder = Path(folder) / FOLDER
        self.state = json.loads((self.folder / STATE).read_text())
        self.files, self.shards = {}, {}
        for path in sorted(self.folder.glob("rank*.safetensors")):
            handle = safe_open(str(path), framework="pt")
            self.files[path] = handle
            for name, s in json.loads(handle.metadata()["index"]).items():
                self.shards.setdefault(name, []).append((path, Slicing.from_json(s)))

    def read(self, name: str, key: str, target: Slicing, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.shards:
            raise KeyError(f"{self.folder}: no stored shard of {name} (a model other than the one saved?)")

        def reader(handle, tensor_key):
            def read(dim, start, n):
                if dim is None:
                    return handle.get_tensor(tensor_key)
                sl = handle.get_slice(tensor_key)
                return sl[tuple([slice(None)] * dim + [slice(start, start + n)])]
            return read
        pieces = [(s, reader(self.files[path], f"{name}::{key}")) for path, s in self.shards[name]]
        try:
            return assemble(target, shape, pieces)
        except ValueError as e:
            raise ValueError(f"{self.folder}: {name}: {e}") from e


def _step_tensor(n: int, param, group: dict) -> torch.Tensor:
    """Adam's step count as torch's AdamW keeps it: a float32 scalar, on the device when fused/capturable."""
    device = param.device if group.get("fused") or group.get("capturable") else "cpu"
    return torch.tensor(float(n), dtype=torch.float32, device=device)


def _ensure_state(wrapper, optimizer, keys: list[str], step: int, expert_steps: Optional[dict] = None) -> None:
    """Give every parameter the optimizer steps (ZeRO's flat fp32 partitions included, ZeRO-3's though they are
    out of its groups between steps: stepped_params) its state tensors, so DeepSpeed's per-parameter views can
    point into them; the values are set per parameter after. An expert's groups take that expert's step count
    (`expert_steps`)."""
    for p, group in stepped_params(wrapper, optimizer):
        n = (expert_steps or {}).get(str(group.get("expert")), step)
        st = optimizer.state[p]
        for key in keys:
            st.setdefault(key, torch.zeros_like(p, dtype=torch.float32))
        st["step"] = _step_tensor(n, p, group)


@torch.no_grad()
def load(trainer, folder: Path) -> int:
    """Restore the layout-free copy in `folder` (a step{N}) into this rank's engine; returns the step. Every
    parameter and buffer is read (but a LoRA base left in its release: build_trainer read it), none left as built:
    a resume builds without the tensor-parallel layers' init (parallel/train/engine.py overwrites_init)."""
    import deepspeed

    engine, optimizer, ctx = trainer.engine, trainer.optimizer, trainer.ctx
    stored = Stored(folder)
    state = stored.state
    keys = state["state_keys"]
    _ensure_state(engine.optimizer, optimizer, keys, state["optimizer_step"], state.get("expert_steps"))
    relink_optimizer_fragments(engine.optimizer)
    base = state.get("lora_base") != "release"      # else the frozen base is model.init_from's, already read
    for name, p, marks, trained in module_tensors(engine.module):
        if not (base or trained):
            continue
        canonical = canonical_name(name, trainer.cfg.model.num_layers)
        target, shape = slicing_of(p, ctx.tp_size, ctx.tp_rank, marks), local_shape(p)
        weight = _read_value(stored, canonical, p, target, shape)
        if is_partitioned(p):                   # ZeRO-3: every data rank writes the same full shard
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                p.data.copy_(weight.to(p.dtype))
        else:
            p.data.copy_(weight.to(p.dtype))
        if not trained:
            continue
        zero = zero_holds_master(p)
        if zero:
            safe_set_full_fp32_param(p, weight.to(p.device))
        for key in keys:
            value = stored.read(canonical, key, target, shape).to(p.device)
            if zero:
                safe_set_full_optimizer_state(p, value, key)
            else:
                optimizer.state[p][key].copy_(value.reshape(p.shape))
    scheduler = engine.lr_scheduler
    if scheduler is not None and state["schedule"]:
        scheduler.load_state_dict({**scheduler.state_dict(), **state["schedule"]})
        lrs = scheduler.lrs() if hasattr(scheduler, "lrs") else \
            [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, lr in zip(scheduler.optimizer.param_groups, lrs):
            group["lr"] = lr
        scheduler.load_state_dict({**scheduler.state_dict(), "_last_lr": lrs})
    swap = getattr(engine.module, "host_swap", None)       # train.block_swap: its host tensors were written
    if swap is not None:
        swap.forget_copies()
    engine.global_steps = state["step"]
    engine.global_samples = state["global_samples"]
    return int(state["step"])


def _read_value(stored: Stored, canonical: str, t: torch.Tensor, target: Slicing, shape) -> torch.Tensor:
    """The stored value of parameter or buffer `t`, refused where it cannot be this model's: a buffer a copy does
    not hold, or a stored dtype other than the one written for it (fp32 for a parameter, a buffer's own), which a
    run of another model.lora.base_dtype than the saved one would meet (fp8 codes read as weights, or the reverse)."""
    from parallel.checkpoints.checkpoint import describe

    param = isinstance(t, torch.nn.Parameter)
    if canonical not in stored.shards and not param:
        raise ValueError(f"{stored.folder}: no stored {canonical}, a buffer of this model: the copy was written by a "
                         f"toolkit that kept parameters only, or for another model.lora.base_dtype. Resume it at "
                         f"{describe(stored.state['layout'])}, whose DeepSpeed files hold it; that run's next "
                         f"checkpoint resumes anywhere")
    value = stored.read(canonical, PARAM, target, shape)
    want = torch.float32 if param else t.dtype
    if value.dtype != want:
        raise ValueError(f"{stored.folder}: {canonical} is stored as {value.dtype}, this model holds it as a "
                         f"{t.dtype} {'parameter' if param else 'buffer'} (another model.lora.base_dtype than the "
                         f"run that wrote it?)")
    return value
