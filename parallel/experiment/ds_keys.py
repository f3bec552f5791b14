"""Every top-level key DeepSpeed 0.19 reads from its JSON, and what the toolkit does with it.

A key is honoured (the toolkit acts on it, or hands it to DeepSpeed, which does the work) or refused
before launch with the reason and what to use instead; none is accepted and then ignored. A key
DeepSpeed does not read is refused as unknown, with a did-you-mean. `tests/unit/test_ds_keys.py` walks the
keys DeepSpeed's own `DeepSpeedConfig` reads and fails when one is missing here, and checks that
docs/deepspeed-keys.md is this table as `python -m parallel.experiment.ds_keys` renders it.
"""
from __future__ import annotations

import difflib
import importlib.util
import sys
from typing import Any, NamedTuple

from parallel.experiment.ds_config import EMA_OPTIMIZERS


class Key(NamedTuple):
    verdict: str      # "honoured" or "refused"
    how: str          # what the toolkit does with it, or why it is refused and what to use instead
    tests: str = ""   # the tests that exercise it


HONOURED, REFUSED = "honoured", "refused"
_REMOVED = "removed from DeepSpeed 0.19 (its initialize refuses it, after the process groups exist)"
_NOT_HERE = "the toolkit's training loop never calls it"

KEYS: dict[str, Key] = {
    # batch
    "train_batch_size": Key(HONOURED, "derived: train.micro_batch_size x train.grad_accum_steps x dp; \"auto\" or "
                            "absent is filled in, a different number is refused", "test_check: "
                            "test_dp_and_batch_keys_must_agree, test_every_violation_is_reported_at_once"),
    "train_micro_batch_size_per_gpu": Key(HONOURED, "must equal train.micro_batch_size (filled in when absent or "
                                          "\"auto\")", "test_check: test_dp_and_batch_keys_must_agree"),
    "gradient_accumulation_steps": Key(HONOURED, "must equal train.grad_accum_steps (filled in when absent or "
                                       "\"auto\")", "test_check: test_dp_and_batch_keys_must_agree"),
    # optimizer and schedule
    "optimizer": Key(HONOURED, "built by the toolkit (parallel/train/optim.py): type AdamW, Adam, FusedEmaAdam or "
                     "EmaAdamW; params lr (= train.lr), betas, eps, weight_decay, amsgrad, ema_decay, \"auto\" "
                     "filled (parallel/experiment/ds_config.py AUTO_KEYS); DeepSpeed's torch_adam (either: the toolkit picks "
                     "the kernel) and adam_w_mode true; other types and params refused", "test_check: test_optimizer_type_and_lr_are_checked; test_ds_keys: "
                     "test_optimizer_params_are_checked"),
    "scheduler": Key(HONOURED, "WarmupLR, WarmupDecayLR, WarmupCosineLR built by the toolkit with DeepSpeed's "
                     "formulas, keys shared with train.* filled in or refused; OneCycle, LRRangeTest and torch "
                     "scheduler names refused (parallel/train/schedule.py)", "test_ds_schedule, test_ds_json_cli"),
    "gradient_clipping": Key(HONOURED, "DeepSpeed clips to it, with the toolkit's replica grad norm (tensor-parallel "
                             "shards counted once)",
                             "test_ds_json_distributed: test_gradient_clipping_reaches_the_step"),
    # precision
    "fp16": Key(HONOURED, "passed to DeepSpeed; refused before launch where the accelerator has no fp16 (DeepSpeed's "
                "CPU accelerator here), naming bf16 or fp32", "test_ds_precision, test_ds_json_cli"),
    "bf16": Key(HONOURED, "passed to DeepSpeed; refused where the accelerator has no bf16; with a pipeline needs "
                "ZeRO-1 and data_types.grad_accum_dtype fp32", "test_train_bf16, test_ds_precision, test_check"),
    "bfloat16": Key(HONOURED, "DeepSpeed's other name for bf16, checked the same way", "test_ds_precision"),
    "data_types": Key(HONOURED, "passed to DeepSpeed; grad_accum_dtype checked against the ZeRO stage and the "
                      "pipeline", "test_check: test_bf16_zero0_with_fp32_accumulation_is_refused"),
    "communication_data_type": Key(HONOURED, "passed to DeepSpeed: the dtype of the data-parallel gradient "
                                   "reduction (fp32, fp16 or bf16; default: the training precision), so bf16 halves "
                                   "an fp32 run's gradient bytes at some loss of precision; the planner sizes buckets "
                                   "and the data-parallel time with it; bench/comm.py measures the bytes. Other values "
                                   "refused", "test_comm_compression: test_communication_data_type; test_compile_layouts: "
                                   "test_compiled_blocks_train_like_eager (its gradient bytes)"),
    "torch_autocast": Key(REFUSED, "DeepSpeed's torch.autocast mode is not exercised with the toolkit's models or "
                          "the pipeline engine; use \"bf16\" (mixed precision with fp32 master weights)"),
    # ZeRO
    "zero_optimization": Key(HONOURED, "passed to DeepSpeed: stage 0-3 (2 and 3 need parallel.pp_size=1), buckets, "
                             "offload_optimizer, offload_param; its keys are checked (the zero_optimization table "
                             "below)", "test_train_equivalence, test_check, test_ds_keys, test_ds_json_distributed"),
    "zero_allow_untested_optimizer": Key(HONOURED, "passed to DeepSpeed; the toolkit sets it true when absent (its "
                                         "EmaAdamW is an AdamW subclass, tested under ZeRO)"),
    "zero_force_ds_cpu_optimizer": Key(HONOURED, "false (the toolkit's default with offload) is passed on; true is "
                                       "refused: it demands DeepSpeed's CPU Adam, and the toolkit builds the "
                                       "optimizer", "test_ds_keys: test_conditional_refusals"),
    "aio": Key(HONOURED, "passed to DeepSpeed (asynchronous I/O for offload to nvme)"),
    # engine and pipeline
    "pipeline": Key(HONOURED, "pipe_partitioned and grad_partitioned false (the toolkit's default: its stages pass "
                    "two tensors, DeepSpeed partitions only the first); stages, partition, seed_layers, "
                    "activation_checkpoint_interval and use_reentrant are refused (parallel.pp_size, "
                    "parallel.pp_partition and the activation_checkpointing section say those)",
                    "test_ds_keys: test_conditional_refusals"),
    "activation_checkpointing": Key(HONOURED, "configures deepspeed.checkpointing for the toolkit's blocks "
                                    "(number_checkpoints groups them)", "test_train_equivalence"),
    "checkpoint": Key(HONOURED, "passed to DeepSpeed: tag_validation, load_universal (universal checkpoints), "
                      "use_node_local_storage, parallel_write"),
    "steps_per_print": Key(HONOURED, "passed to DeepSpeed (its progress line every N steps); DeepSpeed logs it at "
                           "INFO, so a value <= train.max_steps without \"log_level\": \"info\" is refused",
                           "test_ds_json_cli: test_engine_keys_reach_deepspeed; "
                           "test_ds_keys: test_conditional_refusals"),
    "wall_clock_breakdown": Key(HONOURED, "passed to DeepSpeed (its forward/backward/step timers, printed every "
                                "steps_per_print)", "test_ds_json_cli: test_engine_keys_reach_deepspeed"),
    "memory_breakdown": Key(HONOURED, "passed to DeepSpeed (memory logged at INFO during the step); refused true "
                            "without \"log_level\": \"info\"", "test_ds_keys: test_conditional_refusals"),
    "dump_state": Key(HONOURED, "passed to DeepSpeed (logs the engine's configuration at start, at INFO); refused "
                      "true without \"log_level\": \"info\"",
                      "test_ds_json_cli: test_engine_keys_reach_deepspeed; test_ds_keys: test_conditional_refusals"),
    "timers": Key(HONOURED, "passed to DeepSpeed (throughput timer settings)"),
    "log_level": Key(HONOURED, "passed to DeepSpeed (its logger's level; WARNING when absent)",
                     "test_ds_json_cli: test_engine_keys_reach_deepspeed"),
    "prescale_gradients": Key(HONOURED, "passed to DeepSpeed (gradient reduction)"),
    "gradient_predivide_factor": Key(HONOURED, "passed to DeepSpeed (gradient reduction)"),
    "gradient_allreduce_op": Key(HONOURED, "passed to DeepSpeed (mean or sum over data-parallel ranks)"),
    "managed_gradient_accumulation": Key(HONOURED, "true (DeepSpeed's default) is passed on; false is refused: "
                                         "DeepSpeed refuses it with a pipeline, and the toolkit's accumulation "
                                         "is tested with DeepSpeed managing it", "test_ds_keys: "
                                         "test_conditional_refusals"),
    # monitors and profilers
    "tensorboard": Key(HONOURED, "DeepSpeed's monitor receives every metrics.jsonl figure (plus DeepSpeed's own "
                       "Train/Samples/lr, the next step's lr); refused when enabled and the tensorboard package is "
                       "not installed (the test extra installs it)", "test_ds_json_cli: "
                       "test_tensorboard_gets_every_figure_of_metrics_jsonl; test_ds_keys: "
                       "test_monitor_without_its_package_is_refused"),
    "csv_monitor": Key(HONOURED, "DeepSpeed's monitor receives every metrics.jsonl figure",
                       "test_ds_json_cli: test_csv_monitor_gets_every_figure_of_metrics_jsonl"),
    "wandb": Key(HONOURED, "every metrics.jsonl figure, with the step as its x-axis (wandb.define_metric; "
                 "WANDB_MODE=offline works offline); refused when enabled and wandb is not installed",
                 "test_ds_json_cli: test_wandb_gets_every_figure_of_metrics_jsonl"),
    "comet": Key(HONOURED, "DeepSpeed's monitor receives every metrics.jsonl figure; refused when enabled and "
                 "comet_ml is not installed", "test_ds_keys: test_monitor_without_its_package_is_refused"),
    "flops_profiler": Key(HONOURED, "passed to DeepSpeed with parallel.pp_size=1: it prints the profile of "
                          "DeepSpeed's global step profile_step (counted from 0: the toolkit's step profile_step + 1), "
                          "once per micro-batch when train.grad_accum_steps > 1, and turns on DeepSpeed's "
                          "wall-clock timer lines; refused enabled with a pipeline (DeepSpeed's pipeline engine never "
                          "prints it)", "test_ds_json_cli: test_flops_profiler_prints_its_profile_at_pp1; "
                          "test_ds_keys: test_conditional_refusals"),
    "comms_logger": Key(HONOURED, "DeepSpeed times the collectives that go through deepspeed.comm (the engine's "
                        "parameter broadcast and gradient reduction); train.py prints its summary "
                        "(deepspeed.comm.log_summary) after the last step. Honoured when every rank is a data-"
                        "parallel replica (tp = sp = pp = 1): its busbw divides by the whole world's size, and the "
                        "toolkit's tensor- and sequence-parallel collectives do not go through deepspeed.comm (count "
                        "those with parallel.distributed.comm.count_comm); refused otherwise. verbose=true needs "
                        "\"log_level\": \"info\"", "test_ds_json_cli: test_comms_logger_prints_its_summary_at_pp1; "
                        "test_ds_keys: test_conditional_refusals"),
    # parallelism the toolkit does itself
    "tensor_parallel": Key(REFUSED, "DeepSpeed's AutoTP would re-shard the toolkit's tensor-parallel layers; use "
                           "parallel.tp_size"),
    "sequence_parallel_size": Key(REFUSED, "DeepSpeed's own Ulysses groups are not the toolkit's; use "
                                  "parallel.sp_size"),
    "seq_parallel_communication_data_type": Key(REFUSED, "DeepSpeed applies it only to its own sequence-parallel "
                                                "groups, which the toolkit does not use (parallel.sp_size); "
                                                "communication_data_type sets gradient reduction"),
    "expert_parallel": Key(REFUSED, "mixture-of-experts; these models have no expert layers"),
    "use_data_before_expert_parallelism": Key(REFUSED, "mixture-of-experts; these models have no expert layers"),
    "autotuning": Key(REFUSED, "read only by `deepspeed --autotuning`, which relaunches with its own batch and "
                      "ZeRO choices; the toolkit derives the batch from the experiment: use python -m parallel.plan"),
    # features the toolkit's loop does not drive
    "dataloader_drop_last": Key(REFUSED, "applies to DeepSpeed's own dataloader (training_data=), which the toolkit "
                                "does not use: it feeds every sample of the data set, sharded over dp ranks"),
    "data_efficiency": Key(REFUSED, "curriculum sampling and random-LTD need DeepSpeed's dataloader and "
                           "layer hooks, which the toolkit does not use"),
    "compile": Key(REFUSED, "DeepSpeed compiles only when the script calls engine.compile(), which the toolkit "
                   "never calls; use train.compile (the experiment YAML: each block compiled, one graph per block "
                   "class)"),
    "disable_python_gc": Key(REFUSED, "turns off Python's cyclic garbage collector and expects the script to call "
                             "engine.collect_python_gc(); " + _NOT_HERE),
    "hybrid_engine": Key(REFUSED, "DeepSpeed's RLHF generation engine for transformers models; not a "
                         "diffusion-training feature"),
    "weight_quantization": Key(REFUSED, "weight quantization for inference (ZeRO-Inference); these are "
                               "training runs"),
    "datastates_ckpt": Key(REFUSED, "DataStates asynchronous checkpointing needs the datastates package and is "
                           "untested with the toolkit's atomic checkpoint publishing (parallel/checkpoints/checkpoint.py)"),
    "disable_allgather": Key(REFUSED, "DeepSpeed 0.19 reads it and never uses it"),
    "vocabulary_size": Key(REFUSED, "a language-model setting (DeepSpeed only warns when it is not a multiple of "
                           "8); these models have no vocabulary"),
    # removed from DeepSpeed itself
    "amp": Key(REFUSED, "NVIDIA Apex AMP, " + _REMOVED + "; use \"bf16\" or \"fp16\""),
    "elasticity": Key(REFUSED, "elastic training, " + _REMOVED + "; use launch.sh --nnodes MIN:MAX "
                      "(torchrun's elastic agent): a run that loses a node restarts on the rest, keeping the "
                      "global batch by train.grad_accum_steps at a fixed micro-batch, every world size checked at "
                      "start (parallel/elastic.py)", "test_elastic: test_deepspeed_elasticity_is_refused_by_name"),
    "sparse_attention": Key(REFUSED, "DeepSpeed sparse attention, " + _REMOVED),
    "sparse_gradients": Key(REFUSED, "sparse embedding-gradient compression, " + _REMOVED),
    "compression_training": Key(REFUSED, "the compression library, " + _REMOVED),
    "quantize_training": Key(REFUSED, "Mixture-of-Quantization, " + _REMOVED),
    "eigenvalue": Key(REFUSED, "eigenvalue-based MoQ, " + _REMOVED),
    "progressive_layer_drop": Key(REFUSED, "progressive layer dropping, " + _REMOVED),
    "curriculum_learning": Key(REFUSED, "the top-level curriculum_learning section, " + _REMOVED),
    "graph_harvesting": Key(REFUSED, "graph harvesting, " + _REMOVED),
    "nebula": Key(REFUSED, "Nebula checkpointing, " + _REMOVED),
}

_PASSED = "passed to DeepSpeed"
SAVE_16BIT = "read only by engine.save_16bit_model(), which the toolkit never calls; export weights with python -m " \
    "parallel.export"
SAVE_16BIT_KEYS = ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
                   "stage3_gather_fp16_weights_on_model_save")
_STAGE3 = "passed to DeepSpeed at stage 3; refused below (only ZeRO-3 reads it)"
_UNTESTED = "untested with the toolkit's layers and optimizer; remove it"

# zero_optimization's keys: DeepSpeedZeroConfig's fields and their stage3_ aliases (DeepSpeed accepts both).
# DeepSpeed refuses an unknown one itself, but inside initialize; here it is refused before launch.
ZERO_KEYS: dict[str, Key] = {
    "stage": Key(HONOURED, "0, 1, 2 or 3; 2 and 3 need parallel.pp_size=1", "test_check, test_train_equivalence"),
    **{k: Key(HONOURED, _PASSED + " (communication buckets and overlap; the planner reads the sizes)")
       for k in ("contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
                 "allgather_partitions", "allgather_bucket_size", "overlap_comm", "round_robin_gradients")},
    **{k: Key(HONOURED, _PASSED) for k in ("load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters",
                                            "parameter_alignment", "log_trace_cache_warnings", "enable_sanity_checks")},
    "compute_grad_norm": Key(HONOURED, "true (the default) is passed on; false is refused: the toolkit logs grad_norm "
                             "and clips with it"),
    "offload_optimizer": Key(HONOURED, "passed to DeepSpeed at stages 1-3 (the toolkit's torch AdamW runs on the "
                             "CPU); refused at stage 0, where DeepSpeed ignores it",
                             "test_ds_json_distributed: test_zero2_cpu_optimizer_offload_trains_like_one_process_and_"
                             "holds_the_planned_host_memory, test_zero3_cpu_offload_trains_like_one_process_and_holds_"
                             "the_planned_host_memory"),
    "offload_param": Key(HONOURED, _STAGE3, "test_ds_json_distributed: test_zero3_cpu_offload_trains_like_one_"
                         "process_and_holds_the_planned_host_memory; test_check: zero3_bf16_offload passes"),
    **{k: Key(HONOURED, _STAGE3) for k in (
        "sub_group_size", "memory_efficient_linear", "override_module_apply", "leaf_module",
        "prefetch_bucket_size", "stage3_prefetch_bucket_size", "param_persistence_threshold",
        "stage3_param_persistence_threshold", "model_persistence_threshold", "stage3_model_persistence_threshold",
        "max_live_parameters", "stage3_max_live_parameters", "max_reuse_distance", "stage3_max_reuse_distance",
        "module_granularity_threshold", "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
        "stage3_use_all_reduce_for_fetch_params", "allgather_sequential", "stage3_allgather_sequential")},
    **{k: Key(HONOURED, "false (DeepSpeed's default; \"auto\" is filled false) is passed on; true is refused: "
              + SAVE_16BIT, "test_ds_json_cli: test_cogvideo_finetune_configs_pass_the_checker") for k in SAVE_16BIT_KEYS},
    **{k: Key(REFUSED, "deprecated by DeepSpeed; use offload_optimizer / offload_param")
       for k in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory")},
    # ZeRO++ (docs/performance.md, communication compression). The quantised ones run DeepSpeed's
    # QuantizerBuilder kernels, which DeepSpeed has for CUDA and Ascend NPUs: its CPU accelerator answers with a
    # NotImplementedBuilder, and initialize fails inside the first all-gather.
    **{k: Key(HONOURED, "ZeRO-3 only; CUDA or Ascend NPU: " + how + "; refused below stage 3, and on an accelerator without "
              "DeepSpeed's quantizer kernels (the CPU here: its QuantizerBuilder is not implemented), naming "
              "communication_data_type (bf16 halves fp32 gradient traffic on any device) as what works",
              "test_comm_compression: test_zero_plus_plus_quantisation")
       for k, how in (("zero_quantized_weights", "int8 weights (block scales) in the forward all-gather, about 1/2 of "
                       "bf16's bytes; the planner counts them"),
                      ("zero_quantized_nontrainable_weights", "int8 copies of frozen weights (LoRA's base); the "
                       "planner does not count them"),
                      ("zero_quantized_gradients", "int4 gradients in an all-to-all reduce-scatter, about 1/8 of "
                       "fp32's bytes; the planner counts them"))},
    "zero_hpz_partition_size": Key(HONOURED, "ZeRO-3 only (refused below): a secondary copy of the weights "
                                   "partitioned over this many ranks (a node's GPUs), so backward's all-gather stays "
                                   "in the node; the planner moves that all-gather to the intra-node link. It must "
                                   "divide the data-parallel size",
                                   "test_comm_compression: test_zero_plus_plus_hierarchical_partition"),
    "zenflow": Key(REFUSED, "ZenFlow's stall-free offload: " + _UNTESTED),
    "legacy_stage1": Key(REFUSED, "DeepSpeed's old stage-1 code path: " + _UNTESTED),
    "pipeline_loading_checkpoint": Key(REFUSED, "applies to models built under deepspeed.zero.Init, which the "
                                       "toolkit does not use"),
    "save_muon_momentum_buffer_in_memory": Key(REFUSED, "for DeepSpeed's Muon optimizer; the toolkit builds AdamW"),
}
STAGE3_ONLY = frozenset(k for k, v in ZERO_KEYS.items() if v.how.startswith(_STAGE3))
ZERO_PLUS_PLUS = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
                  "zero_hpz_partition_size")
ZERO_QUANTIZED = ZERO_PLUS_PLUS[:3]          # these need DeepSpeed's quantizer kernels (CUDA)
COMMUNICATION_DTYPES = ("fp32", "fp16", "bf16")

# The keys DeepSpeed reads inside other honoured sections -> whether it ignores an unknown one silently
# (its dict-style readers) or refuses it inside initialize (its pydantic ones). Checked before launch.
SUBKEYS: dict[str, tuple[tuple[str, ...], bool]] = {
    "activation_checkpointing": (("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                                  "number_checkpoints", "synchronize_checkpoint_boundary", "profile"), True),
    "aio": (("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events", "use_gds"), True),
    "checkpoint": (("tag_validation", "load_universal", "use_node_local_storage", "parallel_write", "writer",
                    "checkpoint_serialization"), True),
    "data_types": (("grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules"), True),
    "flops_profiler": (("enabled", "recompute_fwd_factor", "profile_step", "module_depth", "top_modules", "detailed",
                        "output_file"), True),
    "timers": (("throughput",), True),
    "fp16": (("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"), False),
    "bf16": (("enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
              "bf16_optimizer_states"), False),
    "tensorboard": (("enabled", "output_path", "job_name"), False),
    "csv_monitor": (("enabled", "output_path", "job_name"), False),
    "wandb": (("enabled", "group", "team", "project"), False),
    "comms_logger": (("enabled", "prof_all", "prof_ops", "verbose", "debug"), False),
    "comet": (("enabled", "samples_log_interval", "project", "workspace", "api_key", "experiment_name",
               "experiment_key", "online", "mode"), False),
}
SUBKEYS["bfloat16"] = SUBKEYS["bf16"]

OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "torch_adam", "adam_w_mode")
# DeepSpeed's Adam switches (CogVideo's finetune configs set both true): torch_adam picks torch's kernel over
# DeepSpeed's FusedAdam, the same AdamW math, and the toolkit picks its kernel itself (parallel/train/optim.py);
# adam_w_mode=false would be Adam with L2 decay, which the toolkit does not build.
ADAM_SWITCHES = ("torch_adam", "adam_w_mode")
EMA_PARAMS = ("ema_decay",)
PIPELINE_HONOURED = ("pipe_partitioned", "grad_partitioned")
MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}


def _on(value: Any) -> bool:
    return isinstance(value, dict) and bool(value.get("enabled", False))


def _conditions(ds: dict[str, Any], src: str, pp_size: int, max_steps: int, tp_size: int,
                sp_size: int) -> list[str]:
    """The honoured keys' values that cannot work, each with what would."""
    problems = []
    if str(ds.get("log_level", "warning")).lower() not in ("info", "debug"):
        quiet = f"DeepSpeed logs it at INFO and its logger is at {ds.get('log_level', 'WARNING')}"
        spp = ds.get("steps_per_print")
        if isinstance(spp, int) and 0 < spp <= max_steps:
            problems.append(f"{src}: steps_per_print={spp} would print nothing: {quiet}; add \"log_level\": \"info\" "
                            f"(or set steps_per_print above train.max_steps={max_steps} to say never)")
        for key in ("dump_state", "memory_breakdown"):
            if ds.get(key) is True:
                problems.append(f"{src}: {key}=true would print nothing: {quiet}; add \"log_level\": \"info\" "
                                f"or remove it")
        if _on(ds.get("comms_logger")) and ds["comms_logger"].get("verbose") is True:
            problems.append(f"{src}: comms_logger.verbose=true would print nothing: {quiet}; add \"log_level\": "
                            f"\"info\" or remove it (the summary after the last step prints either way)")
    if ds.get("zero_force_ds_cpu_optimizer") is True:
        problems.append(f"{src}: zero_force_ds_cpu_optimizer=true is refused: it demands DeepSpeed's CPU Adam, and "
                        f"the toolkit builds the optimizer (torch's AdamW, which offload runs on the CPU); remove it")
    if ds.get("managed_gradient_accumulation") is False:
        problems.append(f"{src}: managed_gradient_accumulation=false is refused: DeepSpeed refuses it with a "
                        f"pipeline, and the toolkit's accumulation is tested with DeepSpeed managing it; remove it")
    cdt = ds.get("communication_data_type")
    if cdt is not None and cdt not in COMMUNICATION_DTYPES:
        problems.append(f"{src}: communication_data_type={cdt!r} is refused: DeepSpeed reduces gradients in "
                        f"{', '.join(COMMUNICATION_DTYPES)}; use one of those or remove it (the training precision)")
    pipeline = ds.get("pipeline")
    if isinstance(pipeline, dict):
        for key, value in pipeline.items():
            if key in PIPELINE_HONOURED:
                if value is not False:
                    problems.append(f"{src}: pipeline.{key}={value!r} is refused: the toolkit's stages pass two "
                                    f"tensors and DeepSpeed partitions only the first; remove it (false is the "
                                    f"toolkit's default)")
            else:
                problems.append(f"{src}: pipeline.{key} is refused: DeepSpeed's engine does not read it from the "
                                f"JSON (or, activation_checkpoint_interval, would checkpoint the stages a second "
                                f"time); use parallel.pp_size / parallel.pp_partition / the activation_checkpointing "
                                f"section")
    if pp_size > 1 and _on(ds.get("flops_profiler")):
        problems.append(f"{src}: flops_profiler.enabled=true with parallel.pp_size={pp_size} is refused: DeepSpeed's "
                        f"pipeline engine never prints it; profile with parallel.pp_size=1")
    if _on(ds.get("comms_logger")) and (tp_size, sp_size, pp_size) != (1, 1, 1):
        problems.append(f"{src}: comms_logger.enabled=true with parallel.tp_size={tp_size}, sp_size={sp_size}, "
                        f"pp_size={pp_size} is refused: DeepSpeed's summary divides busbw by the whole world's size "
                        f"(right only when every rank is a data-parallel replica), and the toolkit's tensor- and "
                        f"sequence-parallel collectives do not go through deepspeed.comm; use it with tp = sp = pp "
                        f"= 1, or count collectives with parallel.distributed.comm.count_comm")
    for key, package in MONITOR_PACKAGES.items():
        if _on(ds.get(key)) and importlib.util.find_spec(package) is None:
            problems.append(f"{src}: {key}.enabled=true but the {package} package is not installed (DeepSpeed would "
                            f"fail in initialize); install it or use csv_monitor")
    for section, (known, silently) in SUBKEYS.items():
        for key in ds.get(section) if isinstance(ds.get(section), dict) else ():
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
                hint = f" (did you mean \"{close[0]}\"?)" if close else ""
                fate = "ignore it silently" if silently else "refuse it inside initialize"
                problems.append(f"{src}: unknown key {section}.{key}{hint}; DeepSpeed would {fate}; it reads "
                                f"{', '.join(known)}")
    zero = ds.get("zero_optimization")
    if isinstance(zero, dict):
        problems += _zero_problems(zero, src)
    optimizer = ds.get("optimizer")
    if isinstance(optimizer, dict):
        for key in optimizer:
            if key not in ("type", "params"):
                problems.append(f"{src}: optimizer.{key} is refused: the toolkit builds the optimizer from type "
                                f"and params only; remove it")
        ema = str(optimizer.get("type", "AdamW")).lower() in EMA_OPTIMIZERS
        allowed = OPTIMIZER_PARAMS + (EMA_PARAMS if ema else ())
        params = optimizer.get("params") or {}
        for key in params:
            if key in ADAM_SWITCHES and not isinstance(params[key], bool):
                problems.append(f"{src}: optimizer.params.{key}={params[key]!r}: give true or false")
            elif key == "adam_w_mode" and params[key] is False:
                problems.append(f"{src}: optimizer.params.adam_w_mode=false (Adam with L2 weight decay) is refused: "
                                f"the toolkit builds AdamW (decoupled weight decay); remove it or set it true")
            elif key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6) if key not in EMA_PARAMS else []
                hint = f" (did you mean \"{close[0]}\"?)" if close else ""
                why = " (ema_decay needs FusedEmaAdam or EmaAdamW)" if key in EMA_PARAMS else ""
                problems.append(f"{src}: optimizer.params.{key} is refused{hint}{why}: the toolkit's "
                                f"{optimizer.get('type', 'AdamW')} takes {', '.join(allowed)}")
    return problems


def zero_plus_plus_on(key: str, value: Any) -> bool:
    """A ZeRO++ setting that changes something: a quantisation flag true, or an hpz partition of 2+ ranks."""
    return value is True if key in ZERO_QUANTIZED else isinstance(value, int) and value > 1


def _zero_problems(zero: dict[str, Any], src: str) -> list[str]:
    stage, problems = zero.get("stage", 0), []
    for key, value in zero.items():
        if key not in ZERO_KEYS:
            close = difflib.get_close_matches(key, sorted(ZERO_KEYS), n=1, cutoff=0.6)
            hint = f" (did you mean \"{close[0]}\"?)" if close else ""
            problems.append(f"{src}: unknown key zero_optimization.{key}{hint}; DeepSpeed would refuse it inside "
                            f"initialize")
        elif ZERO_KEYS[key].verdict == REFUSED:
            how = ZERO_KEYS[key].how.removesuffix("; remove it")
            problems.append(f"{src}: zero_optimization.{key} is refused: {how}; remove it")
        elif key in STAGE3_ONLY and stage != 3 and value is not None:
            problems.append(f"{src}: zero_optimization.{key} with zero_optimization.stage={stage} is refused: only "
                            f"ZeRO-3 reads it; remove it or use stage 3")
        elif key in ZERO_PLUS_PLUS and stage != 3 and zero_plus_plus_on(key, value):
            problems.append(f"{src}: zero_optimization.{key}={value!r} with zero_optimization.stage={stage} is "
                            f"refused: ZeRO++ works on ZeRO-3's parameter all-gathers only (DeepSpeed ignores it "
                            f"below); use stage 3, or communication_data_type=\"bf16\" to halve gradient traffic")
        elif key == "offload_optimizer" and stage == 0 and value:
            problems.append(f"{src}: zero_optimization.offload_optimizer with zero_optimization.stage=0 is refused: "
                            f"DeepSpeed offloads only under ZeRO 1-3; use stage 1 or 2")
        elif key in SAVE_16BIT_KEYS and value is not False:
            problems.append(f"{src}: zero_optimization.{key}={value!r} is refused: {SAVE_16BIT}; remove it")
        elif key == "compute_grad_norm" and value is False:
            problems.append(f"{src}: zero_optimization.compute_grad_norm=false is refused: the toolkit logs "
                            f"grad_norm and clips with it; remove it")
    return problems


def key_problems(ds: dict[str, Any], src: str, pp_size: int = 1, max_steps: int = 0, tp_size: int = 1,
                 sp_size: int = 1) -> list[str]:
    """Every top-level key refused (unknown ones with a did-you-mean), and honoured keys' unworkable values."""
    problems = []
    for key in ds:
        if key not in KEYS:
            close = difflib.get_close_matches(key, sorted(KEYS), n=1, cutoff=0.6)
            hint = f" (did you mean \"{close[0]}\"?)" if close else ""
            problems.append(f"{src}: unknown DeepSpeed key \"{key}\"{hint}; DeepSpeed would ignore it silently")
        elif KEYS[key].verdict == REFUSED:
            problems.append(f"{src}: \"{key}\" is refused: {KEYS[key].how}; remove it")
    return problems + _conditions(ds, src, pp_size, max_steps, tp_size, sp_size)


def render() -> str:
    """docs/deepspeed-keys.md."""
    lines = ["# DeepSpeed JSON keys", "",
             "Generated by `python -m parallel.experiment.ds_keys > docs/deepspeed-keys.md` from `parallel/experiment/ds_keys.py` "
             "(`tests/unit/test_ds_keys.py` fails when they differ,", "or when DeepSpeed reads a top-level key missing "
             "here). Every key DeepSpeed 0.19 reads is honoured or refused before launch", "(`python -m "
             "parallel.check` and `train.py`, exit 1, naming the file and the key); a key it does not read is "
             "refused as unknown.", ""]
    for verdict in (HONOURED, REFUSED):
        lines += [f"## {verdict.capitalize()}", "", "| key | " + ("what the toolkit does | tested by |"
                  if verdict == HONOURED else "why, and what to use instead |"),
                  "|---|---|---|" if verdict == HONOURED else "|---|---|"]
        for key, k in sorted(KEYS.items()):
            if k.verdict == verdict:
                lines.append(f"| `{key}` | {k.how} | {k.tests or 'not exercised by a test'} |" if verdict == HONOURED
                             else f"| `{key}` | {k.how} |")
        lines.append("")
    lines += ["## zero_optimization", "", "DeepSpeedZeroConfig's fields, with the `stage3_` names DeepSpeed also "
              "accepts; an unknown one is refused before launch (DeepSpeed would refuse it inside initialize).", "",
              "| key | verdict | what the toolkit does, or why it is refused | tested by |", "|---|---|---|---|"]
    untested = {HONOURED: "not exercised by a test", REFUSED: ""}
    lines += [f"| `{key}` | {k.verdict} | {k.how} | {k.tests or untested[k.verdict]} |"
              for key, k in sorted(ZERO_KEYS.items())]
    lines += ["", "## Keys inside the other sections", "", "Checked before launch; an unknown one is refused with a "
              "did-you-mean (DeepSpeed would ignore it, or refuse it inside initialize).", "",
              "| section | keys DeepSpeed reads | DeepSpeed on an unknown one |", "|---|---|---|"]
    lines += [f"| `{s}` | {', '.join(known)} | {'ignores it' if silently else 'refuses it in initialize'} |"
              for s, (known, silently) in sorted(SUBKEYS.items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
