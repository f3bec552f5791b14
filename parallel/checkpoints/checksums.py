"""Checksums of a checkpoint's files: written at save, checked at load before any weight is used.

Each file of `step{N}/` gets a CRC-32 (zlib, read in 16 MiB blocks), recorded in the checkpoint's marker
(`complete.json`, "files": {name: [bytes, crc32]}) beside its size, so the one file that publishes the
checkpoint also lists what it must hold. CRC-32 finds every error burst of up to 32 bits (a flipped byte,
a flipped bit) and all but 2^-32 of the rest; it is not a defence against tampering. Measured here (2
cores): zlib.crc32 2.3 GiB/s, sha1 1.5, blake2b 0.9, md5 0.7.

At save the toolkit's files (DeepSpeed's, through its checkpoint engine, and the layout-free copy) are
hashed as they are written (CrcWriter, parallel/distributed/deepspeed/checkpoint.py: a helper thread
CRCs each large write while it is written); only files nobody hashed while writing are read back here.
The cost of each way at the debug, 1e8 and 1.3B sizes: docs/training.md, "Checksum cost"
(bench/ckpt_checksums.py).

Who reads what: the files are sorted by name and rank r of W hashes files r, r + W, r + 2W, ... (a shared
checkpoint filesystem, as the marker already assumes), so a save or a load reads the checkpoint once over
all ranks, not once per rank; the findings are gathered so that every rank takes the same decision.
"""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import Optional

BLOCK = 16 << 20
MARKER = "complete.json"           # a checkpoint folder's marker: its layout and every file's [bytes, crc32]


def file_crc32(path: Path, block: int = BLOCK) -> str:
    """CRC-32 of a file's bytes as 8 hex digits, streamed in `block`-byte reads."""
    crc, buf = 0, bytearray(max(1, min(block, Path(path).stat().st_size)))     # small files: no 16 MiB buffer
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def share(names: list[str], rank: int, world: int) -> list[str]:
    """The files rank `rank` of `world` hashes: every world-th of the sorted names, from its own rank."""
    return sorted(names)[rank::world]


def hash_share(folder: Path, names: list[str], rank: int = 0, world: int = 1) -> dict[str, str]:
    """{name: crc32} of this rank's share of `names` under `folder`."""
    return {n: file_crc32(Path(folder) / n) for n in share(names, rank, world)}


def entry(value) -> tuple[int, Optional[str]]:
    """(bytes, crc32 or None) of a marker's file entry: [bytes, crc32], or the bytes alone (markers written
    before checksums)."""
    return (int(value[0]), value[1]) if isinstance(value, list) else (int(value), None)


def mismatch(folder: Path, files: dict, rank: int = 0, world: int = 1,
             since: str = "was written: its bytes changed since the save") -> Optional[str]:
    """The first of this rank's share of the marker's `files` whose bytes no longer have the recorded
    checksum, said as the damage report puts it (`since`: what the recorded one was); None when all match (or none
    has a checksum)."""
    for name in share([n for n, v in files.items() if entry(v)[1] is not None], rank, world):
        want = entry(files[name])[1]
        try:
            got = file_crc32(Path(folder) / name)
        except OSError as e:
            return f"{name} cannot be read ({e.strerror})"
        if got != want:
            return f"{name} has crc32 {got}, {want} {since}"
    return None
