"""The planner's per-layer collective counts, held against the collectives a layer really makes.

parallel/plan/search.py prices tensor parallelism by FamilySpec.row_parallel (b x S x H all-reduces in one
layer's forward, the mean over the layers; an all-reduce of part of the sequence counts its share) and
sequence parallelism by FamilySpec.costs.attentions_per_layer (Ulysses attentions, four all-to-alls each). Both are
written by hand in each family's spec; here one forward of every layer of every
registered family (the built-ins' debug presets, and the toy family of tests/toy_family registered at run
time) at tp 2 x sp 2 counts them: all-reduces through parallel/distributed/comm.py's count_comm(), all-to-alls
at torch.distributed.
"""
from __future__ import annotations

import glob
import math
import os

import pytest

from tests.dist_utils import count_all_to_alls, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Every tiny preset (a built-in family brings its configs/debug*.yaml), and the toy family's.
PRESETS = sorted(glob.glob(os.path.join(ROOT, "configs", "debug*.yaml"))) + \
    [os.path.join(ROOT, "tests", "toy_family", "debug-toy.yaml")]
B = 2


def _count_rank(rank, world_size):
    import deepspeed
    import torch

    from models.registry import FAMILIES, family
    from parallel.model.build import build_model
    from parallel.experiment.config import load_config
    from parallel.distributed import accelerator
    from parallel.distributed.comm import count_comm
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.run import training_batches

    deepspeed.init_distributed(dist_backend=accelerator.backend())
    ctx = ParallelContext.build(ParallelDims(tp_size=2, sp_size=2, pp_size=1, dp_size=1))
    out = {"counted": [], "refused": []}
    for preset in PRESETS:
        cfg = load_config(preset, [f"train.micro_batch_size={B}", "parallel.tp_size=2", "parallel.sp_size=2"])
        spec = family(cfg.model)
        if spec.name in out or spec.name in out["refused"]:       # one preset per family suffices
            continue
        if cfg.model.unsupported(cfg):                            # a family the checker refuses to train (none now;
            out["refused"].append(spec.name)                      # LTX-2's block counts: test_ltx2_layouts too)
            continue
        out["counted"].append(spec.name)
        inputs, _ = next(training_batches(cfg, ParallelContext.single()))
        torch.manual_seed(0)
        model = build_model(cfg, {}, ctx)
        with torch.no_grad():
            h = model.embed(inputs)
            x = h[0]                                              # (B, S_pad / sp, H): this rank's tokens
            with count_comm() as comm, count_all_to_alls() as calls:
                for block in model.blocks:                        # every layer: a family's layers may differ
                    h = block(h)
        bsh = x.shape[0] * x.shape[1] * cfg.model.hidden_size
        layers = len(model.blocks)
        # a row-parallel output [B, rows, H]; one of part of the sequence (HunyuanVideo's text rows, its video rows)
        # counts its share (a q/k norm's statistics [B, S, 1] are no b x S x H all-reduce)
        hidden = [math.prod(shape) / bsh for op, shape in comm.shapes
                  if op == "all_reduce" and len(shape) == 3 and shape[-1] == cfg.model.hidden_size]
        out[spec.name] = {"row_parallel": sum(hidden) / layers, "all_to_all": len(calls) / layers,
                          "declared": (spec.row_parallel(cfg.model), spec.costs.attentions_per_layer)}
    out["families"] = sorted(FAMILIES)
    return out


def test_declared_collective_counts_equal_one_layers_forward():
    results = run_ranks(_count_rank, 4)
    for r in results:
        assert sorted(r["counted"] + r["refused"]) == r["families"]      # every registered family is counted
        assert r["refused"] == []                                        # or refused by the checker
        assert {"cogvideox", "stdit", "toy", "wan"} <= set(r["families"])
        for name in r["counted"]:
            counts = r[name]
            row_parallel, attentions = counts["declared"]
            assert counts["row_parallel"] == pytest.approx(row_parallel), f"{name}: {counts}"
            assert counts["all_to_all"] == 4 * attentions, f"{name}: {counts}"
