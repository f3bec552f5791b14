"""Selective recomputation under tp 2 x pp 2 (ZeRO-1, fp32, 4 gloo ranks, one spawn): each option trains
like the same layout without checkpointing (itself equal to one process: test_train_equivalence.py);
the tp collectives inside recomputed regions and the pipeline's block numbering are what is exercised."""
from __future__ import annotations

import torch

from tests.dist_utils import run_ranks
from tests.train_utils import _train_rank, fp32_config

CASES = {"none": (), "attention": ("train.recompute.granularity=attention",),
         "mlp": ("train.recompute.granularity=mlp",),
         "every-2": ("train.recompute.granularity=block", "train.recompute.every=2")}


def _cases_rank(rank, world_size):
    ds = fp32_config(1, checkpointing=False)
    return {name: _train_rank(rank, world_size, 2, 2, 1, ds, 2, extra, 1, "debug", 0) for name, extra in CASES.items()}


def test_recompute_options_at_tp2_pp2_match_no_checkpointing():
    results = run_ranks(_cases_rank, 4)
    for name in ("attention", "mlp", "every-2"):
        for rank in results:
            torch.testing.assert_close(torch.tensor(rank[name]["losses"]), torch.tensor(rank["none"]["losses"]),
                                       msg=lambda m: f"{name}: {m}")
            for key, value in rank["none"]["state"].items():
                torch.testing.assert_close(rank[name]["state"][key], value, msg=lambda m: f"{name} {key}: {m}")
            assert rank[name]["replica_mismatches"] == []
