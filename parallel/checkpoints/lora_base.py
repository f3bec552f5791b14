"""A LoRA run's checkpoints without its frozen base (ckpt.lora_base: release, the default with model.init_from).

A LoRA run trains the adapters; its base is the release it started from (model.init_from), frozen. Written into
every checkpoint, that base is most of it: Wan 2.1 14B's is 28 GB in bf16 in DeepSpeed's files and 56 GB in the
layout-free copy's fp32, beside adapters of a few hundred MB, per checkpoint and ckpt.keep times over. So by default
the base stays in the release: a checkpoint holds the trainable tensors (the adapters: their weights, fp32 masters,
Adam moments, EMA), and every command that reads one (a resume, parallel.export, parallel.sample,
parallel.verify) builds the base from the release first (model.init_from when set, else the path the run read
it from), as the run that wrote it did (the same skip_init,
load_released, fp8 quantisation and block swap: parallel/train/engine.py build_trainer), then loads the checkpoint
over it.

What ties a checkpoint to its release: the marker records `lora_base` = {"init_from": the path, "files": {name:
[bytes, crc32]}} of every file the base was read from (names under the release's folder; CRC-32 as
parallel/checkpoints/checksums.py takes it, the ranks a share each, once when the run starts). A reader finds the
files by name under its model.init_from, or at the recorded path when that is unset (the release may have moved: the
bytes decide), checks their sizes
before any process group (find_resume) and their checksums with the checkpoint's own (verified_resume), and refuses
a release that is missing or has other bytes, naming the file.

Which tensors are left out: every tensor the run does not train, which is every one model.init_from fills (its
frozen parameters; its buffers: the fp8 base's codes and scales, CogVideoX's stored tables): DeepSpeed's files
through `exclude_frozen_parameters` (its module weights and, under ZeRO-2/3, its frozen fragments) and the state-dict
hooks of `without_base`; the layout-free copy by parallel/checkpoints/relayout.py. On loading, `over_base` hands
DeepSpeed's strict load the tensors the file lacks as they already are, so a missing trainable tensor is still an
error. A checkpoint written with the base (ckpt.lora_base: copy, no model.init_from, or a toolkit before this) loads
its own as before.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from parallel.checkpoints import checksums

KEY = "lora_base"


def release_of(cfg, source: Optional[str]) -> Optional[str]:
    """The release this run's checkpoints leave the frozen base in: `source`, where the base was read from
    (model.init_from, or the release of the checkpoint resumed), for a LoRA run with ckpt.lora_base release; None
    where checkpoints hold the base."""
    return source if cfg.model.lora is not None and source and cfg.ckpt.lora_base == "release" else None


def _root(init_from) -> Path:
    """The folder the recorded names are under: the release's, or that of Open-Sora's one .safetensors file (by its
    name: a release that moved away is still a folder)."""
    path = Path(init_from)
    return path.parent if path.suffix == ".safetensors" and not path.is_dir() else path


def release_names(m, release) -> list[str]:
    """The files the base is read from, relative to the release's folder (Open-Sora's one file: its name)."""
    from parallel.weights.diffusers import is_single_file, released_files

    path = Path(release)
    if is_single_file(path):
        return [path.name]
    return sorted({str(p.relative_to(path)) for p in released_files(m, path).values()})


def fingerprint(m, release) -> dict:
    """The marker's record of the release a base was read from: its path and each file's [bytes, crc32], hashed by
    the ranks a share each (a collective: every rank calls it)."""
    root, names = _root(release), release_names(m, release)
    mine = checksums.hash_share(root, names, dist.get_rank(), dist.get_world_size())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    crcs = {k: v for part in everyone for k, v in part.items()}
    return {"init_from": str(release), "files": {n: [(root / n).stat().st_size, crcs[n]] for n in names}}


def record(folder: Path) -> Optional[dict]:
    """A checkpoint's lora_base record, or None where it holds its base (or has no marker)."""
    marker = Path(folder) / checksums.MARKER
    return json.loads(marker.read_text()).get(KEY) if marker.is_file() else None


def source(folder: Path, init_from) -> Optional[str]:
    """Where a checkpoint's base is read from: None where it holds it; else model.init_from (`init_from`) when set,
    the release the run read otherwise (its record's path)."""
    saved = record(folder)
    return None if saved is None else str(init_from or saved["init_from"])


def problem(folder: Path, init_from, crc: bool = False, rank: int = 0, world: int = 1) -> Optional[str]:
    """Why checkpoint `folder`, which holds no base, cannot be read over its release (`source`): a recorded file
    missing there or of another size, or (with `crc`, this rank's share) other bytes; None when it can (or when the
    checkpoint holds its base)."""
    saved = record(folder)
    if saved is None:
        return None
    root = _root(source(folder, init_from))
    for name in sorted(saved["files"]):
        path, (size, _) = root / name, checksums.entry(saved["files"][name])
        if not path.is_file():
            return f"{path} does not exist"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, {size} when the run read it"
    changed = checksums.mismatch(root, saved["files"], rank, world, since="when the run read it: another release") \
        if crc else None
    return f"{root}/{changed}" if changed else None


def refusal(directory: Path, tag: str, why: str) -> tuple[str, str]:
    """(what is wrong, the way on) of a refused base, in find_resume's words."""
    saved = record(Path(directory) / tag)
    return (f"{directory}/{tag} holds a LoRA run's adapters and their optimizer states, not its frozen base "
            f"(ckpt.lora_base=release), which is the release {saved['init_from']} ({len(saved['files'])} files, their "
            f"sizes and CRC-32s in {tag}/complete.json), read from model.init_from when it is set: {why}",
            "Set model.init_from to that release (or leave it unset while the release is at that path)")


def verified_problem(folder: Path, init_from) -> Optional[str]:
    """`problem` with every recorded file's checksum, by all ranks together (a share each; a collective)."""
    mine = problem(folder, init_from, crc=True, rank=dist.get_rank(), world=dist.get_world_size())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return next((p for p in everyone if p), None)


def _base_names(owner: torch.nn.Module, parameters: bool = True) -> list[str]:
    """The tensors of `owner` itself (not its children's) that a checkpoint without the base leaves out: its frozen
    parameters (with `parameters`) and its persistent buffers."""
    frozen = [n for n, p in owner.named_parameters(recurse=False) if not p.requires_grad] if parameters else []
    buffers = [n for n, b in owner.named_buffers(recurse=False) if b is not None]
    if buffers:           # the persistent ones: those its own state dict holds
        kept = owner.state_dict(keep_vars=True)
        buffers = [n for n in buffers if n in kept]
    return frozen + buffers


def _owners(module: torch.nn.Module, parameters: bool = True) -> Iterator[tuple[torch.nn.Module, list[str]]]:
    for owner in module.modules():
        names = _base_names(owner, parameters)
        if names:
            yield owner, names


@contextlib.contextmanager
def without_base(module: torch.nn.Module, active: bool = True):
    """Inside: `module`'s state dicts leave out the base's buffers (hooks on each owning module, so the pipeline
    engine's per-layer files leave them out too); DeepSpeed's exclude_frozen_parameters, passed with it, leaves out
    the frozen parameters (its module states, the pipeline's layer files, ZeRO-2/3's frozen fragments)."""
    if not active:
        yield
        return

    def drop(names):
        def hook(owner, state, prefix, local_metadata):
            for n in names:
                state.pop(prefix + n, None)
        return hook
    handles = [owner.register_state_dict_post_hook(drop(names)) for owner, names in _owners(module, False)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def over_base(module: torch.nn.Module, active: bool = True):
    """Inside: a strict load of a state dict without the base keeps the base as it is (each left-out tensor handed
    to the load as its current value), and still refuses any other missing tensor."""
    if not active:
        yield
        return

    def keep(names):
        def hook(owner, state, prefix, *args):
            for n in names:
                if prefix + n not in state:
                    state[prefix + n] = getattr(owner, n)
        return hook
    handles = [owner.register_load_state_dict_pre_hook(keep(names)) for owner, names in _owners(module)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
