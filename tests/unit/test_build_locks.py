"""A JIT build lock DeepSpeed would wait on forever (parallel/distributed/extensions.py), in a fake extensions
folder: a stale one is refused naming the lock, its age and the command that fixes it, and running that
command passes; one held by a live build (torch's own FileBaton) gets one note, from local rank 0 only; no lock
says nothing. train.py's refusal: tests/cli/test_build_lock_cli.py."""
import io
import os
import re
import subprocess
import sys
import threading
import time

import pytest
from torch.utils.file_baton import FileBaton

from parallel.distributed import extensions
from parallel.distributed.extensions import STALE_AFTER_S, check_build_locks, extensions_root, find_build_locks

HOUR = 3600.0


@pytest.fixture(autouse=True)
def quick_notes(monkeypatch):
    """A live lock is noted when still there NOTE_AFTER_S (3 s) after the look: 0.2 s here."""
    monkeypatch.setattr(extensions, "NOTE_AFTER_S", 0.2)


def half_built(root, op="deepspeed_shm_comm", age_s=None):
    """<root>/<op>/ as a killed build leaves it: build.ninja, an object, the lock (age_s old)."""
    folder = root / op
    folder.mkdir(parents=True)
    (folder / "build.ninja").write_text("ninja_required_version = 1.3\n")
    (folder / "shm.o").write_bytes(b"\x7fELF")
    lock = folder / "lock"
    lock.touch()
    if age_s is not None:
        then = time.time() - age_s
        os.utime(lock, (then, then))
    return lock


def check(root, local_rank=0):
    out = io.StringIO()
    return check_build_locks(local_rank, root, out), out.getvalue()


def test_a_stale_lock_is_refused_with_the_fix_and_the_fix_passes(tmp_path):
    lock = half_built(tmp_path, age_s=HOUR)
    problems, notes = check(tmp_path)
    assert notes == ""
    assert problems == [f"{lock}: a build lock left by a killed JIT build of deepspeed_shm_comm (60 min old, no "
                        f"process on this host holds it); DeepSpeed would wait on it forever. Remove the half-built "
                        f"folder, and the next start builds deepspeed_shm_comm again: rm -r {lock.parent}"]
    command = problems[0].rsplit(": ", 1)[1]
    subprocess.run(command, shell=True, check=True)          # as the user would, the command as printed
    assert check(tmp_path) == ([], "") and tmp_path.is_dir() and not lock.parent.exists()


def test_a_lock_no_process_holds_on_a_local_disk_is_stale_at_any_age(tmp_path):
    """The build killed a second ago: only this host's processes could hold it, and none does."""
    lock = half_built(tmp_path, age_s=0)
    [found] = find_build_locks(tmp_path)
    assert (found.path, found.holders, found.unseen, found.stale) == (lock, (), None, True)
    assert found.age_s < 60


def test_a_process_still_working_in_the_folder_is_named(tmp_path):
    """The builder was killed, the ninja it started goes on (seen: SIGKILL orphans ninja and its compilers)."""
    lock = half_built(tmp_path, age_s=HOUR)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=lock.parent)
    try:
        deadline = time.time() + 10
        while os.path.realpath(f"/proc/{worker.pid}/cwd") != str(lock.parent.resolve()) and time.time() < deadline:
            time.sleep(0.05)
        [problem], _ = check(tmp_path)
    finally:
        worker.kill()
        worker.wait()
    name = open(f"/proc/{os.getpid()}/comm").read().strip()       # the worker is this interpreter's binary
    assert f"(still running in it: pid {worker.pid} {name}; let them end or stop them first): rm -r {lock.parent}" \
        in problem


def test_a_lock_held_by_a_running_build_is_noted_once_per_host(tmp_path):
    (tmp_path / "cpu_adam").mkdir()
    baton = FileBaton(str(tmp_path / "cpu_adam" / "lock"))       # as torch's _jit_compile holds it while it builds
    assert baton.try_acquire()
    try:
        problems, note = check(tmp_path)
        assert problems == []
        assert re.fullmatch(rf"note: DeepSpeed's start waits for the JIT build of cpu_adam that holds "
                            rf"{re.escape(str(tmp_path / 'cpu_adam' / 'lock'))} \(pid {os.getpid()}, \d s so far\)\n",
                            note)
        assert check(tmp_path, local_rank=1) == ([], "")          # the other ranks of the host: silent
    finally:
        baton.release()
    assert check(tmp_path) == ([], "")


def test_a_lock_held_for_a_moment_is_no_wait_worth_a_line(tmp_path, monkeypatch):
    """Every CPU start takes the lock while torch's ninja finds the op built; a rank there first: released soon."""
    monkeypatch.setattr(extensions, "NOTE_AFTER_S", 30.0)
    (tmp_path / "deepspeed_shm_comm").mkdir()
    baton = FileBaton(str(tmp_path / "deepspeed_shm_comm" / "lock"))
    assert baton.try_acquire()
    threading.Timer(0.3, baton.release).start()
    start = time.monotonic()
    assert check(tmp_path) == ([], "") and time.monotonic() - start < 10


def test_a_holder_between_closing_and_removing_the_lock_is_no_stale_lock(tmp_path):
    """FileBaton.release closes the descriptor, then removes the file: a look in between sees a lock nobody
    holds, young; the second look (LOOK_AGAIN_S later) sees it gone."""
    (tmp_path / "deepspeed_shm_comm").mkdir()
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL))
    threading.Timer(extensions.LOOK_AGAIN_S / 4, lock.unlink).start()
    assert check(tmp_path) == ([], "")


def test_no_lock_is_silent(tmp_path):
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"\x7fELF")
    assert check(tmp_path) == ([], "")
    assert check(tmp_path / "absent") == ([], "")


@pytest.mark.parametrize("age_s, stale", [(STALE_AFTER_S - 60, False), (STALE_AFTER_S + 60, True)])
def test_on_a_shared_file_system_a_lock_held_by_no_process_here_waits_until_stale(tmp_path, monkeypatch, age_s, stale):
    """Another host may be building into an NFS folder: a note with the fix until the lock is STALE_AFTER_S old."""
    monkeypatch.setattr(extensions, "shared_fs", lambda folder: "nfs4")
    lock = half_built(tmp_path, age_s=age_s)
    problems, note = check(tmp_path)
    fix = f"rm -r {lock.parent}"
    if stale:
        assert note == "" and problems == [
            f"{lock}: a build lock left by a killed JIT build of deepspeed_shm_comm (11 min old, held by no process "
            f"in sight for longer than a build takes, 10 min; {lock.parent} is on nfs4: another host may be building "
            f"in it); DeepSpeed would wait on it forever. Remove the half-built folder, and the next start builds "
            f"deepspeed_shm_comm again: {fix}"]
    else:
        assert problems == [] and note == (
            f"note: DeepSpeed's start waits for {lock} (9 min old), held by no process in sight; {lock.parent} is on "
            f"nfs4: another host may be building in it. If none is building deepspeed_shm_comm, stop and run: {fix}\n")


def test_another_users_lock_waits_until_stale(tmp_path, monkeypatch):
    """A shared TORCH_EXTENSIONS_DIR: another user's build process is out of this (unprivileged) user's sight."""
    lock = half_built(tmp_path, age_s=60)
    monkeypatch.setattr(extensions.os, "getuid", lambda: lock.stat().st_uid + 1)
    problems, note = check(tmp_path)
    assert problems == [] and f"held by no process in sight; the lock is user {lock.stat().st_uid}'s, whose " \
        f"processes this user cannot look into. If none is building deepspeed_shm_comm, stop and run: rm -r " \
        f"{lock.parent}\n" in note
    then = time.time() - STALE_AFTER_S
    os.utime(lock, (then, then))
    [problem], note = check(tmp_path)
    assert note == "" and problem.startswith(f"{lock}: a build lock left by a killed JIT build of deepspeed_shm_comm "
                                             f"(10 min old, held by no process in sight for longer than a build takes")


def test_the_root_is_torchs(tmp_path, monkeypatch):
    """extensions_root() is the folder torch.utils.cpp_extension builds under, with and without
    TORCH_EXTENSIONS_DIR (its private _get_build_directory: this fails loudly if an upgrade moves it)."""
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert extensions_root() / "op" == type(extensions_root())(_get_build_directory("op", verbose=False))
    assert str(extensions_root()).startswith(str(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert extensions_root() / "op" == type(extensions_root())(_get_build_directory("op", verbose=False))


def test_the_folders_file_system_is_found(tmp_path):
    """/proc/self/mounts' entry for the longest mount point above the folder: local (None) or shared."""
    mounts = [line.split() for line in open("/proc/self/mounts")]
    path = os.path.realpath(tmp_path)
    mount, fstype = max(((m[1], m[2]) for m in mounts if (path + "/").startswith(m[1].rstrip("/") + "/")),
                        key=lambda m: len(m[0]))
    shared = fstype in extensions.NETWORK_FS or fstype.startswith("fuse")
    assert extensions.shared_fs(tmp_path) == (fstype if shared else None)
