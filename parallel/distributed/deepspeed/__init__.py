"""The one place the toolkit touches DeepSpeed's private internals, one module per concern.

Every patch was written against DeepSpeed 0.19.8 (`version.WRITTEN_AGAINST`); tests/unit/test_deepspeed_compat.py
checks, per patch, every DeepSpeed symbol it relies on and fails naming the patch and the symbol when an
upgrade removes or changes one; tests/unit/test_architecture.py fails on a DeepSpeed private name (`ds_id`,
`ds_tensor`, `_hp_mapping`, `_topo`, ...) read anywhere else. `check_deepspeed_version()` warns once at
engine set-up when the installed major.minor differs.

    version.py      the DeepSpeed series the patches were written for, and the warning
    zero3.py        ZeRO-3 parameter attributes (ds_id, ds_shape, ds_tensor): partitioned? full shape? local part?
    checkpoint.py   use_weights_only_checkpoints: checkpoints loaded with torch.load(weights_only=True)
    clipping.py     clip_with_replica_norm: fp32 ZeRO-0 clipping with the whole replica's norm, kept
    bf16.py         lighter_bf16_step: BF16_Optimizer's accumulation, clipping and clearing with the same
                    numbers, fewer bytes and kernels
    optimizer.py    relink_optimizer_fragments, zero_holds_master, engine_optimizers
    pipeline.py     ExplicitPipelineModule: an explicit per-stage split through PipelineModule's private hook
    monitor.py      write_monitor_events: the toolkit's figures to DeepSpeed's monitors, wandb by its own step
    shm.py          unlink_shm_buffer: the CPU shared-memory all-reduce buffer's name removed
    ulysses.py      traceable_ulysses: Ulysses' all-to-all output without the no-op copy at which torch 2.11's
                    compiler loses its gradient
    skip.py         skipped_update: a step without an update, as DeepSpeed skips an fp16 overflow;
                    before_pipeline_update: a call at the start of the pipeline engine's update
    accounting.py   read, not patched: names the planner's probe measures through (checkpointed inputs,
                    ZeRO buckets and offload buffers, the engine's all-reduce bucket)

Each module's docstring says, per patch:
    does     what the toolkit changes
    why      the DeepSpeed behaviour it works around
    relies   the DeepSpeed internals an upgrade must keep
"""
