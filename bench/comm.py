"""Communication per training step, counted in real runs, against the textbook volumes.

Each layout isolates one kind of parallelism (tp = 2, dp = 2 under ZeRO 1/2/3, pp = 2), so every
collective of its step belongs to that kind. torch.distributed's collectives are wrapped in the ranks
before DeepSpeed starts; a collective's volume is the size of the whole tensor it works on (an
all-gather's output, a reduce-scatter's input, an all-reduce's tensor, a send's tensor), in bytes.

    theory, per step and rank (fp32):
      TP   4 all-reduces of b x s x h per block per micro-batch (Megatron: 2 forward, 2 backward)
      ZeRO-1/2   2 x parameters (gradients reduced, updated parameters gathered)
      ZeRO-3     3 x parameters (gathered in forward and in backward, gradients reduced); DeepSpeed
                 keeps a gathered parameter for backward when it is reused soon enough
                 (stage3_max_reuse_distance), which a small model always is
      PP   per micro-batch and stage boundary: the activations forward and their gradients backward
      SP   8 all-to-alls of b x s/sp x h per block per micro-batch (Ulysses: q, k, v and the output
           forward, their gradients backward), plus the gradient all-reduce over the sp ranks (to
           DeepSpeed they are data-parallel ranks: 1 x parameters at ZeRO-0)
      communication_data_type=bf16 at ZeRO-1: the gradients at 2 bytes (the planner's dp_bytes), the
           gathered parameters still fp32: 2 + 4 bytes a parameter instead of 4 + 4
    ZeRO++'s quantised weights and gradients need DeepSpeed's CUDA quantizer kernels: no row here.
"""
from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# op -> (keyword, position) of the tensor whose size is the collective's volume
_OPS = {"all_reduce": ("tensor", 0), "broadcast": ("tensor", 0), "send": ("tensor", 0),
        "reduce": ("tensor", 0), "all_gather_into_tensor": ("output_tensor", 0), "reduce_scatter_tensor": ("input", 1),
        "all_to_all_single": ("input", 1),
        "all_gather": ("tensor_list", 0), "reduce_scatter": ("input_list", 1)}


def _install_counter(totals: dict) -> None:
    import torch
    import torch.distributed as dist

    def size(arg) -> int:
        if isinstance(arg, torch.Tensor):
            return arg.numel() * arg.element_size()
        return sum(t.numel() * t.element_size() for t in arg)         # a list of tensors

    for op, (key, position) in _OPS.items():
        original = getattr(dist, op)

        def counted(*args, _op=op, _key=key, _pos=position, _original=original, **kwargs):
            group = kwargs.get("group")
            if totals.get("on") and dist.get_world_size(group) > 1:     # a group of one moves nothing
                arg = kwargs[_key] if _key in kwargs else args[_pos]
                totals[_op] = totals.get(_op, 0) + size(arg)
            return _original(*args, **kwargs)
        setattr(dist, op, counted)

    batch = dist.batch_isend_irecv      # ring attention posts its sends in batches (counted as "isend")

    def counted_batch(ops):
        if totals.get("on"):
            totals["isend"] = totals.get("isend", 0) + sum(size(op.tensor) for op in ops if op.op is dist.isend)
        return batch(ops)
    dist.batch_isend_irecv = counted_batch


def counted_rank(rank, world_size, dims: dict, overrides, stage=0, ds_extra=None, timed_steps=0):
    """One rank of a `debug`-family run at layout `dims` (ParallelDims' keywords), fp32 ZeRO `stage`, no activation
    checkpointing: two warm-up steps, then the bytes of one step by collective ({op: bytes}), and, with
    `timed_steps`, the median time of that many more steps."""
    import os
    import sys
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    totals: dict = {}
    _install_counter(totals)

    from parallel.experiment.config import load_config
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims

    sizes = [f"parallel.{k}={v}" for k, v in dims.items() if k != "dp_size"]
    cfg = load_config("debug", [*overrides, *sizes])
    ds = json.loads((ROOT / "ds_configs/zero0_fp32.json").read_text())
    ds.pop("activation_checkpointing")
    ds["zero_optimization"] = {"stage": stage}
    ds.update(ds_extra or {})
    ctx = ParallelContext.build(ParallelDims(**dims))
    seed_all(cfg.train.seed)
    trainer = build_trainer(cfg, ds, ctx)
    batches = training_batches(cfg, ctx)
    for _ in range(2):
        trainer.train_step(batches)
    totals["on"] = True
    trainer.train_step(batches)
    totals.pop("on")
    if not timed_steps:
        return totals
    times = []
    for _ in range(timed_steps):
        tic = time.perf_counter()
        trainer.train_step(batches)
        times.append(time.perf_counter() - tic)
    return {"bytes": totals, "median_step_s": statistics.median(times)}


def measure(overrides: list[str]) -> list[dict]:
    """Bytes per step, measured and in theory, for tp 2, dp 2 x ZeRO 1/2/3, pp 2, sp 2 and ZeRO-1 with bf16
    gradient reduction (communication_data_type; 2 ranks each)."""
    import torch

    from parallel.experiment.config import load_config
    from parallel.model.build import layer_specs
    from parallel.distributed.pipeline import SequentialDiT
    from parallel.plan.memory import EngineSettings
    from parallel.plan.search import dp_bytes
    from parallel.plan.trace import sequence_length
    from parallel.distributed.topology import ParallelContext
    from parallel.experiment.units import count_parameters
    from bench.ranks import run_ranks

    cfg = load_config("debug", overrides)
    m, t = cfg.model, cfg.train
    with torch.device("meta"):
        params = count_parameters(SequentialDiT(layer_specs(cfg, ParallelContext.single())))
    b, s, mb = t.micro_batch_size, sequence_length(cfg), t.grad_accum_steps
    rows = []
    cases = [("TP", (2, 1, 1, 0), 4 * m.num_layers * mb * b * s * m.hidden_size * 4, "4 x b*s*h per block"),
             ("ZeRO-1", (1, 1, 2, 1), 2 * params * 4, "2 x parameters"),
             ("ZeRO-2", (1, 1, 2, 2), 2 * params * 4, "2 x parameters"),
             ("ZeRO-3", (1, 1, 2, 3), 3 * params * 4, "3 x parameters"),
             ("PP", (1, 2, 1, 0), 2 * mb * (b * s * m.hidden_size + b * m.time_embed_dim) * 4,
              "activations + their gradients per micro-batch"),
             ("SP", (1, 1, 1, 0, 2), (8 * m.num_layers * mb * b * s // 2 * m.hidden_size + params) * 4,
              "8 x b*s/sp*h per block + 1 x parameters")]
    # communication_data_type: the planner's byte model (parallel.plan.search.dp_bytes) for the gradients,
    # plus ZeRO-1's all-gather of the updated fp32 weights, which it does not change
    bf16_grads = {"communication_data_type": "bf16"}
    grads = dp_bytes(EngineSettings.from_ds({"zero_optimization": {"stage": 1}, **bf16_grads}, m.num_layers), params)[0]
    cases.append(("ZeRO-1, bf16 gradients", (1, 1, 2, 1), int(grads) + params * 4,
                  "planner's gradient bytes (bf16) + fp32 parameters gathered"))
    extra = {"ZeRO-1, bf16 gradients": bf16_grads}
    for name, (tp, pp, dp, stage, *sp), theory, formula in cases:
        sp = sp[0] if sp else 1
        dims = {"tp_size": tp, "pp_size": pp, "dp_size": dp, "sp_size": sp}
        per_rank = run_ranks(counted_rank, tp * pp * dp * sp, dims, overrides, stage, extra.get(name),
                             timeout=600)
        if name == "PP":       # point to point: what the two stages sent, together
            measured = sum(r.get("send", 0) + r.get("isend", 0) + r.get("broadcast", 0) for r in per_rank)
        else:
            measured = max(sum(r.values()) for r in per_rank)
        ops = defaultdict(int)
        for r in per_rank[:1] if name != "PP" else per_rank:
            for op, n in r.items():
                ops[op] += n
        rows.append({"kind": name, "layout": {"tp": tp, "pp": pp, "dp": dp, "sp": sp, "zero": stage}, "measured": measured,
                     "theory": theory, "formula": formula, "ratio": measured / theory, "by_op": dict(ops)})
    return rows
