"""Read, not patched (0.19.8): the DeepSpeed names parallel/train/probe.py measures a step through and
parallel/plan/memory.py mirrors. Renamed, the probe would under-count silently, so the tests check them too.

    CHECKPOINT_SAVED_TENSORS, OFFLOADED_DATA   CheckpointFunction.forward keeps its inputs as
                                               ctx.deepspeed_saved_tensors, partitioned or offloaded
                                               data as .saved_data
    ZERO_BUCKETS                               ZeRO-1/2/3 gradient buckets, self.ipg_buckets
    ENGINE_ALLREDUCE_BUCKET                    deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE
    zero_offloaded(held)                       what ZeRO-1/2/3 with offload_optimizer keep on the offload
                                               device, by the attributes that hold them (checked in
                                               tests/distributed/test_ds_json_distributed.py)


"""
from __future__ import annotations

import torch

CHECKPOINT_SAVED_TENSORS = "deepspeed_saved_tensors"
OFFLOADED_DATA = "saved_data"
ZERO_BUCKETS = "ipg_bucket"          # a substring of held-tensor paths: `.ipg_buckets[...]`
ENGINE_ALLREDUCE_BUCKET = 500_000_000     # deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE


def checkpoint_saved_tensors(node) -> list[torch.Tensor]:
    """Tensors DeepSpeed's activation checkpoint keeps on its autograd node (not through
    save_for_backward, so saved-tensor hooks miss them); a partitioned or offloaded one by its data."""
    return [getattr(t, OFFLOADED_DATA, t) for t in getattr(node, CHECKPOINT_SAVED_TENSORS, ()) or ()
            if isinstance(t, torch.Tensor)]


def zero_offloaded(held: dict[str, int]) -> dict[str, int]:
    """Bytes a ZeRO optimizer with offload_optimizer keeps on its offload device, by the planner's line, from a
    StepProbe's {held-tensor path: bytes}.

    DeepSpeedZeroOptimizer_Stage3: grad_partitions_flat_buffer (every gradient partition),
    fp32_partitioned_groups_flat (master) and their .grad (kept for every sub-group: _release_sub_group
    frees them only without offload), with offload_param fp16_partitioned_groups_flat (the lp partitions).
    DeepSpeedZeroOptimizer (ZeRO-1/2, cpu_offload): single_partition_of_fp32_groups (master) and their .grad,
    param_buffer_of_bit16_for_cpu_offload_groups (an lp copy of the partition), accumulated_grads_in_cpu
    (the micro-batches' gradients, whole parameters) and temp_grad_buffer_for_cpu_offload.
    Both: the client optimizer's exp_avg and exp_avg_sq."""
    lines = {"parameters": 0, "gradients": 0, "master_weights": 0, "adam_moments": 0}
    masters = ("optimizer.fp32_partitioned_groups_flat[", "optimizer.single_partition_of_fp32_groups[")
    for path, nbytes in held.items():
        if path.startswith(("optimizer.fp16_partitioned_groups_flat[",
                            "optimizer.param_buffer_of_bit16_for_cpu_offload_groups[")):
            lines["parameters"] += nbytes
        elif path.startswith(("optimizer.grad_partitions_flat_buffer", "optimizer.accumulated_grads_in_cpu[",
                              "optimizer.temp_grad_buffer_for_cpu_offload")) or \
                path.startswith(masters) and path.endswith("].grad"):
            lines["gradients"] += nbytes
        elif path.startswith(masters):
            lines["master_weights"] += nbytes
        elif path.startswith("optimizer.optimizer.state[") and path.endswith(("[exp_avg]", "[exp_avg_sq]")):
            lines["adam_moments"] += nbytes
    return lines
