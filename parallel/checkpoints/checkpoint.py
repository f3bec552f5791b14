"""Training checkpoints: DeepSpeed's format, published atomically, found again after any interruption.

A checkpoint is the folder `<ckpt.dir>/step{N}` written by `engine.save_checkpoint` (model, optimizer with the
EMA, LR schedule, step), plus `step{N}/layout_free/`, the layout-free copy every rank writes of its own slices
(parallel/checkpoints/relayout.py) that a run at another (tp, sp, pp, dp, ZeRO) layout resumes from; a run at the
saved layout loads DeepSpeed's files. After every rank has written its files, rank 0 writes the marker
`step{N}/complete.json` (the layout, the global batch and every file with its size) and then replaces
`<ckpt.dir>/latest` atomically (write a temporary file, `os.replace`). A folder without the marker is an
interrupted save: it is never loaded and never counts towards the `ckpt.keep` newest that are kept. The marker
records each file's size and CRC-32 (parallel/checkpoints/checksums.py): DeepSpeed's files and the layout-free copy
hashed as they are written (CrcWriter, parallel/distributed/deepspeed/checkpoint.py), any other file
(zero_to_fp32.py, which DeepSpeed copies in itself) read back once all have written, every rank a share. A
checkpoint whose files no longer match the marker (truncated by a full disk, half-copied: the sizes, checked by
every reader; a flipped byte: the checksums, checked by the training run's ranks together once process groups
exist, before any weight is loaded) is reported by name and the previous complete one is used. Old checkpoints
are pruned only once the newest is published, and only undamaged ones count, so the last good one is never
deleted; a save that fails half-way deletes none. A complete checkpoint is never written over: a save to an
existing complete step{N} (a run started again with --checkpoint none, or past a damaged step{N}) first moves it
aside to step{N}.damaged or step{N}.replaced, and says so. When none can be continued (all damaged, or the
newest written for another model: the marker records the model keys that fix the parameters), resuming is
refused rather than started from step 0, whose first save would overwrite them. A LoRA run from model.init_from leaves
its frozen base out and records the release's files instead (parallel/checkpoints/lora_base.py): find_resume and
verified_resume refuse a checkpoint whose release is missing or changed.

Disk space: before each save rank 0 compares the filesystem's free bytes with the newest complete
checkpoint's size, or before the first one with its predicted size (predicted_bytes, recorded in the marker
beside what was written), warning when a second one would not fit, stopping when this one cannot; a save that
fails anyway (a disk filled by someone else meanwhile) is
caught on every rank and its partial folder removed. Either way every rank raises `CheckpointError`
naming the folder, the bytes needed and free, and the checkpoint a rerun resumes from.
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

from parallel.checkpoints import checksums as _checksums
from parallel.checkpoints import lora_base
from parallel.experiment.units import format_size

MARKER = _checksums.MARKER
_TAG = re.compile(r"^step(\d+)$")


def complete_steps(directory: Path) -> list[int]:
    """Steps of the complete checkpoints in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    steps = [int(m.group(1)) for p in directory.iterdir() if (m := _TAG.match(p.name)) and (p / MARKER).is_file()]
    return sorted(steps)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message says why, with the figures and the way to resume."""


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` (0 when it does not exist)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


def predicted_bytes(params: int, trainable: int, precision: str, ema: bool, layout_free: bool = True,
                    buffer_bytes: int = 0, base: bool = True) -> int:
    """A checkpoint's bytes before any exists, for a model of `params` parameters (`trainable` of them
    trained; tensor-parallel copies of replicated ones counted as DeepSpeed writes them, once per slice) and
    `buffer_bytes` of buffers (the fp8 base's codes and scales, stored tables):

        DeepSpeed's module weights     params x (4 fp32, 2 bf16/fp16) + buffers
        its optimizer states           trainable x (8 Adam moments + 4 EMA + 4 fp32 master when mixed)
        the layout-free copy           trainable x (4 fp32 master + 8 moments + 4 EMA) + frozen x 4 + buffers

    `base` False (a LoRA run's checkpoints without the frozen base: parallel/checkpoints/lora_base.py): the frozen
    parameters and the buffers in neither. The small files (LR schedule, markers, generator states, pickling) left
    out: a few KiB."""
    mixed, e = precision != "fp32", 4 * ema
    frozen, buffers = (params - trainable, buffer_bytes) if base else (0, 0)
    return ((trainable + frozen) * (2 if mixed else 4) + buffers + trainable * (8 + e + 4 * mixed)
            + (trainable * (12 + e) + frozen * 4 + buffers) * layout_free)


def space_problem(directory: Path, step: int, free: int, failure: str = "",
                  predicted: int = 0) -> tuple[str | None, str | None]:
    """(error, warning) for saving step{step} into `directory` with `free` bytes free (plus what an
    existing step{step} folder, overwritten, gives back). The size needed is the newest complete
    checkpoint's, else `predicted` (predicted_bytes); without either only a `failure` (the save's own
    exception) makes an error."""
    steps = [s for s in complete_steps(directory) if s != step]
    last = f"{directory}/step{steps[-1]}" if steps else None
    needed = folder_bytes(directory / f"step{steps[-1]}") if steps else predicted
    if not (directory / f"step{step}" / MARKER).is_file():    # an interrupted save's folder is written over
        free += folder_bytes(directory / f"step{step}")
    if not failure and free >= 2 * needed:
        return None, None
    how = "" if steps else " (predicted: the first checkpoint)"
    figures = f"needs ~{format_size(needed)}{how}, {format_size(free)} free on that filesystem" if needed else \
        f"{format_size(free)} free on that filesystem"
    if not failure and free >= needed:
        return None, (f"warning: {format_size(free)} free under {directory}, room for one more checkpoint of "
                      f"~{format_size(needed)}; the save after step{step} will stop the run")
    resume = f"the last complete checkpoint is {last} (resume with the same command once there is space)" \
        if last else "there is no complete checkpoint yet (a rerun starts over)"
    verb = f"failed ({failure})" if failure else "stopped"
    return f"checkpoint save to {directory}/step{step} {verb}: {figures}; {resume}", None


def _check_space(directory: Path, step: int, predicted: int) -> None:
    """Rank 0 decides whether step{step} fits, every rank learns the verdict (so none waits in a collective)."""
    verdict = [None]
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        error, warning = space_problem(directory, step, shutil.disk_usage(directory).free, predicted=predicted)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        verdict = [error]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise CheckpointError(verdict[0])


def _write(trainer, directory: Path, step: int) -> dict:
    """trainer.save on every rank, and the checksums it took while writing ({} when none); a failure on any
    rank (a full disk: OSError, or DeepSpeed's RuntimeError from torch.save) is shared so that all ranks
    stop, and the partial folder is removed."""
    written = {}
    try:
        written = trainer.save(directory, step) or {}
        mine = None
    except (OSError, RuntimeError) as e:
        mine = f"{type(e).__name__}: {e}".strip()
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, mine)
    failed = next((f for f in failures if f), None)
    if failed is None:
        return written
    error = [None]
    if dist.get_rank() == 0:
        shutil.rmtree(directory / f"step{step}", ignore_errors=True)
        error = [space_problem(directory, step, shutil.disk_usage(directory).free, failed[:200])[0]]
    dist.broadcast_object_list(error, src=0)
    raise CheckpointError(error[0])


def _set_aside(folder: Path) -> Optional[str]:
    """Move a complete checkpoint folder out of a save's way (rank 0): step{N}.damaged when its files no
    longer match its marker, else step{N}.replaced (a numbered suffix when that exists); the line to print."""
    problem = damage(folder, checksums=True)
    base = folder.with_name(f"{folder.name}.{'damaged' if problem else 'replaced'}")
    target, n = base, 1
    while target.exists():
        n += 1
        target = base.with_name(f"{base.name}.{n}")
    os.replace(folder, target)
    why = f"damaged: {problem}" if problem else "complete, from an earlier run"
    return f"checkpoint {folder} ({why}) moved to {target}, not written over"


def _checksum_files(folder: Path, written: dict) -> dict:
    """{name: [bytes, crc32]} of every file under `folder`: the CRC-32s the ranks took while writing
    (`written`, this rank's), and the rest read back, each rank hashing its share (checksums.share); the
    whole table on every rank."""
    names, world = [None], dist.get_world_size()
    if dist.get_rank() == 0:
        names = [[str(f.relative_to(folder)) for f in sorted(folder.rglob("*")) if f.is_file()]]
    dist.broadcast_object_list(names, src=0)
    known = [None] * world
    dist.all_gather_object(known, written)
    crcs = {k: v for part in known for k, v in part.items()}
    rest = [n for n in names[0] if n not in crcs]
    mine = _checksums.hash_share(folder, rest, dist.get_rank(), world)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    crcs.update({k: v for part in everyone for k, v in part.items()})
    return {n: [(folder / n).stat().st_size, crcs[n]] for n in names[0]}


def save(trainer, directory: Path, step: int, keep: int, layout: dict, model: Optional[dict] = None,
         extra: Optional[dict] = None, predicted: int = 0) -> None:
    """Check the space, write step{step} on every rank, checksum its files (every rank a share), then
    publish it (marker + `latest`) and prune, on rank 0. Raises CheckpointError on every rank when it cannot
    be written. `model`: model_signature's keys, recorded in the marker so that a run of another model
    refuses it (find_resume); `extra`: more records for the marker (the data order and schedule,
    resume_changes compares them).

    Pruning, once this step is published, keeps the newest `keep` undamaged checkpoints up to this step;
    damaged ones and ones from a later step (a run restarted before them) are left for the user to look at.
    `predicted`: the size the first save is checked against (predicted_bytes), recorded in the marker."""
    directory = Path(directory)
    folder = directory / f"step{step}"
    _check_space(directory, step, predicted)
    if dist.get_rank() == 0:
        if (folder / MARKER).is_file():      # complete, of an earlier run: kept, never written over
            print(_set_aside(folder), file=sys.stderr, flush=True)
    dist.barrier()
    written = _write(trainer, directory, step)
    dist.barrier()
    files = _checksum_files(folder, written)
    if dist.get_rank() == 0:
        marker = {"step": step, "layout": layout, **({"model": model} if model is not None else {}),
                  **(extra or {}), **({"predicted_bytes": predicted} if predicted else {}), "files": files}
        (folder / MARKER).write_text(json.dumps(marker))
        tmp = directory / "latest.tmp"
        tmp.write_text(f"step{step}")
        os.replace(tmp, directory / "latest")
        good = [s for s in complete_steps(directory) if s <= step and damage(directory / f"step{s}") is None]
        for old in good[:-keep] if keep > 0 else []:
            shutil.rmtree(directory / f"step{old}", ignore_errors=True)
    dist.barrier()


def damage(folder: Path, checksums: bool = False) -> Optional[str]:
    """What is wrong with a complete checkpoint's files, or None when they are as written: a missing file
    or another size, and with `checksums` (every file read) other bytes."""
    try:
        files = json.loads((folder / MARKER).read_text()).get("files", {})
    except (OSError, ValueError, AttributeError) as e:
        return f"{MARKER} cannot be read ({type(e).__name__}: {e})"
    for name, value in files.items():
        path, size = folder / name, _checksums.entry(value)[0]
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written"
    return _checksums.mismatch(folder, files) if checksums else None


def verified_resume(directory: Path, layout: dict, model: Optional[dict] = None, step: Optional[int] = None,
                    quiet: bool = False, release: Optional[str] | bool = None, check_release: bool = True
                    ) -> Optional[str]:
    """find_resume with every file's checksum checked, by all ranks together (a share each: process groups
    must exist): a checkpoint whose bytes changed is reported (rank 0) and the previous one tried, as for a
    wrong size; the same tag, or the same ValueError, on every rank. A checkpoint without its LoRA base also has
    the release's files checked (`check_release`: a rollback, whose base is in memory already, skips them)."""
    known: dict[str, str] = {}
    rank, world = dist.get_rank(), dist.get_world_size()
    while True:
        tag = find_resume(directory, layout, quiet=True, model=model, step=step, known=known, release=release)
        if tag is None:
            return None
        files = json.loads((Path(directory) / tag / MARKER).read_text()).get("files", {})
        found = [None] * world
        dist.all_gather_object(found, _checksums.mismatch(Path(directory) / tag, files, rank, world))
        problem = next((f for f in found if f), None)
        if problem is None:
            base = lora_base.verified_problem(Path(directory) / tag, release) \
                if check_release and release is not False else None
            if base:
                raise _unusable(Path(directory), [tag], *lora_base.refusal(directory, tag, base),
                                "global_batch" in layout)
            return tag
        known[tag] = problem
        if rank == 0 and not quiet:
            print(f"checkpoint {directory}/{tag} is damaged ({problem}); trying the previous one",
                  file=sys.stderr, flush=True)


LAYOUT_KEYS = ("tp_size", "sp_size", "pp_size", "dp_size", "zero_stage")


def saved_layout(folder: Path) -> Optional[dict]:
    """The layout a complete checkpoint folder was written with (its marker's), or None without a marker."""
    marker = Path(folder) / MARKER
    return {"sp_size": 1, **json.loads(marker.read_text())["layout"]} if marker.is_file() else None


def same_layout(saved: dict, layout: dict) -> bool:
    """Whether DeepSpeed's own files load as they are: the same sizes and ZeRO stage."""
    return all(saved.get(k, 1 if k == "sp_size" else None) == layout.get(k) for k in LAYOUT_KEYS)


def describe(layout: dict) -> str:
    return " ".join(f"{k[:-5]} {layout[k]}" for k in LAYOUT_KEYS[:4] if k in layout) + \
        f" ZeRO-{layout.get('zero_stage', '?')}"


def resume_accumulation(directory: Path, global_batch: int, per_accumulation: int,
                        dp_size: Optional[int] = None) -> Optional[tuple[int, int]]:
    """(train.grad_accum_steps, the saved global batch) that keep the newest complete checkpoint's global batch
    at a layout whose micro_batch_size x dp_size is `per_accumulation`, when it differs from this run's
    `global_batch` and accumulation can make it up (a rerun on fewer or more nodes), or when the checkpoint
    was written at another dp than `dp_size` (an elastic run back at its full size: this run's accumulation
    already keeps it, and the log says so, after the restart that raised it); else None, and find_resume
    decides (it refuses a global batch accumulation cannot reach)."""
    directory = Path(directory)
    for step in reversed(complete_steps(directory)):
        if damage(directory / f"step{step}") is None:
            layout = saved_layout(directory / f"step{step}") or {}
            saved = layout.get("global_batch")
            if saved is None or saved % per_accumulation:
                return None
            if saved == global_batch and (dp_size is None or layout.get("dp_size", dp_size) == dp_size):
                return None
            return saved // per_accumulation, saved
    return None


# The model config keys that fix the parameters and optimizer states a checkpoint holds.
MODEL_KEYS = ("family", "num_layers", "hidden_size", "num_heads", "head_dim", "ffn_hidden_size", "time_embed_dim",
              "in_channels", "patch_size", "patch_size_t", "text_embed_dim", "max_text_len", "pos_embed")


def model_signature(model) -> dict:
    """What a checkpoint records of the model config (a models.config.ModelConfig): MODEL_KEYS, the FFN
    width resolved, the first stage's inputs (channels with any image condition, and the shapes of extra inputs
    such as Wan I2V's CLIP states), and the LoRA adapters' rank and targets (None without LoRA)."""
    lora = model.lora
    return {**{k: getattr(model, k) for k in MODEL_KEYS}, "ffn_hidden_size": model.ffn_size,
            "transformer_in_channels": model.transformer_in_channels,
            "extra_input_shapes": [list(s) for s in model.extra_input_shapes()],
            "lora": None if lora is None else {"rank": lora.rank, "targets": list(lora.targets)}}


def _model_problem(folder: Path, model: Optional[dict]) -> Optional[str]:
    """The model keys where a checkpoint (its marker's record; none before markers had one) and this run differ."""
    saved = json.loads((folder / MARKER).read_text()).get("model")
    if model is None or saved is None:
        return None
    # A key a marker does not record (written before the key was added) is not compared.
    differ = [f"model.{k}={json.dumps(saved[k])} there, {json.dumps(v)} here" for k, v in model.items()
              if k in saved and saved[k] != v]
    return "; ".join(differ) or None


def _unusable(directory: Path, tags: list[str], what: str, fix: str, training: bool) -> ValueError:
    """A refusal of a ckpt.dir whose checkpoints this run cannot continue. A training run that started from
    step 0 instead would overwrite them with its first saves; the ways on say so."""
    if not training:        # export, sampling: nothing is written over
        return ValueError(f"{directory} (ckpt.dir) has no usable checkpoint: {what}. {fix}")
    return ValueError(f"{directory} (ckpt.dir) has no checkpoint this run can continue: {what}. Starting from step 0 "
                      f"would overwrite {'it' if len(tags) == 1 else 'them'}, so nothing was started. {fix}, or set "
                      f"a fresh ckpt.dir (--set ckpt.dir=<empty folder>) to train from step 0 beside it, or move "
                      f"{' '.join(f'{directory}/{t}' for t in tags)} out of {directory} to train from step 0 there")


def find_resume(directory: Path, layout: dict, quiet: bool = False, model: Optional[dict] = None,
                step: Optional[int] = None, known: Optional[dict] = None, release: Optional[str] | bool = None
                ) -> Optional[str]:
    """Tag of the newest complete, undamaged checkpoint, or None. A damaged one is reported (stderr, every
    rank) and skipped. One written at another layout is resumed through its layout-free copy
    (parallel/checkpoints/relayout.py); one without that copy (written before it existed, or fp16 ZeRO-0) is
    refused with the layout to resume it at. With `layout["global_batch"]` (a training run), a checkpoint
    written at another global batch is refused: the step would no longer name the same samples.
    When every complete checkpoint is damaged, or (with `model`, model_signature's) the newest undamaged one
    was written for another model, it is refused (ValueError) rather than trained over from step 0.
    quiet: no damage report (parallel/check.py looks before train.py's run, which reports it).
    step: that checkpoint and no other (--checkpoint N); known: {tag: problem} of damage found
    otherwise (verified_resume's checksums). release: where the base of a checkpoint holding a LoRA run's adapters
    without it is read from (model.init_from; None: the release the run read; False: not read, an export of the
    adapters alone): refused when a file the base was read from is missing there or of another size
    (parallel/checkpoints/lora_base.py; verified_resume checks the bytes)."""
    directory, training, known = Path(directory), "global_batch" in layout, known or {}
    steps = complete_steps(directory)
    if step is not None:
        if step not in steps:
            have = ", ".join(f"step{s}" for s in steps) or "none"
            raise ValueError(f"--checkpoint {step}: {directory}/step{step} is not a complete checkpoint (ckpt.dir "
                             f"{directory} holds {have}); name one of those, or --checkpoint latest for the newest "
                             f"usable")
        steps = [step]
    damaged = []
    for s in reversed(steps):
        tag = f"step{s}"
        problem = known.get(tag) or damage(directory / tag)
        if problem is None:
            break
        damaged.append(f"{directory}/{tag} is damaged ({problem})")
        if not quiet and tag not in known:
            print(f"checkpoint {damaged[-1]}; trying the previous one", file=sys.stderr)
    else:
        if damaged:
            raise _unusable(directory, [f"step{s}" for s in reversed(steps)], "; ".join(damaged),
                            "Put the files back whole (a copy cut short: copy it again)", training)
        return None
    other = _model_problem(directory / tag, model)
    if other:
        raise _unusable(directory, [tag], f"{directory}/{tag} was written for another model ({other})",
                        f"Set those keys back to {'resume' if training else 'read'} it", training)
    base = lora_base.problem(directory / tag, release) if release is not False else None
    if base:
        raise _unusable(directory, [tag], *lora_base.refusal(directory, tag, base), training)
    saved = saved_layout(directory / tag)
    if not same_layout(saved, layout) and not (directory / tag / "layout_free" / "state.json").is_file():
        raise ValueError(
            f"{directory}/{tag} was written at {describe(saved)} without a layout-free copy (a toolkit older "
            f"than resuming on any layout, or fp16 with ZeRO-0); this run is {describe(layout)}. Resume it at "
            f"{describe(saved)} (parallel.tp_size/sp_size/pp_size, the world size, zero_optimization.stage); "
            f"its next checkpoint then resumes anywhere")
    if "global_batch" in saved and "global_batch" in layout and saved["global_batch"] != layout["global_batch"]:
        raise ValueError(
            f"{directory}/{tag} was trained with global batch {saved['global_batch']}, this run's is "
            f"{layout['global_batch']} (train.micro_batch_size x train.grad_accum_steps x dp_size): keep "
            f"{saved['global_batch']} to resume it (for example raise train.grad_accum_steps as dp_size falls), "
            f"so that step N names the same samples and the same point of the learning-rate schedule")
    return tag
