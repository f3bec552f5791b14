"""train.offload_activations in 4 gloo ranks, one spawn, fp32, through the training engine train.py builds: each
checkpointing option with its kept inputs on the host trains like the same layout without checkpointing
(itself equal to one process: test_train_equivalence.py), losses and final weights.
tp 2 x pp 2 (ZeRO-1): the pipeline's micro-batches in flight, each forward a new sequence of copies; train.recompute
blocks and the JSON's checkpointing (run through torch's checkpoint when offloaded).
tp 2 x dp 2 (ZeRO-3): parameters gathered and released around recomputed blocks whose inputs come back from
the host.
train.block_swap (LoRA) trains like the same LoRA layout without it: at tp 2 x pp 2 (ZeRO-1) both blocks of each stage
swapped, with block recompute and offloaded inputs, across the pipeline's interleaved micro-batches; at tp 2 x dp 2
(ZeRO-2) 3 of 4 blocks, nothing recomputed (backward fetches each weight again). deepspeed.initialize's
.to(device) and each rank's own shard included."""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.train_utils import _train_rank, experiment, fp32_config

OFFLOAD = "train.offload_activations=true"
# name: (JSON activation_checkpointing on, experiment keys)
PIPE_CASES = {"none": (False, ()), "block": (False, ("train.recompute.granularity=block", OFFLOAD)),
              "json": (True, (OFFLOAD,)), "mlp": (False, ("train.recompute.granularity=mlp", OFFLOAD))}
ZERO3_CASES = {"none": (False, ()), "block": (False, ("train.recompute.granularity=block", OFFLOAD)),
               "attention": (False, ("train.recompute.granularity=attention", OFFLOAD))}
LORA = ("model.lora.rank=4",)
# layout: (tp, pp, dp, ZeRO stage, block swap's extra keys); each against the same layout's LoRA run without it
SWAP_CASES = {"tp2-pp2-swap": (2, 2, 1, 1, ("train.block_swap=2", "train.recompute.granularity=block", OFFLOAD)),
              "tp2-dp2-zero2-swap": (2, 1, 2, 2, ("train.block_swap=3",))}


def _cases_rank(rank, world_size):
    pipe = {name: _train_rank(rank, world_size, 2, 2, 1, fp32_config(1, checkpointing=ckpt), 2, extra, 1, "debug", 0)
            for name, (ckpt, extra) in PIPE_CASES.items()}
    zero3 = {name: _train_rank(rank, world_size, 2, 1, 2, fp32_config(3, checkpointing=ckpt), 2, extra, 1, "debug", 0)
             for name, (ckpt, extra) in ZERO3_CASES.items()}
    swap = {name: {key: _train_rank(rank, world_size, tp, pp, dp, fp32_config(zero, checkpointing=False), 2,
                                    LORA + keys, 1, "debug", 2) for key, keys in (("lora", ()), ("swap", extra))}
            for name, (tp, pp, dp, zero, extra) in SWAP_CASES.items()}
    return {"tp2-pp2": pipe, "tp2-dp2-zero3": zero3, **swap}


@pytest.fixture(scope="module")
def cases():
    """Every rank's runs, from one spawn of 4 ranks for both tests."""
    return run_ranks(_cases_rank, 4)


def test_offloaded_checkpoints_at_tp2_pp2_and_tp2_zero3_match_no_checkpointing(cases):
    results = cases
    for layout, cases in (("tp2-pp2", PIPE_CASES), ("tp2-dp2-zero3", ZERO3_CASES)):
        for name in cases:
            for rank in results:
                runs = rank[layout]
                torch.testing.assert_close(torch.tensor(runs[name]["losses"]), torch.tensor(runs["none"]["losses"]),
                                           msg=lambda m: f"{layout} {name}: {m}")
                for key, value in runs["none"]["state"].items():
                    torch.testing.assert_close(runs[name]["state"][key], value,
                                               msg=lambda m: f"{layout} {name} {key}: {m}")
                assert runs[name]["replica_mismatches"] == []
    assert len(set(results[0]["tp2-pp2"]["none"]["losses"])) == 2          # it trains


def test_block_swap_at_tp2_pp2_and_tp2_dp2_matches_the_same_lora_layout(cases):
    """And the step's model states (StepProbe) are less by the host bytes the plan gives the rank's stage."""
    from parallel.plan.memory import plan_memory
    from parallel.plan.trace import ActivationTracer
    for layout, (tp, pp, dp, zero, extra) in SWAP_CASES.items():
        cfg = experiment(tp, pp, dp, LORA + extra)
        tracer = ActivationTracer(cfg, torch.float32)
        plan = plan_memory(cfg, fp32_config(zero, checkpointing=False), dp, 2 ** 40, tracer)
        for r, rank in enumerate(cases):
            lora, swap = rank[layout]["lora"], rank[layout]["swap"]
            held = plan.stages[r // (tp * dp)].host["block_swap"]
            assert lora["probe"].states - swap["probe"].states == held > 0, layout
            torch.testing.assert_close(torch.tensor(swap["losses"]), torch.tensor(lora["losses"]),
                                       msg=lambda m: f"{layout}: {m}")
            assert lora["state"].keys() == swap["state"].keys()
            for key, value in lora["state"].items():
                torch.testing.assert_close(swap["state"][key], value, msg=lambda m: f"{layout} {key}: {m}")
            assert swap["replica_mismatches"] == []
        assert len(set(cases[0][layout]["lora"]["losses"])) == 2
