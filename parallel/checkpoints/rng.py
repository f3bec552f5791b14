"""Each rank's random state beside a checkpoint, restored when a run resumes at the layout that wrote it.

What draws from a process's global generators in training: LoRA's dropout (model.lora.dropout, the adapters' input
masks: parallel/distributed/layers.py) and nothing else (the data order, noise, timesteps and caption dropout come
from (seed, step, sample): parallel/train/data.py; validation and sampling run the model in eval mode and draw from
generators of their own). build_trainer seeds them once the model is built, one stream per (stage, dp, sp)
coordinate that its tp ranks share (parallel/distributed/seed.py training_seed): replicas and token shards draw
their own masks, the tp ranks of a coordinate the same. `step{N}/rng/rank{R:05d}.safetensors` holds rank R's CPU
generator state (`cpu`) and its device's (`device`, none on CPU) as they were after step N, listed in the marker and
checksummed like every other file (parallel/checkpoints/checkpoint.py). At the same layout rank R is the same (stage,
tp, sp, dp) coordinate and draws the same masks in the same order, so the continuation is the uninterrupted run
number for number; at another layout the masks' shapes and owners differ, nothing is restored and the run continues
in distribution only (parallel/checkpoints/relayout.py). A checkpoint written before these files existed resumes
without them (the generators as build_trainer seeded them).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from parallel.checkpoints import safetensors_crc
from parallel.distributed import accelerator

FOLDER = "rng"


def _path(folder: Path) -> Path:
    return Path(folder) / FOLDER / f"rank{dist.get_rank():05d}.safetensors"


def write(folder: Path) -> dict[str, str]:
    """Write this rank's generator states into `folder` (a step{N}); {name under `folder`: crc32} of the file."""
    tensors = {"cpu": torch.get_rng_state()}
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


def restore(folder: Path) -> bool:
    """Set this rank's generators to the states `write` left in `folder`; False where there are none."""
    from safetensors.torch import load_file

    path = _path(folder)
    if not path.is_file():
        return False
    tensors = load_file(str(path))
    torch.set_rng_state(tensors["cpu"])
    if "device" in tensors:
        accelerator.set_rng_state(tensors["device"])
    return True
