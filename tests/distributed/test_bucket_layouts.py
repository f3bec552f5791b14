"""Bucketed training: a directory dataset of three shapes trains at tp2 x sp2, pp2 x dp2, dp2 x tp2 with
ZeRO-2 and Ulysses 2 x ring 2 to one process's losses (fp32) and weights (fp32 plus Adam's round-off bound, tests/adam_bound.py),
step by step, every step's batch from one bucket.

The layouts share one spawn of 4 ranks (each builds its context and engine in turn); the one-process
reference is a spawn of its own. Every rank records the token grid of each step: the same sequence in
every layout and on every rank, and it visits all three buckets.
"""
import pytest
import torch

from tests.buckets_utils import SHAPES, write_buckets
from tests.dist_utils import run_ranks
from tests.adam_bound import add_step_slack
from tests.train_utils import assert_weights_match, experiment, fp32_config

STEPS = 4
# (tp, sp, pp, dp, ZeRO stage[, ring]): ulysses 2 x ring 2 pads each bucket's sequence to a multiple of 4 and
# hands the ring the step's real token count.
LAYOUTS = {"tp2-sp2": (2, 2, 1, 1, 0), "pp2-dp2": (1, 1, 2, 2, 1), "dp2-tp2-zero2": (2, 1, 1, 2, 2),
           "ulysses2-ring2": (1, 4, 1, 1, 0, 2)}


def _train(root, tp, sp, pp, dp, stage, ring=1):
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches
    from parallel.weights.gather import full_state

    cfg = experiment(tp, pp, dp, ("data.kind=directory", f"data.path={root}", f"parallel.ring_size={ring}"), sp)
    ctx = ParallelContext.build(ParallelDims(tp_size=tp, sp_size=sp, pp_size=pp, dp_size=dp, ring_size=ring))
    seed_all(cfg.train.seed)
    trainer = build_trainer(cfg, fp32_config(stage), ctx)
    batches = training_batches(cfg, ctx)
    losses, grids, slack = [], [], {}
    for _ in range(STEPS):
        lr = trainer.engine.get_lr()[0]
        losses.append(trainer.train_step(batches).loss)
        grids.append(trainer.engine.module.step_grid.value)
        if tp * sp * pp * dp == 1:                    # the reference: what Adam may make of round-off
            add_step_slack(slack, trainer, ctx, cfg.model.num_layers, lr)
    return {"losses": losses, "grids": grids, "state": full_state(trainer.engine.module, ctx, cfg.model.num_layers),
            "slack": slack}


def _one_process(rank, world_size, root):
    return _train(root, 1, 1, 1, 1, 0)


def _layouts(rank, world_size, root):
    return {name: _train(root, *layout) for name, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("buckets")
    write_buckets(root)
    return run_ranks(_one_process, 1, root)[0], run_ranks(_layouts, 4, root)


def test_reference_visits_every_bucket(runs):
    reference, _ = runs
    assert len(set(reference["grids"])) == len(SHAPES), reference["grids"]
    assert len(set(reference["losses"])) == STEPS


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bucketed_layout_matches_one_process(runs, name):
    reference, ranks = runs
    expected = torch.tensor(reference["losses"], dtype=torch.float32)
    state = {}
    for r in ranks:
        assert r[name]["grids"] == reference["grids"]
        torch.testing.assert_close(torch.tensor(r[name]["losses"], dtype=torch.float32), expected)
        state.update(r[name]["state"])
    assert_weights_match(state, reference, f"{name} ")
