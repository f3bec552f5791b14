"""Rank arithmetic of the (pp, dp, sp, tp) grid against DeepSpeed's own topology, and launcher variables."""
import pytest
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from parallel.distributed.topology import ParallelContext, ParallelDims, read_launch_env

SHAPES = [(1, 1, 1), (2, 1, 2), (2, 2, 1), (1, 2, 2), (2, 2, 2), (3, 2, 4), (4, 1, 2), (2, 4, 3)]


@pytest.mark.parametrize("pp, dp, tp", SHAPES)
def test_grid_matches_deepspeed_topology(pp, dp, tp):
    grid = ParallelDims(tp_size=tp, pp_size=pp, dp_size=dp)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    assert grid.world_size == topo.world_size()
    for rank in range(grid.world_size):
        c, ds = grid.coord(rank), topo.get_coord(rank)
        assert (c.pp, c.dp, c.tp) == (ds.pipe, ds.data, ds.model)
        assert grid.rank(pp=c.pp, dp=c.dp, tp=c.tp) == rank
    assert sorted(grid.tp_groups()) == sorted(topo.get_axis_comm_lists("model"))
    assert sorted(grid.dp_groups()) == sorted(topo.get_axis_comm_lists("data"))
    assert sorted(grid.pp_groups()) == sorted(topo.get_axis_comm_lists("pipe"))


@pytest.mark.parametrize("pp, dp, sp, tp", [(1, 1, 2, 1), (1, 2, 2, 2), (2, 1, 2, 2), (2, 2, 4, 1), (1, 3, 2, 2)])
def test_sequence_axis_is_inside_deepspeeds_data_axis(pp, dp, sp, tp):
    """DeepSpeed sees dp x sp data ranks: its data coordinate is dp_rank * sp + sp_rank."""
    grid = ParallelDims(tp_size=tp, sp_size=sp, pp_size=pp, dp_size=dp)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp * sp)
    assert grid.world_size == topo.world_size()
    for rank in range(grid.world_size):
        c, ds = grid.coord(rank), topo.get_coord(rank)
        assert (c.pp, c.dp * sp + c.sp, c.tp) == (ds.pipe, ds.data, ds.model)
        assert grid.rank(pp=c.pp, dp=c.dp, tp=c.tp, sp=c.sp) == rank
        ctx = ParallelContext(grid, rank=rank)
        assert ctx.get_data_parallel_rank() == ds.data and ctx.get_data_parallel_world_size() == dp * sp
    assert sorted(grid.data_groups()) == sorted(topo.get_axis_comm_lists("data"))
    for group in grid.sp_groups():       # same (pp, dp, tp), consecutive sp coordinates
        coords = [grid.coord(r) for r in group]
        assert len({(c.pp, c.dp, c.tp) for c in coords}) == 1 and [c.sp for c in coords] == list(range(sp))
    assert sorted(r for g in grid.sp_groups() for r in g) == list(range(grid.world_size))


def test_tp_peers_are_neighbours():
    assert ParallelDims(tp_size=4, pp_size=2, dp_size=2).tp_groups()[0] == [0, 1, 2, 3]


def test_context_without_groups_exposes_mpu_interface():
    ctx = ParallelContext(ParallelDims(tp_size=2, pp_size=2, dp_size=2), rank=5)   # pp 1, dp 0, tp 1
    assert (ctx.pp_rank, ctx.dp_rank, ctx.tp_rank) == (1, 0, 1)
    assert ctx.get_model_parallel_rank() == 1 and ctx.get_model_parallel_world_size() == 2
    assert ctx.get_data_parallel_world_size() == 2 and ctx.get_tensor_model_parallel_src_rank() == 4


@pytest.mark.parametrize("env, expected", [
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (3, 8, 1, 2, "torch/deepspeed")),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, (5, 6, 2, 3, "openmpi")),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, (1, 2, 0, 2, "mpich")),
    ({"SLURM_PROCID": "7", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "8(x2)"},
     (7, 16, 3, 8, "slurm")),
    ({}, (0, 1, 0, 1, "none")),
])
def test_launch_env_from_every_launcher(env, expected):
    e = read_launch_env(env)
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.launcher) == expected


def test_launch_env_refuses_inconsistent_values():
    with pytest.raises(ValueError, match="RANK=4 is outside WORLD_SIZE=4"):
        read_launch_env({"RANK": "4", "WORLD_SIZE": "4"})
