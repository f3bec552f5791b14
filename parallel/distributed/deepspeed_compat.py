"""The one place the toolkit touches DeepSpeed's private internals.

Each patch below was written against DeepSpeed 0.19.8 (`WRITTEN_AGAINST`). tests/unit/test_deepspeed_compat.py
checks, per patch, every DeepSpeed symbol it relies on, and fails naming the patch and the symbol when an
upgrade removes or changes one. `check_deepspeed_version()` warns once at engine set-up when the installed
major.minor differs.

Patch (DeepSpeed version written against)
    does     what the toolkit changes
    why      the DeepSpeed behaviour it works around
    relies   the DeepSpeed internals an upgrade must keep

use_weights_only_checkpoints(engine)  (0.19.8)
    does     swaps engine.checkpoint_engine, when exactly TorchCheckpointEngine, for
             WeightsOnlyCheckpointEngine: torch.load(weights_only=True) with LossScaler, ZeroStageEnum and
             fragment_address allowed by name
    why      TorchCheckpointEngine.load unpickles with weights_only=False: a checkpoint can run any code
    relies   engine.checkpoint_engine, engine._config, TorchCheckpointEngine(config_params) and
             .load(path, map_location=None), the three classes at their import paths

clip_with_replica_norm(engine, norm_fn)  (0.19.8)
    does     replaces engine.clip_fp32_gradients: norm_fn's norm, clipped as DeepSpeed clips, kept in
             engine._global_grad_norm
    why      fp32 ZeRO-0 clipping (clip_grad_norm_(..., mpu=engine.mpu)) drops the norm, so
             get_global_grad_norm() is None; under the pipeline grid it reads the pipe x model rank as the
             tp rank, so replicated parameters of every stage but the first are left out of the norm
    relies   _take_model_step calling self.clip_fp32_gradients() (fp32, no ZeRO); get_global_grad_norm
             returning self._global_grad_norm; gradient_clipping()

relink_optimizer_fragments(wrapper)  (0.19.8)
    does     clears wrapper._hp_optimizer_states_linked, calls wrapper._lazy_init_hp_params_optimizer_state()
    why      ZeRO-1/2 (DeepSpeedZeroOptimizer) and BF16_Optimizer build each parameter's views of optimizer
             state once, after the first step of the first parameter group: later groups get none, and a
             checkpoint load replaces the tensors they view
    relies   that flag and that method on both optimizers

set_stage_bounds(pipeline_module, parts)  (0.19.8)
    does     the body of a PipelineModule._partition_layers override: module.parts = parts, and this rank's
             stage s builds layers [parts[s], parts[s + 1]) through _set_bounds
    why      PipelineModule partitions only by 'uniform', 'parameters' or 'type:'; an explicit per-stage
             split needs the private hook, which __init__ calls after _topo and global_rank are set and
             before _build()
    relies   _partition_layers(method), _set_bounds(start, stop), _topo.get_coord(rank).pipe, global_rank,
             parts (returned by partitions())

write_monitor_events(monitor, events)  (0.19.8)
    does     passes the toolkit's (name, value, step) figures to the MonitorMaster's monitors, but to wandb
             itself: without a step, with the step as a figure ("step") that wandb.define_metric makes
             the x-axis of train/* and val/*
    why      wandb drops (with a warning) any log whose step is below the last one it saw, and the engine
             logs Train/Samples/lr at the count of samples seen (4, 8, ...): WandbMonitor.write_events
             would hand wandb steps 1, 2, ... and lose every figure
    relies   MonitorMaster's tb_monitor / wandb_monitor / csv_monitor / comet_monitor attributes, each
             None or a monitor with .enabled and write_events; WandbMonitor initialising wandb on rank 0

unlink_shm_buffer()  (0.19.8)
    does     removes the name of this rank's shared-memory all-reduce buffer (/dev/shm), once every rank
             of the job has mapped every other's (call after init_distributed and a barrier)
    why      on the CPU accelerator, when LOCAL_SIZE equals the world size (the deepspeed launcher sets
             it), init_distributed creates a 69 MB /dev/shm file per rank and never removes it: every
             run, finished or killed, leaks them (/dev/shm is RAM; a day of test runs held 18 GiB). A
             mapped file without a name lives until its last process exits
    relies   shm.cpp's name "deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>",
             created and mapped by every rank inside TorchBackend.__init__ (shm_comm_op.initialize)

Read, not patched (parallel/train/probe.py measures through them; renamed, the probe would under-count
silently, so the tests check them too):
    CHECKPOINT_SAVED_TENSORS, OFFLOADED_DATA   CheckpointFunction.forward keeps its inputs as
                                               ctx.deepspeed_saved_tensors, partitioned or offloaded
                                               data as .saved_data
    ZERO_BUCKETS                               ZeRO-1/2/3 gradient buckets, self.ipg_buckets
    zero_offloaded(held)                       what ZeRO-1/2/3 with offload_optimizer keep on the offload
                                               device, by the attributes that hold them (checked in
                                               tests/distributed/test_ds_json_distributed.py)
    engine_optimizers(engine)                  engine.basic_optimizer, the client optimizer DeepSpeed wraps
    zero_holds_master(param)                   ZeRO-3 marks its parameters with ds_id, ZeRO-1/2 and BF16_Optimizer
                                               with _hp_mapping (deepspeed.utils.safe_*_full_* dispatch on the
                                               same two); train/relayout.py then creates the client optimizer's
                                               state on the flat fp32 partitions, which DeepSpeed's per-parameter
                                               views (ZeRO-1/2: tensors of the partition's shape; ZeRO-3:
                                               optimizer.state[fp32 partition][key]) point into
Elsewhere, read the same way: ZeRO-3's parameter attributes ds_tensor, ds_shape, ds_id (distributed/replicas.py,
train/validate.py, train/ema.py) and MEMORY_OPT_ALLREDUCE_SIZE (mirrored in plan/memory.py).
"""
from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Sequence

import deepspeed
import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

TESTED_DEEPSPEED = "0.19"             # the series check_deepspeed_version accepts
WRITTEN_AGAINST = "0.19.8"            # the release every patch below was written and tested against

CHECKPOINT_SAVED_TENSORS = "deepspeed_saved_tensors"
OFFLOADED_DATA = "saved_data"
ZERO_BUCKETS = "ipg_bucket"          # a substring of held-tensor paths: `.ipg_buckets[...]`


def major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_deepspeed_version(installed: str | None = None) -> bool:
    """True when the installed DeepSpeed is the major.minor these patches were written against; else
    warn (once per version and process) and return False."""
    installed = installed or deepspeed.__version__
    if major_minor(installed) == TESTED_DEEPSPEED:
        return True
    _warn_untested(installed)
    return False


@functools.cache
def _warn_untested(installed: str) -> None:
    warnings.warn(f"deepspeed {installed} is installed; parallel/distributed/deepspeed_compat.py was written against "
                  f"{TESTED_DEEPSPEED}.x. Run `python -m pytest tests/unit/test_deepspeed_compat.py`: it names any "
                  f"patch whose DeepSpeed internals changed.", RuntimeWarning, stacklevel=3)


def safe_globals() -> list[type]:
    """The DeepSpeed records its optimizers pickle into checkpoints, allowed by name under weights_only."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, ZeroStageEnum, fragment_address]


class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, loading with `weights_only=True`: a checkpoint file can hold
    tensors, containers, plain values and the three DeepSpeed records its optimizers save (allowed by
    name), never code that runs when it is loaded."""

    def load(self, path: str, map_location=None):
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)


def use_weights_only_checkpoints(engine) -> None:
    """Load this engine's checkpoints with weights_only=True (other checkpoint engines are left alone)."""
    if type(engine.checkpoint_engine) is TorchCheckpointEngine:
        engine.checkpoint_engine = WeightsOnlyCheckpointEngine(engine._config)


def clip_with_replica_norm(engine, norm_fn: Callable[[list[torch.nn.Parameter]], torch.Tensor]) -> None:
    """fp32 ZeRO-0 clipping with `norm_fn(params)` (the L2 norm of the whole replica's gradients, given this
    rank's parameters that have one): coef = clip / (norm + 1e-6), applied when < 1, as DeepSpeed does;
    the norm is kept for `engine.get_global_grad_norm()`."""
    def clip_and_record():
        params = [p for p in engine.module.parameters() if p.grad is not None]
        norm = norm_fn(params)
        coef = engine.gradient_clipping() / (norm + 1e-6)
        if coef < 1:
            for p in params:
                p.grad.detach().mul_(coef)
        engine._global_grad_norm = float(norm)
    engine.clip_fp32_gradients = clip_and_record


def relink_optimizer_fragments(wrapper) -> None:
    """Rebuild a ZeRO-1/2 or BF16_Optimizer wrapper's per-parameter views of optimizer state onto the
    current state tensors; a no-op for optimizers without them (ZeRO-0, ZeRO-3)."""
    if hasattr(wrapper, "_hp_optimizer_states_linked"):
        wrapper._hp_optimizer_states_linked = False
        wrapper._lazy_init_hp_params_optimizer_state()


def zero_holds_master(param) -> bool:
    """True when DeepSpeed keeps the parameter's fp32 master and optimizer state in its own partitions (ZeRO
    1/2/3, BF16_Optimizer), reached through deepspeed.utils' safe_get/set_full_* accessors; False when the
    client optimizer steps the parameter itself (fp32 ZeRO-0)."""
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


def set_stage_bounds(pipeline_module, parts: Sequence[int]) -> None:
    """Explicit pipeline partition, from a `PipelineModule._partition_layers` override: stage s builds
    layers [parts[s], parts[s + 1]), len(parts) = pp_size + 1; `parts` is kept as `module.parts`
    (DeepSpeed's `partitions()`)."""
    pipeline_module.parts = parts
    stage = pipeline_module._topo.get_coord(pipeline_module.global_rank).pipe
    pipeline_module._set_bounds(start=parts[stage], stop=parts[stage + 1])


def engine_optimizers(engine) -> list:
    """The optimizer objects whose `step` an engine step calls: DeepSpeed's wrapper and the client
    optimizer it wraps (`basic_optimizer`), each once."""
    owners = (engine.optimizer, getattr(engine, "basic_optimizer", None))
    return list({id(o): o for o in owners if o is not None}.values())


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


def checkpoint_saved_tensors(node) -> list[torch.Tensor]:
    """Tensors DeepSpeed's activation checkpoint keeps on its autograd node (not through
    save_for_backward, so saved-tensor hooks miss them); a partitioned or offloaded one by its data."""
    return [getattr(t, OFFLOADED_DATA, t) for t in getattr(node, CHECKPOINT_SAVED_TENSORS, ()) or ()
            if isinstance(t, torch.Tensor)]


MONITORS = ("tb_monitor", "wandb_monitor", "csv_monitor", "comet_monitor")      # MonitorMaster's attributes


def write_monitor_events(monitor, events: list[tuple[str, float, int]]) -> None:
    """`events` (name, value, step), all of one step, to every monitor of DeepSpeed's MonitorMaster; wandb's
    as the module docstring says."""
    for name in MONITORS:
        sink = getattr(monitor, name, None)
        if sink is None or not sink.enabled:
            continue
        if name != "wandb_monitor":
            sink.write_events(events)
        elif torch.distributed.get_rank() == 0:             # where WandbMonitor called wandb.init
            import wandb
            if not getattr(sink, "_vdp_step_metric", False):
                wandb.define_metric("step")
                for prefix in ("train/*", "val/*"):
                    wandb.define_metric(prefix, step_metric="step")
                sink._vdp_step_metric = True
            wandb.log({"step": events[0][2], **{label: value for label, value, _ in events}})


SHM_BUFFER = "/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"


def unlink_shm_buffer() -> None:
    """See the module docstring. Every rank must have returned from init_distributed (a barrier) first: a
    rank still in it opens its peers' buffers by name."""
    if os.environ.get("LOCAL_SIZE") != str(torch.distributed.get_world_size()):
        return                                  # DeepSpeed's shm all-reduce is off: no buffer was created
    name = SHM_BUFFER.format(uid=os.getuid(), addr=os.environ.get("MASTER_ADDR", ""),
                             port=os.environ.get("MASTER_PORT", ""), rank=torch.distributed.get_rank())
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass
