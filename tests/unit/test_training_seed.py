"""Each rank's training stream (parallel/distributed/seed.py training_seed): one seed per (stage, dp, sp) coordinate,
the one-process coordinate keeping seed_all's state, so a one-process run draws the dropout masks it drew before.
Spawned ranks' masks: tests/distributed/test_lora_dropout.py."""
import itertools

import torch

from parallel.distributed.seed import seed_training_rng, training_seed
from parallel.distributed.topology import ParallelDims


def test_every_coordinate_of_a_grid_has_its_own_seed():
    dims = ParallelDims(tp_size=2, sp_size=2, pp_size=2, dp_size=3)
    by_rank = {}
    for rank in range(dims.world_size):
        c = dims.coord(rank)
        by_rank[rank] = training_seed(7, pp=c.pp, dp=c.dp, sp=c.sp)
    coordinates = {(dims.coord(r).pp, dims.coord(r).dp, dims.coord(r).sp): s for r, s in by_rank.items()}
    assert len(set(coordinates.values())) == 2 * 3 * 2                  # stages x replicas x shards, all different
    for group in dims.tp_groups():                                      # the tp ranks of a coordinate share theirs
        assert len({by_rank[r] for r in group}) == 1
    assert training_seed(7, pp=0, dp=1, sp=0) != training_seed(8, pp=0, dp=1, sp=0)


def test_the_one_process_coordinate_keeps_seed_alls_state():
    with torch.random.fork_rng(devices=[]):                             # the test process's generator as it was
        torch.manual_seed(7)                                            # seed_all's torch part
        want = torch.get_rng_state()
        torch.rand(3)                                                   # a draw between: the seeding resets it
        seed_training_rng(7, pp=0, dp=0, sp=0)
        assert torch.equal(torch.get_rng_state(), want)
        for pp, dp, sp in itertools.product((0, 1), repeat=3):
            if pp or dp or sp:
                seed_training_rng(7, pp=pp, dp=dp, sp=sp)
                assert not torch.equal(torch.get_rng_state(), want), (pp, dp, sp)
