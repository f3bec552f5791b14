"""Training checkpoints: DeepSpeed's format, published atomically, found again after any interruption.

A checkpoint is the folder `<ckpt.dir>/step{N}` written by `engine.save_checkpoint` (model, optimizer
with the EMA, LR schedule, step). After every rank has written its files, rank 0 writes the marker
`step{N}/complete.json` and then replaces `<ckpt.dir>/latest` atomically (write a temporary file,
`os.replace`). A folder without the marker is an interrupted save: it is never loaded and never counts
towards the `ckpt.keep` newest that are kept. The marker lists every file with its size; a checkpoint
whose files no longer match (truncated by a full disk, half-copied) is reported by name and the
previous complete one is used.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch.distributed as dist

MARKER = "complete.json"
_TAG = re.compile(r"^step(\d+)$")


def complete_steps(directory: Path) -> list[int]:
    """Steps of the complete checkpoints in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    steps = [int(m.group(1)) for p in directory.iterdir() if (m := _TAG.match(p.name)) and (p / MARKER).is_file()]
    return sorted(steps)


def save(trainer, directory: Path, step: int, keep: int, layout: dict) -> None:
    """Write step{step} on every rank, then publish it (marker + `latest`) and prune, on rank 0.

    Pruning keeps the newest `keep` undamaged checkpoints up to this step; damaged ones and ones from a
    later step (a run restarted before them) are left for the user to look at."""
    directory = Path(directory)
    folder = directory / f"step{step}"
    if dist.get_rank() == 0:            # writing over an earlier step{N}: it is incomplete until re-marked
        (folder / MARKER).unlink(missing_ok=True)
    dist.barrier()
    trainer.save(directory, step)
    dist.barrier()
    if dist.get_rank() == 0:
        files = {str(f.relative_to(folder)): f.stat().st_size for f in sorted(folder.rglob("*")) if f.is_file()}
        (folder / MARKER).write_text(json.dumps({"step": step, "layout": layout, "files": files}))
        tmp = directory / "latest.tmp"
        tmp.write_text(f"step{step}")
        os.replace(tmp, directory / "latest")
        good = [s for s in complete_steps(directory) if s <= step and damage(directory / f"step{s}") is None]
        for old in good[:-keep] if keep > 0 else []:
            shutil.rmtree(directory / f"step{old}", ignore_errors=True)
    dist.barrier()


def damage(folder: Path) -> Optional[str]:
    """What is wrong with a complete checkpoint's files, or None when they are as written."""
    for name, size in json.loads((folder / MARKER).read_text()).get("files", {}).items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written"
    return None


def find_resume(directory: Path, layout: dict) -> Optional[str]:
    """Tag of the newest complete, undamaged checkpoint, or None. A damaged one is reported (stderr, every
    rank) and skipped; a different layout is refused with the way out."""
    for step in reversed(complete_steps(Path(directory))):
        tag = f"step{step}"
        problem = damage(Path(directory) / tag)
        if problem is None:
            break
        print(f"checkpoint {directory}/{tag} is damaged ({problem}); trying the previous one", file=sys.stderr)
    else:
        return None
    saved = {"sp_size": 1, **json.loads((Path(directory) / tag / MARKER).read_text())["layout"]}
    if saved != layout:
        raise ValueError(
            f"{directory}/{tag} was written with layout {saved}, this run is {layout}. Resume with the saved "
            f"tp_size/pp_size, or convert it: python -m deepspeed.checkpoint.ds_to_universal --input_folder "
            f"{directory}/{tag} --output_folder {directory}/{tag}_universal, then load it with "
            f'"checkpoint": {{"load_universal": true}} in the DeepSpeed JSON')
    return tag
