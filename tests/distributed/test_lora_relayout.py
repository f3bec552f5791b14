"""A LoRA run resumed on another layout: 3 steps at one (tp, pp, ZeRO) layout, a checkpoint, then 3 more at another,
into a model built from another seed (another random base and adapters, as a resume that does not read
model.init_from builds it), against steps 4-6 of the run that wrote the checkpoint: losses at fp32 tolerance (as
tests/distributed/test_relayout.py) and the final full weights, the frozen base and its buffers (the fp8 codes and
scales) bit for bit.

Cases: the fp8 base (model.lora.base_dtype) from tp 1 to tp 2 (shards re-cut from the full tensor), from tp 2 to
tp 1 x pp 2 with block swap (shards joined, the base in host memory), and at the same tp 2 (DeepSpeed's own files);
a base kept as parameters (no fp8) from tp 1 to tp 2 with block swap; model.lora.dropout=0.1 at the same tp 2, from
tp 1 ZeRO-1 to tp 2 ZeRO-0 and at pp 2 from ZeRO-1 to ZeRO-0 (each rank's generators restored, at another layout
from the writer's rank of the same stream: parallel/checkpoints/rng.py; without them steps 4-6 differ by up to
1.8e-4). And a
checkpoint resumed at another layout with the other model.lora.base_dtype is refused, naming the tensor. One spawn of
1 rank (the tp 1 references) and one of 2 (the tp 2 references, then every continuation).
"""
import re
from pathlib import Path

import pytest

from tests.dist_utils import spawn_all
from tests.helpers.lora_resume import assert_continues, merged
from tests.train_utils import fp32_config

LORA = ("model.lora.rank=4",)
FP8 = (*LORA, "model.lora.base_dtype=float8_e4m3fn")
DROPOUT = (*LORA, "model.lora.dropout=0.1")
SCHEDULE = ("train.warmup_steps=2", "train.max_steps=6")          # the lr moves at every step
#                         before: (tp, pp, ZeRO, keys), after,               the model's keys
CASES = {"fp8-tp1_to_tp2": ((1, 1, 1, ()), (2, 1, 1, ()), FP8),
         "fp8-tp2_to_tp1-pp2-swap": ((2, 1, 0, ()), (1, 2, 0, ("train.block_swap=2",)), FP8),
         "fp8-tp2_same_layout": ((2, 1, 1, ()), (2, 1, 1, ()), FP8),
         "base-tp1_to_tp2-swap": ((1, 1, 1, ()), (2, 1, 1, ("train.block_swap=1",)), LORA),
         # LoRA's dropout masks come from each rank's generators (parallel/checkpoints/rng.py), restored at the same
         # layout, and from the writer's tp rank 0 at another tp size or ZeRO stage
         "dropout-tp2_same_layout": ((2, 1, 1, ()), (2, 1, 1, ()), DROPOUT),
         "dropout-tp1_to_tp2-zero0": ((1, 1, 1, ()), (2, 1, 0, ()), DROPOUT),
         "dropout-pp2_zero1_to_zero0": ((1, 2, 1, ()), (1, 2, 0, ()), DROPOUT)}
# a checkpoint resumed with another model.lora.base_dtype at another layout: refused, not read as the other's weights
REFUSED = {"fp8_read_without": ("fp8-tp1_to_tp2", LORA), "base_read_as_fp8": ("base-tp1_to_tp2-swap", FP8)}


def _config(layout, model_keys, tmp, seed=None):
    from parallel.experiment.config import load_config
    tp, pp, _, keys = layout
    return load_config("debug", [f"parallel.tp_size={tp}", f"parallel.pp_size={pp}", "train.micro_batch_size=2",
                                 "train.grad_accum_steps=2", *SCHEDULE, *model_keys, *keys, f"ckpt.dir={tmp}",
                                 *([f"train.seed={seed}"] if seed is not None else [])])


def _train(rank, world_size, layout, model_keys, tmp, save_at=None, resume=None):
    """Train `layout` to step 6, saving after `save_at`, or from checkpoint `resume` in a model built from seed 99;
    (losses, full weights and buffers) of this rank."""
    from parallel.checkpoints import checkpoint
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches
    from parallel.weights.gather import full_state

    tp, pp, stage, _ = layout
    cfg = _config(layout, model_keys, tmp)
    ctx = ParallelContext.build(ParallelDims(tp_size=tp, pp_size=pp, dp_size=1))
    seed_all(cfg.train.seed)
    built = _config(layout, model_keys, tmp, seed=99) if resume else cfg
    trainer = build_trainer(built, fp32_config(stage, checkpointing=False, optimizer="FusedEmaAdam"), ctx)
    start = trainer.load(tmp, resume) if resume else 0
    batches = training_batches(cfg, ctx, start_step=start)
    losses = []
    for step in range(start, 6):
        losses.append(trainer.train_step(batches).loss)
        if step + 1 == save_at:
            checkpoint.save(trainer, Path(tmp), step + 1, keep=1, layout=trainer.layout())
    return {"losses": losses, "start": start, "state": full_state(trainer.engine.module, ctx, cfg.model.num_layers)}


def _refused(rank, world_size, case, model_keys, root):
    """The error resuming CASES[case]'s checkpoint at tp 2 with `model_keys` raises on this rank."""
    try:
        _train(rank, world_size, (2, 1, 1, ()), model_keys, f"{root}/{case}", resume="step3")
    except ValueError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_relayout")
    calls = {}
    for name, (before, after, keys) in CASES.items():
        calls[f"{name}/reference"] = (before[0] * before[1], _train, (before, keys, f"{root}/{name}", 3))
    for name, (before, after, keys) in CASES.items():      # after every reference: spawn_all keeps the order
        calls[f"{name}/resumed"] = (after[0] * after[1], _train, (after, keys, f"{root}/{name}", None, "step3"))
    for name, (case, keys) in REFUSED.items():
        calls[name] = (2, _refused, (case, keys, str(root)))
    return {name: ranks if name in REFUSED else merged(ranks)
            for name, ranks in spawn_all(calls, seconds_each=60).items()}


@pytest.mark.parametrize("name", list(CASES))
def test_lora_resumed_on_another_layout_continues_the_uninterrupted_run(runs, name):
    assert_continues(runs[f"{name}/reference"], runs[f"{name}/resumed"])


def test_another_base_dtype_is_refused_at_another_layout(runs):
    """fp8 codes are never read as weights, nor weights as codes: the copy's dtypes and buffers say which it holds."""
    for message in runs["fp8_read_without"]:
        assert re.search(r"blocks\.0\.attn\.to_qkv\.weight is stored as torch\.float8_e4m3fn, this model holds it "
                         r"as a torch\.float32 parameter \(another model\.lora\.base_dtype", message), message
    for message in runs["base_read_as_fp8"]:
        assert re.search(r"no stored blocks\.0\.attn\.to_qkv\.weight_scale, a buffer of this model: .* Resume it at "
                         r"tp 1 sp 1 pp 1 dp 1 ZeRO-1", message), message
