"""Selective recomputation in 4 gloo ranks, one spawn, fp32: each option trains like the same layout without
checkpointing (itself equal to one process: test_train_equivalence.py, test_sequence_parallel.py).
tp 2 x pp 2 (ZeRO-1): the tp all-reduces inside recomputed MLPs and blocks, the pipeline's block numbering.
tp 2 x sp 2 (ZeRO-2 over the sp ranks): the Ulysses all-to-alls inside a recomputed attention core.
tp 2 x dp 2 (ZeRO-3): parameters gathered and released around recomputed regions (the attention core reads
its parent's parameters outside a module call)."""
from __future__ import annotations

import torch

from tests.dist_utils import run_ranks
from tests.train_utils import _train_rank, fp32_config

PIPE_CASES = {"none": (), "attention": ("train.recompute.granularity=attention",),
              "mlp": ("train.recompute.granularity=mlp",),
              "every-2": ("train.recompute.granularity=block", "train.recompute.every=2")}
SP_CASES = {"none": (), "attention": ("train.recompute.granularity=attention",)}
ZERO3_CASES = {"none": (), "attention": ("train.recompute.granularity=attention",),
               "block": ("train.recompute.granularity=block",)}


def _cases_rank(rank, world_size):
    pipe = {name: _train_rank(rank, world_size, 2, 2, 1, fp32_config(1, checkpointing=False), 2, extra, 1, "debug", 0)
            for name, extra in PIPE_CASES.items()}
    sp = {name: _train_rank(rank, world_size, 2, 1, 1, fp32_config(2, checkpointing=False), 2, extra, 2, "debug", 0)
          for name, extra in SP_CASES.items()}
    zero3 = {name: _train_rank(rank, world_size, 2, 1, 2, fp32_config(3, checkpointing=False), 2, extra, 1, "debug",
                               0) for name, extra in ZERO3_CASES.items()}
    return {"tp2-pp2": pipe, "tp2-sp2": sp, "tp2-dp2-zero3": zero3}


def test_recompute_options_at_tp2_pp2_tp2_sp2_and_zero3_match_no_checkpointing():
    results = run_ranks(_cases_rank, 4)
    for layout, cases in (("tp2-pp2", PIPE_CASES), ("tp2-sp2", SP_CASES), ("tp2-dp2-zero3", ZERO3_CASES)):
        for name in cases:
            for rank in results:
                runs = rank[layout]
                torch.testing.assert_close(torch.tensor(runs[name]["losses"]), torch.tensor(runs["none"]["losses"]),
                                           msg=lambda m: f"{layout} {name}: {m}")
                for key, value in runs["none"]["state"].items():
                    torch.testing.assert_close(runs[name]["state"][key], value,
                                               msg=lambda m: f"{layout} {name} {key}: {m}")
                assert runs[name]["replica_mismatches"] == []
    assert len(set(results[0]["tp2-sp2"]["none"]["losses"])) == 2          # it trains
