"""LoRA's dropout masks in spawned gloo ranks (parallel/distributed/seed.py training_seed): independent across the
data-parallel replicas and the sequence-parallel token shards, shared by the tensor-parallel ranks, and replayed by
activation checkpointing's recompute.

Every adapter's dropout (model.lora.dropout = 0.5, the `debug` DiT, fp32) is recorded on the first step, each call's
dropped entries (output 0 where the input is not). Two independent masks agree on about half their entries, two
equal ones on all: at dp 2 and sp 2 the two ranks' masks of each adapter agree on 30-70% (before the generators were
seeded per coordinate, on 100%: one pattern repeated). At tp 2 both ranks draw the one process's masks, bit for bit
(the row-parallel adapters' shards the halves of its full mask; before layers.ShardDropout each shard drew one
half-width pattern, the same on both ranks), and train to its losses and weights. At sp 2 with DeepSpeed's activation checkpointing (the JSON's
section) and with torch's (train.recompute), every recompute drops what its forward dropped and the losses and the
final weights are the run's without checkpointing, bit for bit. One spawn of 2 ranks and one of 1.
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests.dist_utils import spawn_all
from tests.train_utils import assert_matches, experiment, fp32_config, merge_ranks

P = 0.5                                    # two independent masks then agree on half their entries
LORA = ("model.lora.rank=4", f"model.lora.dropout={P}")
STEPS = 2
RECOMPUTE = ("train.recompute.granularity=block",)     # torch's non-reentrant checkpoint (parallel/model/recompute.py)
#       name -> (tp, dp, sp, the JSON's activation checkpointing, more keys)
RUNS = {"tp1": (1, 1, 1, False, ()),
        "tp2": (2, 1, 1, False, ()),
        "dp2": (1, 2, 1, False, ()),
        "sp2": (1, 1, 2, False, ()),
        "sp2-deepspeed-checkpointing": (1, 1, 2, True, ()),
        "sp2-recompute": (1, 1, 2, False, RECOMPUTE)}


def _record(calls: dict, name: str, module, inputs, output) -> None:
    x = inputs[0]
    calls.setdefault(name, []).append(((output == 0) & (x != 0)).detach().clone())     # what this call dropped


def _train(rank, world_size, tp, dp, sp, checkpointing, keys):
    """STEPS steps; the losses, every adapter dropout's calls of step 1 (their dropped entries), the full weights and
    the replicated parameters that differ between tp ranks."""
    from parallel.distributed.replicas import replica_mismatches
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches
    from parallel.weights.gather import full_state

    cfg = experiment(tp, 1, dp, (*LORA, *keys), sp)
    ctx = ParallelContext.build(ParallelDims(tp_size=tp, sp_size=sp, pp_size=1, dp_size=dp))
    seed_all(cfg.train.seed)
    trainer = build_trainer(cfg, fp32_config(checkpointing=checkpointing), ctx)
    module, masks = trainer.engine.module, {}
    hooks = [m.register_forward_hook(functools.partial(_record, masks, name))
             for name, m in module.named_modules() if name.endswith("lora_dropout")]
    batches = training_batches(cfg, ctx)
    losses = [trainer.train_step(batches).loss]
    for hook in hooks:
        hook.remove()
    losses += [trainer.train_step(batches).loss for _ in range(STEPS - 1)]
    return {"losses": losses, "masks": masks, "state": full_state(module, ctx, cfg.model.num_layers),
            "replica_mismatches": replica_mismatches(module, ctx)}


@pytest.fixture(scope="module")
def runs():
    calls = {name: (tp * dp * sp, _train, args) for name, args in RUNS.items() for tp, dp, sp, *_ in [args]}
    return {name: {**merge_ranks(ranks), "masks": [r["masks"] for r in ranks]}
            for name, ranks in spawn_all(calls, seconds_each=60).items()}


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a == b).float().mean())


@pytest.mark.parametrize("name", ["dp2", "sp2"])
def test_replicas_and_token_shards_draw_independent_masks(runs, name):
    first, second = runs[name]["masks"]
    assert first.keys() == second.keys() and len(first) == 8       # 4 blocks x (to_qkv, to_out)
    for layer, calls in first.items():
        assert len(calls) == 2                                     # the step's 2 micro-batches
        for mine, theirs in zip(calls, second[layer]):
            assert abs(float(mine.float().mean()) - P) < 0.1, layer          # dropout at its rate
            assert 0.3 < _agreement(mine, theirs) < 0.7, (layer, _agreement(mine, theirs))


def test_tp_ranks_draw_the_one_process_masks(runs):
    """The tp ranks share their generators: the column-parallel adapters' replicated input is dropped alike on both,
    and the row-parallel adapters' input shards by the two halves of one full mask (layers.ShardDropout), so each
    mask is the one process's (coordinate (0, 0, 0) keeps seed_all's stream) and tp 2 trains as one process."""
    first, second = runs["tp2"]["masks"]
    (reference,) = runs["tp1"]["masks"]
    assert first.keys() == reference.keys() and len(reference) == 8
    for layer, calls in reference.items():
        for mine, theirs, want in zip(first[layer], second[layer], reference[layer], strict=True):
            if ".to_qkv." in layer:                                # column-parallel: x replicated
                assert torch.equal(mine, theirs) and torch.equal(mine, want), layer
            else:                                                  # row-parallel: x split along the features
                assert mine.shape[-1] == want.shape[-1] // 2, layer
                assert torch.equal(torch.cat([mine, theirs], -1), want), layer
    assert_matches(runs["tp2"], runs["tp1"])                       # losses, weights; no replicated tensor drifts


@pytest.mark.parametrize("name", ["sp2-deepspeed-checkpointing", "sp2-recompute"])
def test_a_recompute_drops_what_its_forward_dropped(runs, name):
    """Both checkpoints replay the global generators (the reason the masks are not drawn from a generator of their
    own): each forward is recomputed once in backward, with the same mask, and the gradients are the ones without
    checkpointing, so the losses and weights are too, bit for bit."""
    plain, checkpointed = runs["sp2"], runs[name]
    for mine, want in zip(checkpointed["masks"], plain["masks"]):
        for layer, calls in mine.items():
            assert len(calls) == 4, layer                          # micro-batch 1, its recompute, 2, its recompute
            for forward, recompute, expected in zip(calls[0::2], calls[1::2], want[layer]):
                assert torch.equal(forward, recompute), layer
                assert torch.equal(forward, expected), layer
    assert checkpointed["all_losses"] == plain["all_losses"]
    assert len(set(plain["losses"])) == STEPS, "the run does not train"
    assert checkpointed["state"].keys() == plain["state"].keys()
    for key, value in plain["state"].items():
        assert torch.equal(checkpointed["state"][key], value), key
