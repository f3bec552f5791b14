"""BF16_Optimizer's step (bf16 weights, fp32 master weights and fp32 gradient accumulation) with the same
numbers and fewer bytes and kernels (issue #42: train.py's step at the speed of its blocks).

lighter_bf16_step(engine)  (0.19.8)
    does     on an engine whose optimizer is BF16_Optimizer, three same-number changes (bench/step_bytes.py
             counts them; bytes per trainable parameter per step):
             1. update_hp_grads adds each bf16 gradient into its fp32 buffer in one mixed-dtype add
                (hp += lp.grad, 10 B) rather than a converted copy and an add (18 B, two kernels); the
                bf16 -> fp32 conversion is exact, so the sums are the same
             2. clipping multiplies each group's flat fp32 gradient buffer once rather than every
                parameter's view of it: the views cover the buffer, and the rest of it (padding,
                parameters without a gradient) is zero, which the finite positive coefficient keeps zero
             3. zero_grad after step() does not zero the fp32 gradients step() has just zeroed (4 B)
    why      DeepSpeed's loops launch two kernels per parameter for the accumulation and one for the
             clipping, and zero the fp32 gradients twice per step
    not done at a data-parallel size of 1 the engine still "all-reduces" over one rank through a full fp32
             copy of every gradient and a bf16 one (32 B; its only effect, the rounding to bf16, is 12 B in
             place): the planner counts that copy (parallel/plan/memory.py zero_buckets, checked against the
             engine by tests/distributed/test_plan_states.py), so removing it waits for the planner to follow
    relies   BF16_Optimizer: bf16_groups, fp32_groups_gradients (views of fp32_groups_gradients_flat),
             fp32_groups_has_gradients, immediate_grad_update, autoep_folding_tp_group, update_hp_grads
             (clear_lp_grads), get_grads_for_norm(for_clipping=True) read by step() for clipping only,
             clear_hp_grads, clear_lp_grads, zero_grad(set_to_none), backward_prologue,
             accumulate_hp_grads_and_remove_lp (the immediate_grad_update hooks call it by name)
"""
from __future__ import annotations

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer


def lighter_bf16_step(engine) -> bool:
    """Install the three changes on the engine's BF16_Optimizer; False (nothing done) for another optimizer."""
    opt = engine.optimizer
    if not isinstance(opt, BF16_Optimizer) or not opt.using_real_optimizer:
        return False
    _accumulate_in_one_add(opt)
    _clip_flat_buffers(opt)
    _zero_fp32_gradients_once(opt)
    return True


def _accumulate_in_one_add(opt) -> None:
    original = opt.update_hp_grads

    @torch.no_grad()
    def update_hp_grads(clear_lp_grads=False):
        if opt.immediate_grad_update or opt.autoep_folding_tp_group is not None:
            return original(clear_lp_grads=clear_lp_grads)
        hp, lp = [], []
        for i, group in enumerate(opt.bf16_groups):
            for j, p in enumerate(group):
                if p.grad is None:
                    continue
                hp.append(opt.fp32_groups_gradients[i][j])
                lp.append(p.grad.view(hp[-1].shape))
                p._hp_grad = hp[-1]
                opt.fp32_groups_has_gradients[i][j] = True
        if hp:
            torch._foreach_add_(hp, lp)         # fp32 += bf16, per tensor: the exact conversion inside the add
            if clear_lp_grads:
                torch._foreach_zero_(lp)
    opt.update_hp_grads = update_hp_grads


def _clip_flat_buffers(opt) -> None:
    original = opt.get_grads_for_norm

    def get_grads_for_norm(for_clipping=False):
        if for_clipping:
            return list(opt.fp32_groups_gradients_flat)
        return original(for_clipping=for_clipping)
    opt.get_grads_for_norm = get_grads_for_norm


def _zero_fp32_gradients_once(opt) -> None:
    """zero_grad skips the fp32 gradients when nothing can have written them since clear_hp_grads: every
    write is an accumulation (update_hp_grads, or the immediate_grad_update hooks), inside a backward."""
    state = {"clean": False}

    def marking(fn, clean: bool):
        def marked(*args, **kwargs):
            out = fn(*args, **kwargs)
            state["clean"] = clean
            return out
        return marked

    opt.clear_hp_grads = marking(opt.clear_hp_grads, True)
    for name in ("backward_prologue", "update_hp_grads", "accumulate_hp_grads_and_remove_lp"):
        setattr(opt, name, marking(getattr(opt, name), False))

    def zero_grad(set_to_none=True):
        opt.clear_lp_grads(set_to_none)
        if not state["clean"]:
            opt.clear_hp_grads()
    opt.zero_grad = zero_grad
