"""Where a training step's time goes: torch.profiler self time per op, summed into groups by op name.

Self time (not total) so nested ops are counted once: an autograd node's time lands on the aten kernels
under it. Groups (first match of a substring of the op name wins):

    attention             SDPA and its kernels (flash / efficient / math), softmax
    linear layers         mm, addmm, bmm, linear, matmul (forward and the backward's matmuls)
    norms and modulation  layer_norm, RMSNorm pieces (rsqrt, pow, mean), and the element-wise mul, add, sub,
                          addcmul, silu, gelu that adaLN modulation, gates, residuals and activations are made of
    rotary                stack, unbind, neg: what rotating channel pairs adds (its mul / add fall in the group
                          above: the profiler cannot tell them apart by name)
    copies and layout     copy_, clone, contiguous, cat, _to_copy, transpose materialised, index, fill
    communication         c10d / gloo / nccl / hccl collectives
    optimizer             Optimizer.step and the _foreach_ kernels it runs
    other                 everything else
"""
from __future__ import annotations

from torch.profiler import profile

GROUPS = [
    ("communication", ("c10d", "gloo", "nccl", "hccl", "all_reduce", "all_gather", "all_to_all", "reduce_scatter")),
    ("optimizer", ("optimizer", "_foreach", "adam")),
    ("attention", ("scaled_dot_product", "attention", "softmax", "flash")),
    ("linear layers", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "gemm")),
    ("rotary", ("aten::stack", "aten::unbind", "aten::neg")),
    ("copies and layout", ("copy_", "clone", "contiguous", "aten::cat", "_to_copy", "index", "fill_", "zero_",
                           "aten::empty")),
    ("norms and modulation", ("layer_norm", "rms_norm", "rsqrt", "aten::pow", "aten::mean", "aten::mul",
                              "aten::add", "aten::sub", "aten::div", "addcmul", "silu", "gelu", "aten::sum",
                              "square")),
]
ORDER = [g for g, _ in GROUPS] + ["other"]


def group_of(op: str) -> str:
    name = op.lower()
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other"


def step_table(step, sync, steps: int = 2) -> dict[str, float]:
    """Seconds per step in each group, from `steps` profiled calls of step() (after the caller's warm-up);
    device time where the profiler sees device kernels (CUDA: parallel.distributed.accelerator.profiler_activities),
    CPU self time otherwise (CPU, and NPU, whose kernels only torch_npu's own profiler sees)."""
    from parallel.distributed import accelerator
    activities = accelerator.profiler_activities()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    out = {g: 0.0 for g in ORDER}
    device = len(activities) > 1
    for event in prof.key_averages():
        us = event.self_device_time_total if device else event.self_cpu_time_total
        out[group_of(event.key)] += us / 1e6 / steps
    out["total"] = sum(out[g] for g in ORDER)
    return out
