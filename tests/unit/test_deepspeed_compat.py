"""parallel/distributed/deepspeed/ against the installed DeepSpeed: every internal a patch relies on is
still there and still used as the patch assumes (each failure names the patch and the DeepSpeed symbol),
and each patch does what it says. One process, no process group."""
import importlib
import inspect
import os
import pickle
import types
import warnings

import deepspeed
import pytest
import torch
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.activation_checkpointing import checkpointing
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from deepspeed.runtime.zero import partition_parameters
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from parallel.distributed.deepspeed import accounting, bf16, checkpoint, clipping, pipeline, version, zero3
from parallel.distributed.deepspeed import monitor as ds_monitor
from parallel.distributed.deepspeed import optimizer as ds_optimizer
from parallel.distributed.deepspeed import shm as ds_shm
from parallel.distributed.deepspeed import ulysses


def relies(patch: str, symbol: str, ok: bool, detail: str) -> None:
    assert ok, (f"{patch} (parallel/distributed/deepspeed/) relies on DeepSpeed's {symbol}, changed in the installed "
                f"deepspeed {deepspeed.__version__} (the patch was written against {version.WRITTEN_AGAINST}): "
                f"{detail}. Rewrite the patch for this version, or pin deepspeed.")


def member(patch: str, owner, name: str):
    """owner.name, or a failure naming the patch and the symbol when an upgrade removed it."""
    relies(patch, f"{owner.__name__}.{name}", hasattr(owner, name), "it no longer exists")
    return getattr(owner, name)


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def source(obj) -> str:
    return inspect.getsource(obj)


def appears_in_order(src: str, *needles: str) -> bool:
    at = [src.find(n) for n in needles]
    return all(i >= 0 for i in at) and at == sorted(at)


# -- version check ------------------------------------------------------------------------------------

def test_version_check_passes_the_tested_series_and_warns_once_for_another():
    assert version.major_minor("0.19.8+cu121") == "0.19"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert version.check_deepspeed_version("0.19.3")
    with pytest.warns(RuntimeWarning, match=r"deepspeed 0\.98\.1 .* 0\.19"):
        assert not version.check_deepspeed_version("0.98.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # the second call is silent
        assert not version.check_deepspeed_version("0.98.1")


# -- use_weights_only_checkpoints ------------------------------------------------------------------------

class Payload:
    """Stands for arbitrary pickled code in a checkpoint."""


def test_weights_only_engine_relies_on_torch_checkpoint_engine():
    p = "use_weights_only_checkpoints"
    load = params(member(p, TorchCheckpointEngine, "load"))
    relies(p, "TorchCheckpointEngine.load(path, map_location=None)", load == ["self", "path", "map_location"],
           f"its parameters are {load}")
    relies(p, "TorchCheckpointEngine(config_params)", params(TorchCheckpointEngine.__init__)[:2] ==
           ["self", "config_params"], f"its parameters are {params(TorchCheckpointEngine.__init__)}")
    init = source(member(p, DeepSpeedEngine, "_configure_checkpointing"))
    relies(p, "DeepSpeedEngine._configure_checkpointing",
           "self.checkpoint_engine =" in init and "config_params=self._config" in init,
           "it no longer builds self.checkpoint_engine from self._config")
    load = "".join(source(member(p, DeepSpeedEngine, m)) for m in ("_load_checkpoint", "_load_zero_checkpoint",
                                                            "_get_all_zero_checkpoint_state_dicts"))
    relies(p, "DeepSpeedEngine._load_checkpoint / _load_zero_checkpoint",
           "checkpoint_engine=self.checkpoint_engine" in load and "self.checkpoint_engine.load(" in load,
           "checkpoints are no longer read through self.checkpoint_engine")
    save = source(member(p, TorchCheckpointEngine, "save"))
    relies(p, "TorchCheckpointEngine.save(state_dict, path)", "torch.save(state_dict, path" in save and
           "self.zipfile_serialization" in save, "it no longer is torch.save with self.zipfile_serialization")


def test_safe_globals_import():
    try:
        names = [c.__name__ for c in checkpoint.safe_globals()]
    except ImportError as e:
        relies("use_weights_only_checkpoints", "LossScaler / ZeroStageEnum / fragment_address", False, str(e))
    assert names == ["LossScaler", "ZeroStageEnum", "fragment_address"]


def test_weights_only_engine_loads_deepspeed_records_and_refuses_other_classes(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    engine = checkpoint.WeightsOnlyCheckpointEngine(None)
    good = {"scaler": LossScaler(scale=4.0), "stage": ZeroStageEnum.optimizer_states,
            "address": fragment_address(numel=3, start=5), "w": torch.arange(4.0)}
    engine.save(good, str(tmp_path / "good.pt"))
    out = engine.load(str(tmp_path / "good.pt"), map_location="cpu")
    assert out["scaler"].cur_scale == 4.0 and out["stage"] is ZeroStageEnum.optimizer_states
    assert out["address"] == fragment_address(numel=3, start=5)
    torch.testing.assert_close(out["w"], torch.arange(4.0))

    import zlib      # the CRC-32 taken while writing is the file's, in either serialization
    assert engine.checksums[str(tmp_path / "good.pt")] == f"{zlib.crc32((tmp_path / 'good.pt').read_bytes()):08x}"
    engine.zipfile_serialization = True
    engine.save(good, str(tmp_path / "zip.pt"))
    assert engine.checksums[str(tmp_path / "zip.pt")] == f"{zlib.crc32((tmp_path / 'zip.pt').read_bytes()):08x}"
    assert engine.load(str(tmp_path / "zip.pt"))["scaler"].cur_scale == 4.0

    engine.save({"w": torch.zeros(1), "payload": Payload()}, str(tmp_path / "bad.pt"))
    with pytest.raises(pickle.UnpicklingError, match="Payload"):
        engine.load(str(tmp_path / "bad.pt"))


def test_use_weights_only_checkpoints_replaces_only_the_torch_engine():
    engine = types.SimpleNamespace(checkpoint_engine=TorchCheckpointEngine(None), _config=None)
    checkpoint.use_weights_only_checkpoints(engine)
    assert type(engine.checkpoint_engine) is checkpoint.WeightsOnlyCheckpointEngine
    other = object()
    engine = types.SimpleNamespace(checkpoint_engine=other, _config=None)
    checkpoint.use_weights_only_checkpoints(engine)
    assert engine.checkpoint_engine is other


# -- clip_with_replica_norm ------------------------------------------------------------------------------

def test_clip_relies_on_engine_clip_fp32_gradients_and_global_grad_norm():
    p = "clip_with_replica_norm"
    clip = params(member(p, DeepSpeedEngine, "clip_fp32_gradients"))
    relies(p, "DeepSpeedEngine.clip_fp32_gradients", clip == ["self"], f"its parameters are {clip}")
    step = source(member(p, DeepSpeedEngine, "_take_model_step"))
    relies(p, "DeepSpeedEngine._take_model_step", "self.clip_fp32_gradients()" in step,
           "it no longer calls self.clip_fp32_gradients() (fp32 ZeRO-0 clipping moved)")
    relies(p, "DeepSpeedEngine._take_model_step", "if hasattr(self.optimizer, '_global_grad_norm')" in step,
           "it may now overwrite _global_grad_norm after clipping")
    read = source(member(p, DeepSpeedEngine, "get_global_grad_norm"))
    relies(p, "DeepSpeedEngine.get_global_grad_norm", "return self._global_grad_norm" in read,
           "it no longer returns self._global_grad_norm")
    limit = params(member(p, DeepSpeedEngine, "gradient_clipping"))
    relies(p, "DeepSpeedEngine.gradient_clipping", limit == ["self"], f"its parameters are {limit}")
    from deepspeed.runtime.pipe.engine import PipelineEngine
    relies(p, "PipelineEngine._take_model_step / clip_fp32_gradients",
           PipelineEngine._take_model_step is DeepSpeedEngine._take_model_step
           and PipelineEngine.clip_fp32_gradients is DeepSpeedEngine.clip_fp32_gradients,
           "the pipeline engine now overrides the step or the clipping")


def test_lighter_bf16_step_relies_on_the_bf16_optimizer_paths():
    p = "lighter_bf16_step"
    accumulate = source(member(p, BF16_Optimizer, "_update_hp_grad"))
    relies(p, "BF16_Optimizer._update_hp_grad", appears_in_order(
        accumulate, "hp_grad = self.fp32_groups_gradients[group_idx][param_idx]",
        "hp_grad.data.add_(lp.grad.data.to(hp_grad.dtype).view(hp_grad.shape))", "lp._hp_grad = hp_grad",
        "self.fp32_groups_has_gradients[group_idx][param_idx] = True", "lp.grad.zero_()"),
           "the accumulation into the fp32 gradients changed")
    update = source(member(p, BF16_Optimizer, "update_hp_grads"))
    relies(p, "BF16_Optimizer.update_hp_grads", params(BF16_Optimizer.update_hp_grads) == ["self", "clear_lp_grads"]
           and "self._update_hp_grad(lp, i, j, clear_lp_grads)" in update, "it no longer loops over _update_hp_grad")
    step = source(member(p, BF16_Optimizer, "step"))
    relies(p, "BF16_Optimizer.step", appears_in_order(
        step, "is_invalid_grad_norm(all_groups_norm)", "clip_tensors_by_global_norm(input_tensors=self.get_grads_for_norm"
        "(for_clipping=True)", "self.optimizer.step()", "self.update_lp_params()")
           and step.rstrip().endswith("self.clear_hp_grads()"), "its clipping or its clearing moved")
    grads = source(member(p, BF16_Optimizer, "get_grads_for_norm"))
    relies(p, "BF16_Optimizer.get_grads_for_norm", "all_grads_for_clip.append(self.fp32_groups_gradients[i][j])" in grads,
           "the gradients it clips are no longer views of fp32_groups_gradients")
    split = source(member(p, BF16_Optimizer, "_setup_for_real_optimizer"))
    relies(p, "BF16_Optimizer._setup_for_real_optimizer", appears_in_order(
        split, "fp32_flat_buffer = torch.zeros_like(", "self.fp32_groups_gradients_flat.append(fp32_flat_buffer)",
        "self._split_flat_tensor(flat_tensor=self.fp32_groups_gradients_flat[i]"),
           "the fp32 gradients are no longer views of one zeroed flat buffer per group")
    zero = source(member(p, BF16_Optimizer, "zero_grad"))
    relies(p, "BF16_Optimizer.zero_grad", appears_in_order(zero, "self.clear_lp_grads(set_to_none)",
                                                             "self.clear_hp_grads()"), "it clears something else")
    hook = source(member(p, BF16_Optimizer, "create_grad_acc_hooks"))
    relies(p, "BF16_Optimizer.create_grad_acc_hooks", "self.accumulate_hp_grads_and_remove_lp(param, i, j)" in hook,
           "the hooks no longer call the method by name")
    for name in ("backward_prologue", "clear_hp_grads", "clear_lp_grads"):
        member(p, BF16_Optimizer, name)


def test_lighter_bf16_step_leaves_other_optimizers_alone():
    engine = types.SimpleNamespace(optimizer=torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1))
    assert bf16.lighter_bf16_step(engine) is False
    assert vars(engine).keys() == {"optimizer"}


def test_clip_with_replica_norm_clips_as_deepspeed_and_records_the_norm():
    layer = torch.nn.Linear(3, 2)
    layer.weight.grad = torch.full((2, 3), 2.0)              # bias has no gradient: left out
    engine = types.SimpleNamespace(module=layer, gradient_clipping=lambda: 1.0, _global_grad_norm=None)
    seen = []

    def norm_fn(ps):
        seen.append(ps)
        return torch.stack([p.grad.norm() for p in ps]).norm() * 2     # e.g. another tp rank's equal share

    clipping.clip_with_replica_norm(engine, norm_fn)
    engine.clip_fp32_gradients()
    norm = 2.0 * 6 ** 0.5 * 2
    assert seen == [[layer.weight]] and engine._global_grad_norm == pytest.approx(norm)
    torch.testing.assert_close(layer.weight.grad, torch.full((2, 3), 2.0 / (norm + 1e-6)))

    layer.weight.grad = torch.full((2, 3), 1e-3)             # under the clip: unchanged, norm still kept
    engine.clip_fp32_gradients()
    torch.testing.assert_close(layer.weight.grad, torch.full((2, 3), 1e-3))
    assert engine._global_grad_norm == pytest.approx(1e-3 * 6 ** 0.5 * 2)


# -- relink_optimizer_fragments ---------------------------------------------------------------------------

@pytest.mark.parametrize("wrapper", [DeepSpeedZeroOptimizer, BF16_Optimizer], ids=lambda c: c.__name__)
def test_relink_relies_on_lazy_hp_state_linking(wrapper):
    p, name = "relink_optimizer_fragments", wrapper.__name__
    method = member(p, wrapper, "_lazy_init_hp_params_optimizer_state")
    relies(p, f"{name}._lazy_init_hp_params_optimizer_state", params(method) == ["self"], "it takes arguments")
    body = source(method)
    relies(p, f"{name}._hp_optimizer_states_linked", "if not self._hp_optimizer_states_linked" in body
           and "self._hp_optimizer_states_linked = True" in body,
           "linking is no longer guarded by this flag, so clearing it does not rebuild the views")
    relies(p, f"{name}._hp_optimizer_states_linked", "self._hp_optimizer_states_linked = False"
           in source(wrapper), "set-up no longer sets the flag: the patch finds these optimizers by it")


def test_relink_clears_the_flag_and_relinks_and_skips_other_optimizers():
    calls = []

    class Wrapper:
        _hp_optimizer_states_linked = True

        def _lazy_init_hp_params_optimizer_state(self):
            calls.append(self._hp_optimizer_states_linked)
            self._hp_optimizer_states_linked = True

    ds_optimizer.relink_optimizer_fragments(Wrapper())
    assert calls == [False]
    ds_optimizer.relink_optimizer_fragments(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))


# -- set_stage_bounds -------------------------------------------------------------------------------------

def test_stage_bounds_relies_on_pipeline_module_partition_hook():
    p = "set_stage_bounds"
    relies(p, "PipelineModule._partition_layers(method)",
           params(member(p, PipelineModule, "_partition_layers")) == ["self", "method"],
           "its parameters changed")
    relies(p, "PipelineModule._set_bounds(start, stop)",
           params(member(p, PipelineModule, "_set_bounds")) == ["self", "start", "stop"],
           "its parameters changed")
    init = source(PipelineModule.__init__)
    relies(p, "PipelineModule.__init__", appears_in_order(init, "self.global_rank =", "self._topo = topology",
           "self._partition_layers(method=partition_method)", "self._build()"),
           "_partition_layers is no longer called after _topo/global_rank are set and before _build()")
    build = source(member(p, PipelineModule, "_build"))
    relies(p, "PipelineModule._build", "self._local_start:self._local_stop" in build,
           "_build no longer builds the layers in [_local_start, _local_stop)")


def test_explicit_pipeline_module_overrides_the_partition_hook():
    relies("ExplicitPipelineModule", "PipelineModule._partition_layers",
           pipeline.ExplicitPipelineModule._partition_layers is not PipelineModule._partition_layers
           and hasattr(PipelineModule, "_partition_layers"), "the hook it overrides is gone")
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=1)
    module = pipeline.ExplicitPipelineModule.__new__(pipeline.ExplicitPipelineModule)
    torch.nn.Module.__init__(module)
    module._explicit_parts, module._topo, module.global_rank = [0, 3, 5], topo, 1
    module._partition_layers()
    assert (module._local_start, module._local_stop) == (3, 5) and module.partitions() == [0, 3, 5]


def test_stage_layers_relies_on_forward_funcs():
    build = source(member("stage_layers", PipelineModule, "_build"))
    relies("stage_layers", "PipelineModule._build", "self.forward_funcs.append(" in build,
           "the stage's layers are no longer kept in forward_funcs")
    module = types.SimpleNamespace(forward_funcs=[abs, len])
    assert pipeline.stage_layers(module) == [abs, len]


def test_checkpointable_layers_set_after_the_build_are_the_ones_read():
    """set_checkpointable_layers after PipelineModule.__init__: DeepSpeed reads the names only when the engine
    precomputes which segments it checkpoints; stage_layer_range is _build's [_local_start, _local_stop)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    p = "set_checkpointable_layers"
    check = source(member(p, PipelineModule, "_is_checkpointable"))
    relies(p, "PipelineModule._is_checkpointable", "f.__class__.__name__ in self.checkpointable_layers" in check,
           "a segment's layers are no longer matched by class name against checkpointable_layers")
    relies(p, "PipelineModule.__init__", "_precompute_checkpointable_values" not in source(PipelineModule.__init__),
           "__init__ now decides which segments to checkpoint, before the names are set")
    relies(p, "PipelineEngine.__init__", "self.module._precompute_checkpointable_values()" in
           source(PipelineEngine.__init__), "the engine no longer precomputes the segments' answers")
    module = PipelineModule.__new__(PipelineModule)
    torch.nn.Module.__init__(module)
    module.activation_checkpoint_func, module.checkpointable_layers = checkpointing.checkpoint, ["Linear"]
    pipeline.set_checkpointable_layers(module, {"ReLU", "Linear"})
    assert module._is_checkpointable([torch.nn.ReLU(), torch.nn.Linear(1, 1)])
    assert not module._is_checkpointable([torch.nn.Tanh()])
    module._set_bounds(start=3, stop=5)
    assert pipeline.stage_layer_range(module) == range(3, 5)


def test_set_stage_bounds_gives_each_rank_its_stage_range():
    topo = PipeModelDataParallelTopology(num_pp=3, num_mp=2, num_dp=1)
    parts = [0, 2, 5, 9]
    for rank in range(topo.world_size()):
        module = PipelineModule.__new__(PipelineModule)
        torch.nn.Module.__init__(module)
        module._topo, module.global_rank = topo, rank
        pipeline.set_stage_bounds(module, parts)
        stage = topo.get_coord(rank).pipe
        assert (module._local_start, module._local_stop) == (parts[stage], parts[stage + 1])
        assert module.partitions() is parts


# -- read, not patched (train/probe.py, plan/memory.py, ZeRO-3 parameter attributes) ---------------------

def test_probe_relies_on_checkpoint_and_bucket_names():
    p = "checkpoint_saved_tensors"
    forward = source(member(p, checkpointing.CheckpointFunction, "forward"))
    relies(p, "CheckpointFunction.forward", f"ctx.{accounting.CHECKPOINT_SAVED_TENSORS} =" in forward,
           "inputs are no longer kept there")
    relies(p, "checkpointing.py", f".{accounting.OFFLOADED_DATA} =" in source(checkpointing),
           "partitioned/offloaded activations no longer keep their data there")
    for cls in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
        relies("ZERO_BUCKETS", f"{cls.__name__}.__init__", f"self.{accounting.ZERO_BUCKETS}" in source(cls.__init__),
               "the gradient buckets were renamed")
    configure = source(member("engine_optimizers", DeepSpeedEngine, "_configure_optimizer"))
    relies("engine_optimizers", "DeepSpeedEngine.basic_optimizer",
           "self.basic_optimizer = basic_optimizer" in configure, "the client optimizer is no longer kept there")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert ds_optimizer.engine_optimizers(types.SimpleNamespace(optimizer=opt, basic_optimizer=opt)) == [opt]


def test_zero_offloaded_relies_on_offload_buffer_names():
    p = "zero_offloaded"
    stage3 = source(deepspeed.runtime.zero.stage3)
    for attr in ("grad_partitions_flat_buffer", "fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat"):
        relies(p, f"DeepSpeedZeroOptimizer_Stage3.{attr}", f"self.{attr} =" in stage3 or f"self.{attr}: " in stage3,
               "no longer set")
    member(p, DeepSpeedZeroOptimizer_Stage3, "_release_sub_group")
    release = stage3[stage3.index("def _release_sub_group"):]
    release = release[:release.index("\n    def ")]
    relies(p, "DeepSpeedZeroOptimizer_Stage3._release_sub_group", "if not self.offload_optimizer:\n            "
           "self.fp32_partitioned_groups_flat[sub_group_id].grad = None" in release,
           "it may now free the offloaded fp32 gradients (the planner counts every sub-group's)")
    stage12 = source(deepspeed.runtime.zero.stage_1_and_2)
    for attr in ("single_partition_of_fp32_groups", "param_buffer_of_bit16_for_cpu_offload_groups",
                 "accumulated_grads_in_cpu", "temp_grad_buffer_for_cpu_offload"):
        relies(p, f"DeepSpeedZeroOptimizer.{attr}", f"self.{attr} =" in stage12, "no longer set")
    held = {"optimizer.grad_partitions_flat_buffer": 8, "optimizer.fp32_partitioned_groups_flat[0].grad": 4,
            "optimizer.fp32_partitioned_groups_flat[0]": 4, "optimizer.fp16_partitioned_groups_flat[0]": 2,
            "optimizer.optimizer.state[.][exp_avg]": 4, "optimizer.optimizer.state[.][exp_avg_sq]": 4,
            "optimizer.optimizer.state[.][step]": 4, "optimizer.ipg_buckets[.].buffer": 100}
    assert accounting.zero_offloaded(held) == {"parameters": 2, "gradients": 12, "master_weights": 4, "adam_moments": 8}
    held = {"optimizer.single_partition_of_fp32_groups[0]": 4, "optimizer.single_partition_of_fp32_groups[0].grad": 4,
            "optimizer.param_buffer_of_bit16_for_cpu_offload_groups[0]": 2, "optimizer.accumulated_grads_in_cpu[3]": 6,
            "optimizer.temp_grad_buffer_for_cpu_offload": 1, "optimizer.temp_grad_buffer_for_gpu_offload": 1,
            "optimizer.optimizer.state[.][exp_avg]": 8}
    assert accounting.zero_offloaded(held) == {"parameters": 2, "gradients": 11, "master_weights": 4, "adam_moments": 8}


def test_zero3_parameter_attributes_and_allreduce_size():
    src = source(partition_parameters)
    for attr in ("ds_shape", "ds_tensor", "ds_id"):
        relies("(read) zero3.py", f"param.{attr}", f"param.{attr} =" in src, "no longer set")
    from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE
    relies("(read) accounting.ENGINE_ALLREDUCE_BUCKET", "engine.MEMORY_OPT_ALLREDUCE_SIZE", MEMORY_OPT_ALLREDUCE_SIZE ==
           accounting.ENGINE_ALLREDUCE_BUCKET, f"{MEMORY_OPT_ALLREDUCE_SIZE} != ENGINE_ALLREDUCE_BUCKET")


def test_monitor_events_rely_on_monitor_master_attributes():
    from deepspeed.monitor import monitor, wandb as wandb_monitor
    p = "write_monitor_events"
    master = source(monitor.MonitorMaster)
    for attr in ds_monitor.MONITORS:
        relies(p, f"MonitorMaster.{attr}", f"self.{attr} = None" in master and f"self.{attr}.write_events" in master,
               "no longer set to None or a monitor with write_events")
    relies(p, "WandbMonitor.__init__", "dist.get_rank() == 0:\n            wandb.init(" in source(wandb_monitor.WandbMonitor),
           "wandb.init is no longer called on rank 0 only")


def test_shm_buffer_name_is_the_one_deepspeed_creates():
    p = "unlink_shm_buffer"
    comm = os.path.join(os.path.dirname(deepspeed.__file__), "ops", "csrc", "cpu", "comm")
    shm, interface = (open(os.path.join(comm, f)).read() for f in ("shm.cpp", "shm_interface.cpp"))
    prefix = ds_shm.SHM_BUFFER.split("/")[-1].split("_{uid}")[0]
    relies(p, "shm.cpp SHM_BUFFER_NAME", f'#define SHM_BUFFER_NAME "{prefix}"' in shm, "the name changed")
    relies(p, "shm.cpp shm_initialize's names", '"%s_%d_%s_%s",\n             SHM_BUFFER_NAME,\n             getuid(),\n'
           "             addr_string,\n             port_string);" in shm and
           'snprintf(shm_name, NAME_BUF_SIZE, "%s_%d", shm_name_prefix, rank);' in shm, "the name's parts changed")
    relies(p, "shm_interface.cpp initialize", all(f'getenv("{v}")' in interface for v in
                                                  ("LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")),
           "it no longer reads LOCAL_SIZE, MASTER_ADDR and MASTER_PORT")


def test_build_op_relies_on_the_builder_init_distributed_loads():
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")     # deepspeed.comm's `torch` is torch itself
    p = "build_op"
    relies(p, "deepspeed.comm.torch.build_shm_op()", params(getattr(ds_torch_comm, "build_shm_op", None) or
                                                             (lambda missing: None)) == [], "it no longer exists")
    relies(p, "TorchBackend.__init__ builds it", "build_shm_op()" in inspect.getsource(ds_torch_comm.TorchBackend),
           "init_distributed no longer loads the op through it")


# -- zero_holds_master (read by checkpoints/relayout.py) ---------------------------------------------------------

def test_zero_holds_master_relies_on_the_safe_accessors_and_state_views():
    import importlib
    fragments = importlib.import_module("deepspeed.utils.tensor_fragment")    # the module, not the class
    p = "zero_holds_master"
    for fn in (fragments.safe_set_full_fp32_param, fragments.safe_set_full_optimizer_state,
               fragments.safe_get_full_optimizer_state):
        body = source(fn)
        relies(p, f"{fn.__name__}", "hasattr(param, 'ds_id')" in body and "hasattr(param, '_hp_mapping')" in body,
               "it no longer dispatches on ds_id / _hp_mapping")
    relies(p, "tensor_fragment.set_optim_state_fragment", "value.shape == flat_hp_partition.shape" in
           source(member(p, fragments.tensor_fragment, "set_optim_state_fragment")),
           "ZeRO-1/2 no longer view every optimizer state of the flat partition's shape")
    relies(p, "DeepSpeedZeroOptimizer_Stage3._get_fp32_opt_state_partition",
           "self.optimizer.state[fp32_param][optim_state_key]" in
           source(member(p, DeepSpeedZeroOptimizer_Stage3, "_get_fp32_opt_state_partition")),
           "ZeRO-3 no longer reads optimizer state per flat fp32 partition")


def test_zero_holds_master_tells_zero_parameters_from_plain_ones():
    plain = torch.nn.Parameter(torch.zeros(2))
    assert not ds_optimizer.zero_holds_master(plain)
    for attr in ("ds_id", "_hp_mapping"):
        marked = torch.nn.Parameter(torch.zeros(2))
        setattr(marked, attr, None)
        assert ds_optimizer.zero_holds_master(marked)


def test_zero3_helpers_read_partitioned_and_plain_parameters():
    plain = torch.nn.Parameter(torch.arange(6.0).view(2, 3))
    assert not zero3.is_partitioned(plain) and zero3.full_shape(plain) == (2, 3)
    assert zero3.local_data(plain).data_ptr() == plain.data_ptr()
    marked = torch.nn.Parameter(torch.empty(0))           # ZeRO-3: a placeholder, the partition aside
    marked.ds_id, marked.ds_shape, marked.ds_tensor = 7, torch.Size([2, 3]), torch.nn.Parameter(torch.ones(3))
    assert zero3.is_partitioned(marked) and zero3.full_shape(marked) == (2, 3)
    torch.testing.assert_close(zero3.local_data(marked), torch.ones(3))


# -- skip.py ------------------------------------------------------------------------------------------

def test_skipped_update_relies_on_the_overflow_paths():
    take = source(member("skipped_update", DeepSpeedEngine, "_take_model_step"))
    relies("skipped_update", "DeepSpeedEngine._take_model_step",
           appears_in_order(take, "self.optimizer.step()", 'hasattr(self.optimizer, "overflow")',
                            "self.skipped_steps += 1", "self.lr_scheduler.step"),
           "it no longer reads optimizer.overflow after optimizer.step() to skip the LR schedule")
    step = source(member("skipped_update", DeepSpeedZeroOptimizer, "step"))
    relies("skipped_update", "DeepSpeedZeroOptimizer.step",
           appears_in_order(step, "if self.check_grad_overflow:", "self.check_overflow(", "if self.overflow:",
                            "self.averaged_gradients[k] = None", "return"),
           "its overflow branch no longer follows check_overflow() and clears the partitioned gradients")


def test_skipped_update_leaves_a_torch_optimizer_as_it_was():
    from parallel.distributed.deepspeed.skip import skipped_update
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    engine = types.SimpleNamespace(optimizer=opt)
    p.grad = torch.ones(2)
    with skipped_update(engine):
        opt.step()
        assert opt.overflow is True
    assert torch.equal(p, torch.ones(2)) and "overflow" not in vars(opt) and "step" not in vars(opt)
    opt.step()
    assert torch.equal(p.detach(), torch.zeros(2))


def test_guard_pipeline_updates_relies_on_the_optimizer_step_instruction():
    from deepspeed.runtime.pipe.engine import PipelineEngine
    step = source(member("guard_pipeline_updates", PipelineEngine, "_exec_optimizer_step"))
    relies("guard_pipeline_updates", "PipelineEngine._exec_optimizer_step", "self._take_model_step(lr_kwargs)" in step,
           "it no longer applies the update through self._take_model_step(lr_kwargs)")
    forward = source(member("guard_pipeline_updates", PipelineEngine, "_exec_forward_pass"))
    relies("guard_pipeline_updates", "PipelineEngine._exec_forward_pass",
           "self.total_loss = add_to_total_loss(self.total_loss, self.loss)" in forward,
           "the last stage no longer sums the micro-batches' losses into total_loss")
    for name in ("is_last_stage", "gradient_accumulation_steps"):
        member("guard_pipeline_updates", PipelineEngine, name)


def test_before_pipeline_update_runs_first_on_every_rank():
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from parallel.distributed.deepspeed.skip import before_pipeline_update
    step = source(member("before_pipeline_update", PipelineEngine, "_exec_optimizer_step"))
    relies("before_pipeline_update", "PipelineEngine._exec_optimizer_step", "self._take_model_step(lr_kwargs)" in step,
           "it no longer applies the update through self._take_model_step(lr_kwargs)")
    calls = []
    engine = types.SimpleNamespace(_take_model_step=lambda lr_kwargs=None: calls.append(("step", lr_kwargs)))
    before_pipeline_update(engine, lambda: calls.append("first"))
    engine._take_model_step({"lr": 1})
    assert calls == ["first", ("step", {"lr": 1})]


# -- traceable_ulysses ------------------------------------------------------------------------------------

def test_traceable_ulysses_relies_on_single_all_to_all_calling_post_all2all():
    from deepspeed.sequence import layer
    p = "traceable_ulysses"
    post = member(p, layer, "post_all2all")
    relies(p, "deepspeed.sequence.layer.post_all2all", params(post) == ["permute_idx", "res_shape"] and appears_in_order(
        source(post), "input = input.permute(permute_idx).contiguous()", "output = input.reshape(res_shape).contiguous()",
        "return output"), "its layout step changed")
    exchange = source(member(p, layer, "single_all_to_all"))
    relies(p, "deepspeed.sequence.layer.single_all_to_all", appears_in_order(
        exchange, "post_all2all_fun = post_all2all(post_all2all_permute_idx, post_all2all_res_shape)",
        "res = post_all2all_fun(output)", "return res"), "it no longer returns post_all2all's result")


@pytest.mark.parametrize("batch", [1, 2])           # batch 1: the permute is contiguous already
@pytest.mark.parametrize("scatter_idx, gather_idx", [(2, 1), (1, 2)])    # q, k, v in; the output back
def test_traceable_ulysses_gives_deepspeeds_values_and_layout(monkeypatch, batch, scatter_idx, gather_idx):
    """The patched layout step returns what DeepSpeed's does (values, shape, strides), without its last call,
    which returned its input; installed once however often it is asked for."""
    from deepspeed.sequence import layer
    original = layer.post_all2all
    monkeypatch.setattr(layer, "post_all2all", original)          # DeepSpeed's again after the test
    ulysses.traceable_ulysses()
    ulysses.traceable_ulysses()
    assert layer.post_all2all is ulysses._post_all2all
    sp, tokens, heads, d = 2, 6, 4, 3
    shape = (batch, tokens // sp, heads, d) if scatter_idx == 2 else (batch, tokens, heads // sp, d)
    x = torch.randn(shape)
    pre_permute, pre_shape, permute, res_shape = layer._generate_layout_params(scatter_idx, 0, sp, x)
    exchanged = layer.pre_all2all_fun(pre_permute, pre_shape, x)    # the all-to-all's layout (its values: any)
    want, got = original(permute, res_shape)(exchanged), layer.post_all2all(permute, res_shape)(exchanged)
    assert torch.equal(got, want) and got.shape == want.shape and got.stride() == want.stride() and got.is_contiguous()

