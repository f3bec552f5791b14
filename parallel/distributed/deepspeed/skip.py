"""An optimizer step skipped the way DeepSpeed skips an fp16 overflow: no update, gradients cleared.

skipped_update(engine)  (0.19.8)
    does     within the block, the engine's next boundary step() applies no update: the optimizer does not
             step (weights, Adam moments and step count, the EMA stay as they were), the gradients are
             cleared, the LR schedule does not advance and engine.skipped_steps counts it
    why      the anomaly guard (parallel/train/anomaly.py) decides after the backward of a step's last
             micro-batch that its update must not happen, on every rank alike; DeepSpeed has that path for
             its own overflow check only
    relies   _take_model_step reading `optimizer.overflow` after optimizer.step() (skipped_steps += 1, no
             lr_scheduler.step) and clearing gradients either way; ZeRO-1/2's DeepSpeedZeroOptimizer.step
             setting overflow from check_overflow() when check_grad_overflow, and then clearing its
             partitioned gradients (averaged_gradients) and returning before the update

guard_pipeline_updates(engine, decide)  (0.19.8)
    does     the pipeline engine's optimizer step (the last instruction of train_batch's schedule) first
             asks decide(loss) (loss: the step's loss on the last stage, the mean over micro-batches and
             data-parallel replicas; None on other stages), and runs under skipped_update when it gives a
             reason; the reason is left in the returned dict's "reason" for the caller
    why      train_batch runs forward, backward and the update in one call: the decision must be made
             inside it, after the last backward
    relies   PipelineEngine._exec_optimizer_step calling self._take_model_step(lr_kwargs); total_loss on
             the last stage holding the sum of the micro-batches' detached losses at that point;
             gradient_accumulation_steps(); mpu.get_data_parallel_group(); is_last_stage()

before_pipeline_update(engine, fn)  (0.19.8)
    does     the pipeline engine's optimizer step first calls fn() (on every rank)
    why      train_batch runs forward, backward and the update in one call: what the update needs from the
             whole batch (the experts no sample chose, parallel/train/experts.py) is known only inside it
    relies   PipelineEngine._exec_optimizer_step calling self._take_model_step(lr_kwargs) on every rank, after
             the last micro-batch's backward
"""
from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer


@contextmanager
def skipped_update(engine):
    opt = engine.optimizer
    if isinstance(opt, DeepSpeedZeroOptimizer):       # its own overflow branch does the clearing
        check, flag = opt.check_overflow, opt.check_grad_overflow

        def overflow(*args, **kwargs):
            opt.overflow = True

        opt.check_overflow, opt.check_grad_overflow = overflow, True
        try:
            yield
        finally:
            opt.check_overflow, opt.check_grad_overflow = check, flag
        return
    had = "overflow" in vars(opt)         # a torch optimizer (fp32 ZeRO-0): the engine clears p.grad after

    def no_update(*args, **kwargs):
        opt.overflow = True

    opt.step = no_update
    try:
        yield
    finally:
        del opt.step
        if had:
            opt.overflow = False
        else:
            vars(opt).pop("overflow", None)


def guard_pipeline_updates(engine, decide) -> dict:
    """Install the guarded optimizer step on a PipelineEngine; returns {"reason": the last step's or None}."""
    take, state = engine._take_model_step, {"reason": None}

    def guarded(lr_kwargs=None):
        loss = None
        if engine.is_last_stage():
            total = engine.total_loss.detach().clone().float() / engine.gradient_accumulation_steps()
            group = engine.mpu.get_data_parallel_group()
            dist.all_reduce(total, group=group)
            loss = float(total) / dist.get_world_size(group)
        state["reason"] = decide(loss)
        if state["reason"] is None:
            return take(lr_kwargs)
        with skipped_update(engine):
            return take(lr_kwargs)

    engine._take_model_step = guarded
    return state


def before_pipeline_update(engine, fn) -> None:
    """Call fn() at the start of every optimizer step of a PipelineEngine's train_batch."""
    take = engine._take_model_step

    def first_fn(lr_kwargs=None):
        fn()
        return take(lr_kwargs)

    engine._take_model_step = first_fn
