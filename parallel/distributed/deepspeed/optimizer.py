"""DeepSpeed's optimizer wrappers: their per-parameter views of optimizer state, who holds the fp32
master, and the optimizers an engine step calls.

relink_optimizer_fragments(wrapper)  (0.19.8)
    does     clears wrapper._hp_optimizer_states_linked, calls wrapper._lazy_init_hp_params_optimizer_state()
    why      ZeRO-1/2 (DeepSpeedZeroOptimizer) and BF16_Optimizer build each parameter's views of optimizer
             state once, after the first step of the first parameter group: later groups get none, and a
             checkpoint load replaces the tensors they view
    relies   that flag and that method on both optimizers
zero_holds_master(param)  (read, 0.19.8)
    ZeRO-3 marks its parameters with ds_id, ZeRO-1/2 and BF16_Optimizer with _hp_mapping (deepspeed.utils'
    safe_*_full_* accessors dispatch on the same two); checkpoints/relayout.py then creates the client optimizer's
    state on the flat fp32 partitions, which DeepSpeed's per-parameter views (ZeRO-1/2: tensors of the
    partition's shape; ZeRO-3: optimizer.state[fp32 partition][key]) point into
engine_optimizers(engine)  (read, 0.19.8)
    engine.basic_optimizer, the client optimizer DeepSpeed wraps
stepped_params(wrapper, client)  (read, 0.19.8)
    does     the (tensor, param group) pairs whose state the client optimizer keeps: its groups' params, and under
             ZeRO-3 the flat fp32 partitions (wrapper.fp32_partitioned_groups_flat, each in the client group
             wrapper.sub_group_to_group_id names)
    why      ZeRO-3 (DeepSpeedZeroOptimizer_Stage3) empties the client's param groups between steps, putting each
             partition in only for its step, and Adam creates state at the first step: a resume through the
             layout-free copy into a ZeRO-3 engine that has not stepped found no state to write into (KeyError
             'exp_avg')
    relies   those two attributes on the stage-3 optimizer
"""
from __future__ import annotations

from parallel.distributed.deepspeed.zero3 import is_partitioned


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
    return is_partitioned(param) or hasattr(param, "_hp_mapping")


def engine_optimizers(engine) -> list:
    """The optimizer objects whose `step` an engine step calls: DeepSpeed's wrapper and the client
    optimizer it wraps (`basic_optimizer`), each once."""
    owners = (engine.optimizer, getattr(engine, "basic_optimizer", None))
    return list({id(o): o for o in owners if o is not None}.values())


def stepped_params(wrapper, client) -> list:
    """(tensor, client param group) of every tensor whose state `client` keeps, ZeRO-3's flat fp32 partitions
    included (they sit in the client's groups only while stepped)."""
    pairs = [(p, g) for g in client.param_groups for p in g["params"]]
    flat = getattr(wrapper, "fp32_partitioned_groups_flat", None)
    if flat is not None:
        held = {id(p) for p, _ in pairs}
        pairs += [(p, client.param_groups[wrapper.sub_group_to_group_id[i]]) for i, p in enumerate(flat)
                  if id(p) not in held]
    return pairs
