"""train.compile (regional compilation, parallel/distributed/compile.py) against eager: the same losses over 3 steps,
one compiled graph per block class whatever the number of blocks, and no graph breaks, in one process with
inductor and at tp 2 x pp 2 (ZeRO-1, activation checkpointing) and sp 2 x dp 2 (ZeRO-2) with aot_eager.

aot_eager runs dynamo and AOTAutograd (the graph capture, the collectives inside it, the joint
forward/backward) but not inductor's C++ code generation, which takes about 40 s for one block on
this shared 2-core machine and would take it once per rank; inductor's numerics are checked in one
process. The debug preset with 2 blocks: the one-process run holds both blocks, each pp stage one.

The same spawn measures communication_data_type's gradient bytes against the planner's byte model
(one spawn for both: starting 4 ranks costs more than the runs).
"""
from __future__ import annotations

import torch

from tests.dist_utils import run_ranks
from tests.train_utils import experiment, fp32_config

LAYERS = "model.num_layers=2"
STEPS = 3


def _compile_rank(rank, world_size, runs):
    """Each (name, tp, pp, sp, dp, stage, checkpointing, backend, ds extra) run: losses, dynamo counters,
    first-step time, and (a run with a ds extra) the bytes of the third step's collectives by op."""
    import time

    from bench.comm import _install_counter
    from parallel.distributed.compile import compile_stats
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches

    out, totals = {}, {}
    for name, tp, pp, sp, dp, stage, checkpointing, backend, ds_extra, *sets in runs:
        extra = [LAYERS, *sets] + (["train.compile=true", f"train.compile_backend={backend}"] if backend else [])
        if ds_extra is not None and not totals:
            _install_counter(totals)        # after the compiled runs: their graphs trace torch.distributed
        cfg = experiment(tp, pp, dp, extra, sp)
        ctx = ParallelContext.build(ParallelDims(tp_size=tp, sp_size=sp, pp_size=pp, dp_size=dp))
        seed_all(cfg.train.seed)
        compile_stats(reset=True)
        trainer = build_trainer(cfg, {**fp32_config(stage, checkpointing), **(ds_extra or {})}, ctx)
        batches = training_batches(cfg, ctx)
        losses, first, saved = [], 0.0, []
        for step in range(STEPS):
            totals.clear()
            totals["on"] = step == STEPS - 1 and ds_extra is not None
            tic = time.perf_counter()
            # bytes saved for backward that reach this outermost hook (compression's own hooks hide theirs)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size())
                                                          or t, lambda t: t):
                losses.append(trainer.train_step(batches).loss)
            first = first or time.perf_counter() - tic
        totals.pop("on", None)
        out[name] = {"losses": losses, "first_step_s": first, "bytes": dict(totals), "saved": sum(saved),
                     "params": sum(p.numel() for p in trainer.engine.module.parameters()), **compile_stats(reset=True)}
    return out


def test_compiled_blocks_train_like_eager():
    block, bf16 = "train.recompute.granularity=block", "train.activation_compression.dtype=bf16"
    one = run_ranks(_compile_rank, 1, [("eager", 1, 1, 1, 1, 0, False, None, None),
                                       ("inductor", 1, 1, 1, 1, 0, False, "inductor", None),
                                       ("aot", 1, 1, 1, 1, 0, False, "aot_eager", None),
                                       ("aot_block", 1, 1, 1, 1, 0, False, "aot_eager", None, block),
                                       ("bf16", 1, 1, 1, 1, 0, False, None, None, bf16),
                                       ("aot_bf16", 1, 1, 1, 1, 0, False, "aot_eager", None, bf16)])[0]
    eager = torch.tensor(one["eager"]["losses"])
    assert len(set(one["eager"]["losses"])) == STEPS, "the reference does not train"
    # inductor fuses and reorders fp32 reductions: measured |diff| <= 3e-8 on these losses
    torch.testing.assert_close(torch.tensor(one["inductor"]["losses"]), eager, rtol=1e-5, atol=1e-6)
    # both blocks (one class) share one graph: the joint forward/backward, compiled once
    assert (one["inductor"]["graphs"], one["inductor"]["graph_breaks"]) == (1, 0)
    # train.recompute wraps the compiled blocks: recomputing whole blocks keeps the losses and saves a fraction
    # of the bytes...
    torch.testing.assert_close(torch.tensor(one["aot_block"]["losses"]), eager, rtol=1e-5, atol=1e-6)
    assert one["aot_block"]["saved"] < 0.5 * one["aot"]["saved"], (one["aot_block"]["saved"], one["aot"]["saved"])
    # ...but compression's saved_tensors_hooks do not reach inside a compiled block (AOTAutograd saves its tensors
    # itself): the compiled losses are the uncompressed ones, which is why the checker refuses the two together
    assert one["bf16"]["losses"] != one["eager"]["losses"], "bf16 compression changed nothing"
    assert one["aot_bf16"]["losses"] == one["aot"]["losses"]

    ranks = run_ranks(_compile_rank, 4, [("tp2_pp2", 2, 2, 1, 1, 1, True, "aot_eager", None),
                                         ("sp2_dp2_zero2", 1, 1, 2, 2, 2, False, "aot_eager", None),
                                         *[(f"grads_{dtype}", 1, 1, 2, 2, 1, False, None,
                                            {"communication_data_type": dtype}) for dtype in ("fp32", "bf16")]])
    for rank, result in enumerate(ranks):
        for name in ("tp2_pp2", "sp2_dp2_zero2"):
            run = result[name]
            torch.testing.assert_close(torch.tensor(run["losses"]), eager, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
            assert run["graph_breaks"] == 0, (rank, name, run)
        # one graph per block class: sp 2 (two blocks a rank) as one process; a pp stage (one block) with
        # checkpointing has two, DeepSpeed's forward under no_grad and the recomputation with grad
        assert (result["sp2_dp2_zero2"]["graphs"], result["tp2_pp2"]["graphs"]) == (1, 2), (rank, result)
    _communication_bytes_match_the_plan(ranks[0], eager)


def _communication_bytes_match_the_plan(result, eager):
    """ZeRO-1 over dp 2 x sp 2 (DeepSpeed's data axis: 4 ranks): the gradient all-reduce, measured in bytes,
    against the planner's model (parallel.plan.search.dp_bytes): bf16 halves fp32's."""
    from parallel.plan.memory import EngineSettings
    from parallel.plan.search import dp_bytes

    for dtype in ("fp32", "bf16"):
        run = result[f"grads_{dtype}"]
        settings = EngineSettings.from_ds({"zero_optimization": {"stage": 1}, "communication_data_type": dtype}, 2)
        planned = dp_bytes(settings, run["params"])[0]
        # the all-reduces besides the gradients' (the loss and the grad norm: a few scalars) are 16 bytes
        assert 0 <= run["bytes"]["all_reduce"] - planned <= 64, (dtype, run["bytes"], planned)
    assert result["grads_bf16"]["bytes"]["all_reduce"] < 0.51 * result["grads_fp32"]["bytes"]["all_reduce"]
    # a lossy reduction: bf16 gradients move the losses by about 1e-4 relative, fp32 ones not at all
    torch.testing.assert_close(torch.tensor(result["grads_fp32"]["losses"]), eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(result["grads_bf16"]["losses"]), eager, rtol=1e-3, atol=1e-4)


# Every family whose blocks read a position table (models.geometry.PositionCache; Wan 2.2's blocks are Wan's), at 2
# blocks, with its block variants (HunyuanVideo's dual- and single-stream blocks: one class, two graphs); debug is
# CogVideoX with 3D rotary.
ROTARY = {"debug": (1, ["model.pos_embed=rope3d", "model.sample_width=12"]), "debug-wan": (1, []),
          "debug-hunyuan": (2, ["model.num_dual_layers=1"]), "debug-hunyuan15": (1, []), "debug-ltx2": (1, []),
          "debug-stdit": (1, [])}


def _family_rank(rank, world_size, presets):
    """Per preset: eager and aot_eager losses over 2 checkpointed steps, and dynamo's counters."""
    import torch._dynamo

    from parallel.distributed.compile import compile_stats
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches

    out = {}
    for preset, sets in presets.items():
        for backend in (None, "aot_eager"):
            torch._dynamo.reset()
            cfg = experiment(1, 1, 1, [LAYERS, *sets, *(["train.compile=true", f"train.compile_backend={backend}"]
                                                         if backend else [])], preset=preset)
            seed_all(cfg.train.seed)
            compile_stats(reset=True)
            ctx = ParallelContext.build(ParallelDims())
            trainer = build_trainer(cfg, fp32_config(0, True), ctx)
            batches = training_batches(cfg, ctx)
            out[preset, backend] = {"losses": [trainer.train_step(batches).loss for _ in range(2)],
                                    **compile_stats(reset=True)}
    return out


def test_every_rotary_family_compiles_each_block_variant_once():
    """The position tables are built before the compiled block runs (PositionCache.warm): built inside the first
    trace, the table lookup that missed there hits in the next call, a guard failure, and every step shape compiled
    a graph twice (checkpointed rope3d: 3 graphs before, 2 now). Checkpointed, a variant has two graphs:
    DeepSpeed's no-grad forward and the recomputation with grad. The losses are eager's (aot_eager: the same ops)."""
    result = run_ranks(_family_rank, 1, {p: sets for p, (_, sets) in ROTARY.items()})[0]
    for preset, (variants, _) in ROTARY.items():
        eager, compiled = result[preset, None], result[preset, "aot_eager"]
        assert len(set(eager["losses"])) == 2, (preset, "the reference does not train")
        torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-6,
                                   atol=1e-7, msg=lambda m: f"{preset}: {m}")
        assert (compiled["graphs"], compiled["graph_breaks"]) == (2 * variants, 0), (preset, compiled)
