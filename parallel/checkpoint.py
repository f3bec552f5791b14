"""Training checkpoints: DeepSpeed's format, published atomically, found again after any interruption.

A checkpoint is the folder `<ckpt.dir>/step{N}` written by `engine.save_checkpoint` (model, optimizer
with the EMA, LR schedule, step). After every rank has written its files, rank 0 writes the marker
`step{N}/complete.json` and then replaces `<ckpt.dir>/latest` atomically (write a temporary file,
`os.replace`). A folder without the marker is an interrupted save: it is never loaded and never counts
towards the `ckpt.keep` newest that are kept.
"""
from __future__ import annotations

import json
import os
import re
import shutil
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
    """Write step{step} on every rank, then publish it (marker + `latest`) and prune, on rank 0."""
    directory = Path(directory)
    trainer.save(directory, step)
    dist.barrier()
    if dist.get_rank() == 0:
        (directory / f"step{step}" / MARKER).write_text(json.dumps({"step": step, "layout": layout}))
        tmp = directory / "latest.tmp"
        tmp.write_text(f"step{step}")
        os.replace(tmp, directory / "latest")
        for old in complete_steps(directory)[:-keep] if keep > 0 else []:
            shutil.rmtree(directory / f"step{old}", ignore_errors=True)
    dist.barrier()


def find_resume(directory: Path, layout: dict) -> Optional[str]:
    """Tag of the newest complete checkpoint, or None. A different layout is refused with the way out."""
    steps = complete_steps(Path(directory))
    if not steps:
        return None
    tag = f"step{steps[-1]}"
    saved = json.loads((Path(directory) / tag / MARKER).read_text())["layout"]
    if saved != layout:
        raise ValueError(
            f"{directory}/{tag} was written with layout {saved}, this run is {layout}. Resume with the saved "
            f"tp_size/pp_size, or convert it: python -m deepspeed.checkpoint.ds_to_universal --input_folder "
            f"{directory}/{tag} --output_folder {directory}/{tag}_universal, then load it with "
            f'"checkpoint": {{"load_universal": true}} in the DeepSpeed JSON')
    return tag
