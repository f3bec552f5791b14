"""Each rank's random state beside a checkpoint, restored when a run resumes where it draws what the writer drew.

What draws from a process's global generators in training: LoRA's dropout (model.lora.dropout, the adapters' input
masks: parallel/distributed/layers.py) and nothing else (the data order, noise, timesteps and caption dropout come
from (seed, step, sample): parallel/train/data.py; validation and sampling run the model in eval mode and draw from
generators of their own). build_trainer seeds them once the model is built, one stream per (stage, dp, sp)
coordinate that its tp ranks share (parallel/distributed/seed.py training_seed): replicas and token shards draw
their own masks, the tp ranks of a coordinate the same. `step{N}/rng/rank{R:05d}.safetensors` holds rank R's CPU
generator state (`cpu`), its device's (`device`, none on CPU) as they were after step N, and the stream they belong
to (`stream`, `stream_of`), listed in the marker and checksummed like every other file
(parallel/checkpoints/checkpoint.py).

A stream's draws are the same at any tp size and ZeRO stage: a column-parallel adapter's input is whole on every tp
rank, and a row-parallel one's draws the mask of the whole input and keeps its columns (layers.ShardDropout), so
every tp rank of a coordinate draws what tp = 1 draws, in the same order. A resume restores rank R's generators
from the writer's rank at R's (stage, dp, sp) with tp rank 0 wherever that rank's recorded stream is R's: the same
pp, dp, sp (and ring) sizes and the same blocks on the stage, the tp size and the ZeRO stage free. The continuation
then draws the uninterrupted run's masks, number for number. Where the streams differ (another dp, sp or pipeline
partition: the masks' shapes and owners change) nothing is restored and the run continues in distribution only;
so too for a checkpoint written before these files existed, or before they recorded their stream.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from parallel.checkpoints import safetensors_crc
from parallel.distributed import accelerator
from parallel.distributed.topology import ParallelDims

FOLDER = "rng"


def _path(folder: Path, rank: Optional[int] = None) -> Path:
    return Path(folder) / FOLDER / f"rank{dist.get_rank() if rank is None else rank:05d}.safetensors"


def stream_of(ctx, blocks_per_stage: list[int]) -> torch.Tensor:
    """What fixes the draws of this rank's stream (module docstring): its (stage, dp, sp) coordinate, the pp, dp, sp
    and ring sizes, and the first block and block count of its stage; int64 [9]."""
    first = sum(blocks_per_stage[:ctx.pp_rank])
    return torch.tensor([ctx.pp_rank, ctx.dp_rank, ctx.sp_rank, ctx.pp_size, ctx.dp_size, ctx.sp_size, ctx.ring_size,
                         first, blocks_per_stage[ctx.pp_rank]], dtype=torch.int64)


def write(folder: Path, stream: torch.Tensor) -> dict[str, str]:
    """Write this rank's generator states and their `stream` (stream_of) into `folder` (a step{N});
    {name under `folder`: crc32} of the file."""
    tensors = {"cpu": torch.get_rng_state(), "stream": stream}
    device = accelerator.rng_state()
    if device is not None:
        tensors["device"] = device
    path = _path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        crc = safetensors_crc.save(tensors, path)
    except OSError as e:        # a full disk: said with the file, as the layout-free copy says it
        raise (OSError(e.errno, f"{path}: {e.strerror}") if e.errno else OSError(f"{path}: {e}")) from e
    return {f"{FOLDER}/{path.name}": crc}


def restore(folder: Path, saved: Optional[dict] = None, ctx=None, stream: Optional[torch.Tensor] = None) -> bool:
    """Set this rank's generators to the states `write` left in `folder`: this rank's file at the layout that wrote
    it (`saved` None), or at another layout (`saved`, the writer's layout: checkpoint.saved_layout) the file of the
    writer's rank at this rank's (stage, dp, sp) and tp rank 0, when that file's stream is this rank's `stream`
    (stream_of). False where nothing was restored."""
    from safetensors.torch import load_file

    rank = None
    if saved is not None:
        dims = ParallelDims(**{k: saved.get(k, 1) for k in ("tp_size", "sp_size", "pp_size", "dp_size", "ring_size")})
        if (dims.pp_size, dims.dp_size, dims.sp_size) != (ctx.pp_size, ctx.dp_size, ctx.sp_size):
            return False
        rank = dims.rank(pp=ctx.pp_rank, dp=ctx.dp_rank, tp=0, sp=ctx.sp_rank)
    path = _path(folder, rank)
    if not path.is_file():
        return False
    tensors = load_file(str(path))
    if saved is not None and not ("stream" in tensors and torch.equal(tensors["stream"], stream)):
        return False
    torch.set_rng_state(tensors["cpu"])
    if "device" in tensors:
        accelerator.set_rng_state(tensors["device"])
    return True
