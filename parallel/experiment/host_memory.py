"""Host memory before launch: the plan's host bytes for the processes of one node against what the host has.

Offloaded checkpoint inputs (train.offload_activations; DeepSpeed's cpu_checkpointing), swapped blocks' weights
(train.block_swap) and ZeRO offload live in host memory, pinned where the JSON or the toolkit pins it, which the
kernel cannot swap out: a node whose processes together need more than the host has free fails late (an
allocation error or the OOM killer in the middle of the first step). train.py's checks refuse it first (parallel/check.py's load_and_check, given train.py's planner).
"""
from __future__ import annotations

from parallel.experiment.config import ExperimentConfig
from parallel.experiment.units import format_size


def uses_host(cfg: ExperimentConfig, ds: dict) -> bool:
    """Whether the run keeps anything in host memory (so the plan is worth computing before launch)."""
    z = ds.get("zero_optimization") or {}
    offloaded = any((z.get(key) or {}).get("device", "none") != "none" for key in ("offload_optimizer", "offload_param"))
    return cfg.train.offload_activations or cfg.train.block_swap > 0 or offloaded or bool((ds.get("activation_checkpointing") or {})
                                                               .get("cpu_checkpointing"))


def host_problems(plan, ranks_per_node: int, available: int) -> list[str]:
    """[a refusal] when `ranks_per_node` processes of the planned layout (`plan`: parallel/plan/memory.py's
    MemoryPlan, which the caller computes: the planner sits above the checker) need more host memory than
    `available`."""
    per_process = max(sum(stage.host.values()) for stage in plan.stages)
    need = per_process * ranks_per_node
    if need <= available:
        return []
    return [f"host memory: {ranks_per_node} process(es) on this node need {format_size(need)} of host memory "
            f"({format_size(per_process)} each: offloaded checkpoint inputs "
            f"{format_size(max(stage.host.get('activations', 0) for stage in plan.stages))}, swapped blocks' weights "
            f"{format_size(max(stage.host.get('block_swap', 0) for stage in plan.stages))}, ZeRO offload the rest; "
            f"python -m parallel.plan shows the host line) and {format_size(available)} is free; set "
            f"train.offload_activations=false, a smaller train.block_swap, drop the JSON's offload "
            f"(zero_optimization.offload_optimizer/"
            f"offload_param, activation_checkpointing.cpu_checkpointing), or run fewer processes a node"]


def host_available() -> int:
    """Bytes of host memory free now (what the node's processes can still take)."""
    import psutil
    return int(psutil.virtual_memory().available)



