"""JIT-built C++ extensions: a build lock a start would wait on forever, found before anything waits.

DeepSpeed builds its ops through torch.utils.cpp_extension into <root>/<op>/ (the CPU accelerator's
shared-memory all-reduce, `deepspeed_shm_comm`, in every `init_distributed`; CPU Adam, fused Adam, ...),
root = $TORCH_EXTENSIONS_DIR (scripts/env.sh sets it) or torch's default, ~/.cache/torch_extensions/
py<ver>_<cpu|cuXYZ>. The builder holds <root>/<op>/lock (torch's FileBaton: created with O_EXCL, its
descriptor open until the build ends, then removed), and every other process loading the op polls until
the file is gone: silently, and forever if it never goes. A builder ended by SIGKILL or SIGTERM (the OOM
killer, a preempted job, a launcher stopping its ranks; Ctrl-C runs torch's `finally`, which removes it)
leaves the lock behind.

    the lock open in a process on this host        -> a build runs: the start waits for it, with one note if it
                                                      is still there NOTE_AFTER_S later
    open in none, the folder on a local disk       -> stale: only this host's processes can hold it
    open in none, but a holder may be out of sight -> the note (with the fix, in case none is building)
    (a network file system, NFS, Lustre, ...:         until the lock is STALE_AFTER_S old; stale after that
    another host; a lock of another user, whose
    processes this one cannot look into)

A stale lock is refused naming the lock, its age and the fix, `rm -r <root>/<op>`: the whole folder, so the
next start builds the op from nothing, whatever the killed build left. What it leaves (seen with torch 2.13,
a builder SIGKILLed while it compiled): build.ninja, and a ninja the kill orphaned that goes on compiling in
the folder, writes the object and dies before the link, recording nothing in .ninja_log; with only the lock
removed, the next start runs ninja again, which compiles that object again (no log entry) and links: no
quicker than a fresh build, and it leans on ninja's bookkeeping of a killed run. Processes still working in
the folder (ninja, the compilers: their working directory is it) are named in the refusal.
Every rank may look (it only reads); the notes come from local rank 0, once per host.
"""
from __future__ import annotations

import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TextIO

STALE_AFTER_S = 600.0        # a lock on a shared file system held by no process here: longer than a build takes
NOTE_AFTER_S = 3.0           # a live lock still there this long after the look is a wait: noted
YOUNG_S, LOOK_AGAIN_S = 5.0, 0.5
# File systems other hosts may mount too: a build there holds a lock no process of this host has open.
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "afs", "9p",
              "panfs", "wekafs", "virtiofs")


def extensions_root() -> Path:
    """The folder torch builds extensions under: torch.utils.cpp_extension._get_build_directory's, without
    creating it (tests/unit/test_build_locks.py holds the two equal)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        device = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        device = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        device = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{device}"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


@dataclass(frozen=True)
class BuildLock:
    """One <root>/<op>/lock and what holds it."""

    path: Path
    age_s: float                  # since it was created (its mtime: FileBaton never writes to it)
    holders: tuple[int, ...]      # pids on this host with the lock open: the build's own process
    workers: tuple[str, ...]      # "pid <pid> <name>" of processes working in the folder (ninja, c++, cc1plus)
    unseen: Optional[str]         # why a holder may be out of this process's sight, None if it cannot be

    @property
    def op(self) -> str:
        return self.path.parent.name

    @property
    def stale(self) -> bool:
        return not self.holders and (self.unseen is None or self.age_s >= STALE_AFTER_S)

    def fix(self) -> str:
        return f"rm -r {shlex.quote(str(self.path.parent))}"

    def problem(self) -> str:
        held = "no process on this host holds it" if self.unseen is None else (
            f"held by no process in sight for longer than a build takes, {_age(STALE_AFTER_S)}; {self.unseen}")
        first = (f" (still running in it: {', '.join(self.workers)}; let them end or stop them first)"
                 if self.workers else "")
        return (f"{self.path}: a build lock left by a killed JIT build of {self.op} ({_age(self.age_s)} old, {held}); "
                f"DeepSpeed would wait on it forever. Remove the half-built folder, and the next start builds "
                f"{self.op} again{first}: {self.fix()}")

    def note(self) -> str:
        if self.holders:
            pids = ", ".join(map(str, self.holders))
            return (f"note: DeepSpeed's start waits for the JIT build of {self.op} that holds {self.path} "
                    f"(pid {pids}, {_age(self.age_s)} so far)")
        return (f"note: DeepSpeed's start waits for {self.path} ({_age(self.age_s)} old), held by no process in "
                f"sight; {self.unseen}. If none is building {self.op}, stop and run: {self.fix()}")


def _readlink(path: str) -> Optional[str]:
    try:
        return os.readlink(path)
    except OSError:               # gone, or another user's process
        return None


def _users(lock: Path) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Processes of this host (those /proc lets us read) with `lock` open, and those whose working directory
    is its folder (ninja runs there, and the compilers it starts)."""
    target, folder = os.path.realpath(lock), os.path.realpath(lock.parent)
    holders, workers = [], []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        if any(_readlink(f"/proc/{pid}/fd/{fd}") == target for fd in fds):
            holders.append(int(pid))
        cwd = _readlink(f"/proc/{pid}/cwd")
        if cwd is not None and (cwd == folder or cwd.startswith(folder + os.sep)):
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            workers.append(f"pid {pid} {name}")
    return tuple(holders), tuple(workers)


def shared_fs(folder: Path) -> Optional[str]:
    """The file system type of `folder` if other hosts may mount it (NETWORK_FS, FUSE, or unknown), else None."""
    import psutil

    path, best = os.path.realpath(folder), None
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint.rstrip(os.sep) + os.sep
        if (path + os.sep).startswith(mount) and (best is None or len(mount) > len(best[0])):
            best = (mount, part.fstype)
    if best is None:
        return "an unknown file system"
    fstype = best[1]
    return fstype if fstype in NETWORK_FS or fstype.startswith("fuse") else None


def _unseen(lock: Path, stat: os.stat_result) -> Optional[str]:
    """Why a process holding `lock` may be out of sight here (BuildLock.unseen)."""
    if not os.path.isdir("/proc"):
        return "this system has no /proc to look into processes with"
    if os.getuid() not in (0, stat.st_uid):
        return f"the lock is user {stat.st_uid}'s, whose processes this user cannot look into"
    fstype = shared_fs(lock.parent)
    return None if fstype is None else f"{lock.parent} is on {fstype}: another host may be building in it"


def _look(lock: Path) -> Optional[BuildLock]:
    """The lock as it stands, None once it is gone; a lock replaced during the look (a build ended and
    another began) is looked at again, and one replaced at every look is taken for builds that run (None)."""
    for _ in range(3):
        try:
            before = lock.stat()
            holders, workers = _users(lock) if os.path.isdir("/proc") else ((), ())
            after = lock.stat()
        except FileNotFoundError:
            return None
        if (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns):
            return BuildLock(lock, max(0.0, time.time() - after.st_mtime), holders, workers, _unseen(lock, after))
    return None


def _gone(lock: Path, within_s: float) -> bool:
    """Whether `lock` is removed within `within_s` (polled as FileBaton.wait polls it)."""
    deadline = time.monotonic() + within_s
    while lock.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def find_build_locks(root: Optional[Path] = None) -> list[BuildLock]:
    """Every <root>/<op>/lock (root: extensions_root()). A young lock that looks stale is looked at again
    LOOK_AGAIN_S later: its holder may have been between closing it and removing it (FileBaton.release)."""
    root = extensions_root() if root is None else root
    found = []
    for path in sorted(root.glob("*/lock")):
        lock = _look(path)
        if lock is not None and lock.stale and lock.age_s < YOUNG_S:
            time.sleep(LOOK_AGAIN_S)
            lock = _look(path)
        if lock is not None:
            found.append(lock)
    return found


def check_build_locks(local_rank: int = 0, root: Optional[Path] = None, out: Optional[TextIO] = None) -> list[str]:
    """The stale locks' problems (on every rank); on local rank 0, one note on `out` (stderr) per live lock
    still there NOTE_AFTER_S later: on CPU every start takes the lock for a moment (torch runs ninja, which finds
    the op built), and a rank of this host that is there first is no wait worth a line."""
    locks = find_build_locks(root)
    if local_rank == 0:
        for lock in locks:
            if not lock.stale and not _gone(lock.path, NOTE_AFTER_S):
                print(lock.note(), file=out or sys.stderr, flush=True)
    return [lock.problem() for lock in locks if lock.stale]
