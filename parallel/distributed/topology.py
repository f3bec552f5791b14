"""The (pp, dp, sp, tp) process grid: pure rank arithmetic, and the `ParallelContext` that owns the groups.

Axis order is DeepSpeed's `PipeModelDataParallelTopology` (pipe, data, model) with tp innermost, so
tensor-parallel peers are neighbouring ranks (one node, fastest links), and sequence-parallel peers
next to them:

    rank = ((pp_rank * dp_size + dp_rank) * sp_size + sp_rank) * tp_size + tp_rank

Inside the sp axis, Ulysses x ring (parallel/distributed/sequence.py): sp_size = ulysses_size x ring_size and

    sp_rank = ring_rank * ulysses_size + ulysses_rank

so Ulysses peers (four all-to-alls per attention, the heavier traffic) are neighbouring ranks, inside a node,
and ring peers (key/value chunks passed point to point, overlapped with attention) stride across nodes.
A Ulysses group holds one contiguous ring chunk of the sequence (sp ranks hold consecutive tokens).

To DeepSpeed the sp ranks are data-parallel ranks (they hold the same parameters; ZeRO shards and the
gradient average run over dp x sp, its "data" axis of size dp_size * sp_size), while the toolkit's
own dp (data shards, validation replicas) counts only the replicas that read different samples.

`ParallelDims` needs no process group and is unit-tested in one process; `ParallelContext.build` creates every
group on every rank in the same order (a torch.distributed requirement) and is passed explicitly to
the model, to `deepspeed.initialize(mpu=...)` and to `deepspeed.checkpointing.configure(mpu, ...)`.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class Coord:
    pp: int
    dp: int
    tp: int
    sp: int = 0


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The layout: tp_size x sp_size x pp_size x dp_size ranks, keyword-only, validated once, and the rank
    arithmetic of the grid they make. The one value the checker, the context, checkpoints and the
    planner's candidates carry."""

    tp_size: int = 1
    sp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    ring_size: int = 1          # of sp_size: ring attention's share (the rest, ulysses_size, is Ulysses')

    def __post_init__(self):
        for name in ("tp_size", "sp_size", "pp_size", "dp_size", "ring_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.sp_size % self.ring_size:
            raise ValueError(f"ring_size={self.ring_size} must divide sp_size={self.sp_size} "
                             f"(sp_size = ulysses_size x ring_size)")

    @property
    def ulysses_size(self) -> int:
        return self.sp_size // self.ring_size

    @property
    def world_size(self) -> int:
        return self.pp_size * self.dp_size * self.sp_size * self.tp_size

    def as_dict(self) -> dict[str, int]:
        """{"tp_size": .., "sp_size": .., "pp_size": .., "dp_size": ..}: checkpoints and reports; "ring_size"
        only when > 1 (it changes no parameter or optimizer shard, and older checkpoints lack it)."""
        ring = {"ring_size": self.ring_size} if self.ring_size > 1 else {}
        return {"tp_size": self.tp_size, "sp_size": self.sp_size, "pp_size": self.pp_size, "dp_size": self.dp_size,
                **ring}

    def describe(self) -> str:
        """`tp=2 sp=2 pp=1 dp=2` (sp only when > 1; `sp=4 (ulysses 2 x ring 2)` with a ring)."""
        sp = f" sp={self.sp_size}" if self.sp_size > 1 else ""
        if self.ring_size > 1:
            sp += f" (ulysses {self.ulysses_size} x ring {self.ring_size})"
        return f"tp={self.tp_size}{sp} pp={self.pp_size} dp={self.dp_size}"

    def rank(self, *, pp: int, dp: int, tp: int, sp: int = 0) -> int:
        return ((pp * self.dp_size + dp) * self.sp_size + sp) * self.tp_size + tp

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        rest, tp = divmod(rank, self.tp_size)
        rest, sp = divmod(rest, self.sp_size)
        pp, dp = divmod(rest, self.dp_size)
        return Coord(pp=pp, dp=dp, tp=tp, sp=sp)

    def _groups(self, vary: str) -> list[list[int]]:
        """Ranks that differ only in axis `vary`, one list per coordinate of the other axes."""
        sizes = {"pp": self.pp_size, "dp": self.dp_size, "sp": self.sp_size, "tp": self.tp_size}
        fixed = [a for a in sizes if a != vary]
        return [[self.rank(**dict(zip(fixed, others)), **{vary: i}) for i in range(sizes[vary])]
                for others in itertools.product(*(range(sizes[a]) for a in fixed))]

    def tp_groups(self) -> list[list[int]]:
        """Ranks that share one (pp, dp, sp) coordinate, in tp order."""
        return self._groups("tp")

    def sp_groups(self) -> list[list[int]]:
        return self._groups("sp")

    def ulysses_groups(self) -> list[list[int]]:
        """Each sp group cut into ring_size runs of ulysses_size consecutive sp ranks (one ring chunk each)."""
        u = self.ulysses_size
        return [g[i:i + u] for g in self.sp_groups() for i in range(0, self.sp_size, u)]

    def ring_groups(self) -> list[list[int]]:
        """The sp ranks of one Ulysses position, in ring order: every ulysses_size-th rank of an sp group."""
        u = self.ulysses_size
        return [g[i::u] for g in self.sp_groups() for i in range(u)]

    def dp_groups(self) -> list[list[int]]:
        return self._groups("dp")

    def pp_groups(self) -> list[list[int]]:
        return self._groups("pp")

    def data_groups(self) -> list[list[int]]:
        """DeepSpeed's data axis: dp x sp ranks of one (pp, tp) coordinate, in (dp, sp) order."""
        return [[self.rank(pp=p, dp=d, tp=t, sp=s) for d in range(self.dp_size) for s in range(self.sp_size)]
                for p, t in itertools.product(range(self.pp_size), range(self.tp_size))]

    def model_groups(self) -> list[list[int]]:
        """Ranks holding one full copy of the parameters (pp x tp) for one (dp, sp) coordinate, sorted."""
        return [sorted(self.rank(pp=p, dp=d, tp=t, sp=s) for p in range(self.pp_size) for t in range(self.tp_size))
                for d, s in itertools.product(range(self.dp_size), range(self.sp_size))]


@dataclass(frozen=True, kw_only=True)
class Layout(ParallelDims):
    """A checked run (parallel/check.py builds it): the parallel sizes and the engine settings that go with them."""

    zero_stage: int
    precision: str
    global_batch: int

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(**self.as_dict())


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str


# (launcher, rank, world size, local rank, local world size) variables, checked in this order.
_LAUNCH_VARS = (
    ("torch/deepspeed", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


def read_launch_env(environ: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """Rank, world size and local rank from whichever launcher started this process (one process if none)."""
    env = os.environ if environ is None else environ
    for launcher, rank, world, local, local_world in _LAUNCH_VARS:
        if rank in env and world in env:
            def num(key: str, default: int) -> int:
                raw = env.get(key, str(default)).split("(")[0].split(",")[0]  # slurm: "4(x2)" / "4,2"
                if not raw.strip().isdigit():
                    raise ValueError(f"launcher variable {key}={env.get(key)!r} is not a number")
                return int(raw)
            world_size = num(world, 1)
            r = num(rank, 0)
            if not 0 <= r < world_size:
                raise ValueError(f"{rank}={r} is outside {world}={world_size}")
            return LaunchEnv(r, world_size, num(local, 0), num(local_world, world_size), launcher)
    return LaunchEnv(0, 1, 0, 1, "none")


@dataclass
class ParallelContext:
    """This rank's place in the grid and its process groups; also DeepSpeed's `mpu` interface.

    With tp_size == 1 (or on a single process) groups may be None: the layers then skip communication.
    A context with tp_size or sp_size > 1 and no group for it is a planning context: the model is traced on
    the meta device with one rank's shapes (parallel.distributed.comm, parallel.distributed.sequence).
    """

    dims: ParallelDims
    rank: int = 0
    tp_group: Optional[object] = None
    dp_group: Optional[object] = None
    pp_group: Optional[object] = None
    model_group: Optional[object] = None
    sp_group: Optional[object] = None
    data_group: Optional[object] = None
    ulysses_group: Optional[object] = None      # the sp group when ring_size == 1
    ring_group: Optional[object] = None         # the sp group when ulysses_size == 1
    coord: Coord = field(init=False)

    def __post_init__(self):
        self.coord = self.dims.coord(self.rank)

    @classmethod
    def single(cls, tp_size: int = 1, sp_size: int = 1, ring_size: int = 1) -> "ParallelContext":
        """A context with no process groups: one process, or a meta-device build for planning."""
        return cls(ParallelDims(tp_size=tp_size, sp_size=sp_size, ring_size=ring_size), rank=0)

    @classmethod
    def build(cls, dims: ParallelDims) -> "ParallelContext":
        """Create every group of `dims`; call on every rank after `torch.distributed` is initialised."""
        if dist.get_world_size() != dims.world_size:
            raise ValueError(
                f"world size {dist.get_world_size()} != tp_size x sp_size x pp_size x dp_size = "
                f"{dims.tp_size} x {dims.sp_size} x {dims.pp_size} x {dims.dp_size} = {dims.world_size}")
        rank = dist.get_rank()
        mine = {}
        kinds = [("tp_group", dims.tp_groups()), ("dp_group", dims.dp_groups()), ("pp_group", dims.pp_groups()),
                 ("model_group", dims.model_groups())]
        if dims.sp_size > 1:
            kinds += [("sp_group", dims.sp_groups()), ("data_group", dims.data_groups())]
        if 1 < dims.ring_size < dims.sp_size:
            kinds += [("ulysses_group", dims.ulysses_groups()), ("ring_group", dims.ring_groups())]
        for name, lists in kinds:
            for ranks in lists:
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine[name] = group
        mine.setdefault("data_group", mine.get("dp_group"))
        if dims.sp_size > 1:
            mine.setdefault("ring_group" if dims.ulysses_size == 1 else "ulysses_group", mine["sp_group"])
        return cls(dims, rank=rank, **mine)

    # The vocabulary used across the toolkit.
    @property
    def tp_size(self) -> int:
        return self.dims.tp_size

    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def sp_size(self) -> int:
        return self.dims.sp_size

    @property
    def sp_rank(self) -> int:
        return self.coord.sp

    @property
    def ring_size(self) -> int:
        return self.dims.ring_size

    @property
    def ring_rank(self) -> int:
        return self.coord.sp // self.dims.ulysses_size

    @property
    def ulysses_size(self) -> int:
        return self.dims.ulysses_size

    @property
    def ulysses_rank(self) -> int:
        return self.coord.sp % self.dims.ulysses_size

    @property
    def data_size(self) -> int:
        """DeepSpeed's data-parallel size: dp x sp ranks share the gradient average and the ZeRO shards."""
        return self.dims.dp_size * self.dims.sp_size

    @property
    def data_rank(self) -> int:
        return self.coord.dp * self.dims.sp_size + self.coord.sp

    @property
    def pp_size(self) -> int:
        return self.dims.pp_size

    @property
    def pp_rank(self) -> int:
        return self.coord.pp

    @property
    def stage_writer(self) -> bool:
        """The one rank of its pipeline stage that writes the stage's full tensors (exports): data rank 0 (dp and
        sp: sp ranks hold whole replicas too) and tp rank 0."""
        return self.data_rank == 0 and self.tp_rank == 0

    # DeepSpeed / Megatron mpu interface: "model parallel" means tensor parallel there.
    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_model_parallel_group(self):
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.dims.rank(pp=self.pp_rank, dp=self.dp_rank, tp=0, sp=self.sp_rank)

    def get_data_parallel_rank(self) -> int:
        return self.data_rank

    def get_data_parallel_world_size(self) -> int:
        return self.data_size

    def get_data_parallel_group(self):
        return self.data_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp_size

    def get_pipeline_model_parallel_group(self):
        return self.pp_group

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.dims.world_size}: pp {self.pp_rank}/{self.pp_size} "
                f"dp {self.dp_rank}/{self.dp_size} sp {self.sp_rank}/{self.sp_size} tp {self.tp_rank}/{self.tp_size}"
                + (f" (ulysses {self.ulysses_rank}/{self.ulysses_size} ring {self.ring_rank}/{self.ring_size})"
                   if self.ring_size > 1 else ""))
