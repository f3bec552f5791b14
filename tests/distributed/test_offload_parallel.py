"""train.offload_activations in 4 gloo ranks, one spawn, fp32, through the training engine train.py builds: each
checkpointing option with its kept inputs on the host trains like the same layout without checkpointing
(itself equal to one process: test_train_equivalence.py), losses and final weights.
tp 2 x pp 2 (ZeRO-1): the pipeline's micro-batches in flight, each forward a new sequence of copies; train.recompute
blocks and the JSON's checkpointing (run through torch's checkpoint when offloaded).
tp 2 x dp 2 (ZeRO-3): parameters gathered and released around recomputed blocks whose inputs come back from
the host."""
from __future__ import annotations

import torch

from tests.dist_utils import run_ranks
from tests.train_utils import _train_rank, fp32_config

OFFLOAD = "train.offload_activations=true"
# name: (JSON activation_checkpointing on, experiment keys)
PIPE_CASES = {"none": (False, ()), "block": (False, ("train.recompute.granularity=block", OFFLOAD)),
              "json": (True, (OFFLOAD,)), "mlp": (False, ("train.recompute.granularity=mlp", OFFLOAD))}
ZERO3_CASES = {"none": (False, ()), "block": (False, ("train.recompute.granularity=block", OFFLOAD)),
               "attention": (False, ("train.recompute.granularity=attention", OFFLOAD))}


def _cases_rank(rank, world_size):
    pipe = {name: _train_rank(rank, world_size, 2, 2, 1, fp32_config(1, checkpointing=ckpt), 2, extra, 1, "debug", 0)
            for name, (ckpt, extra) in PIPE_CASES.items()}
    zero3 = {name: _train_rank(rank, world_size, 2, 1, 2, fp32_config(3, checkpointing=ckpt), 2, extra, 1, "debug", 0)
             for name, (ckpt, extra) in ZERO3_CASES.items()}
    return {"tp2-pp2": pipe, "tp2-dp2-zero3": zero3}


def test_offloaded_checkpoints_at_tp2_pp2_and_tp2_zero3_match_no_checkpointing():
    results = run_ranks(_cases_rank, 4)
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
