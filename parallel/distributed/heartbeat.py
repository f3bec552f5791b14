"""Lost ranks found in seconds, not at the collective timeout: a heartbeat through the rendezvous store.

A node that dies mid-run (power, kernel, network) leaves its peers blocked in a collective until
`train.collective_timeout_s` (600 s by default), and a killed process leaves them with a gloo/NCCL
"connection reset" that names no rank. Here every rank runs a daemon thread with its own client of the
store at MASTER_ADDR:MASTER_PORT (the one every launcher's ranks meet at: rank 0's TCPStore, or
torchrun's agent store) and every `interval_s`:

    set  beat/<rank> = n          (n counts up; the string "done" once the rank has finished)
    rank 0 only: multi_get beat/0..beat/<world-1>; a rank whose value has not changed for `lost_after_s`
                 (on rank 0's own clock: no clock sync needed) is lost, and with it
                 every rank silent for half that (its node's)  -> set  lost = "2,3"
    get  lost, if it exists       -> on_lost([2, 3])

so each surviving rank learns the verdict within lost_after_s + 2 x interval_s of the last beat. A rank whose
collective failed on a broken connection (a killed process, not a silent machine) sets `suspect`, and rank 0
then needs only 5 intervals of silence. A store
that cannot be reached for lost_after_s means rank 0's side is gone: on_lost([0]). Store traffic: one
set and one check per rank per interval, one multi_get of world_size keys on rank 0.

`on_lost(ranks)` runs on the watchdog thread and is expected to end the process (the main thread may be
blocked in a collective that would never return); `await_verdict` lets a main thread that caught a
communication error wait for the verdict instead of dying with a traceback that names nobody.
"""
from __future__ import annotations

import contextlib
import datetime
import socket
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

PREFIX = "vdp/heartbeat/"
STORE_ERRORS = (RuntimeError, OSError)     # torch's DistStoreError/DistNetworkError are RuntimeErrors


def lost_ranks(last_seen: dict[int, float], done: set[int], now: float, lost_after_s: float) -> list[int]:
    """Rank 0's rule (pure, unit-tested): once some rank has been silent for longer than lost_after_s, every
    rank silent for more than half that is lost with it. A node's ranks die together but their last
    beats are up to one interval apart; a live rank's beat is never more than an interval or two old."""
    silent = {r: now - t for r, t in last_seen.items() if r not in done}
    if not any(s > lost_after_s for s in silent.values()):
        return []
    return sorted(r for r, s in silent.items() if s > lost_after_s / 2)


def threshold(lost_after_s: float, interval_s: float, suspected: bool) -> float:
    """Silence that makes a rank lost: lost_after_s, or 5 intervals once a rank has reported a broken
    connection (a killed process: its peers know at once, only the names are missing)."""
    return min(lost_after_s, 5 * interval_s) if suspected else lost_after_s


class Heartbeat:
    def __init__(self, rank: int, world_size: int, host: str, port: int, on_lost: Callable[[list[int]], None],
                 interval_s: float = 1.0, lost_after_s: float = 30.0):
        self.rank, self.world_size, self.on_lost = rank, world_size, on_lost
        self.interval_s, self.lost_after_s = interval_s, lost_after_s
        self.store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=max(1.0, lost_after_s / 2)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self.store.set(f"{PREFIX}host/{rank}", socket.gethostname())

    def hosts(self, ranks: list[int]) -> list[str]:
        """The host names the given ranks reported at start ("?" where the store cannot say)."""
        try:
            return [self.store.get(f"{PREFIX}host/{r}").decode() for r in ranks]
        except STORE_ERRORS:
            return ["?"] * len(ranks)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """This rank finished: rank 0 stops counting it (its silence from now on is not a loss)."""
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s)
        with contextlib.suppress(*STORE_ERRORS):    # the store's host finished first; nobody watches any more
            self.store.set(f"{PREFIX}beat/{self.rank}", "done")

    def await_verdict(self, timeout_s: float | None = None) -> None:
        """Sleep while the watchdog reaches its verdict (on_lost then ends the process from the watchdog
        thread), at most timeout_s. The default leaves room for rank 0 to hear the silence late: its first
        read after a stall counts as a beat seen now. The main thread must not go on to tear down
        meanwhile: a blocked teardown collective could starve the watchdog of the interpreter lock."""
        with contextlib.suppress(*STORE_ERRORS):
            self.store.set(f"{PREFIX}suspect", str(self.rank))     # rank 0 then waits 5 intervals, not lost_after_s
        deadline = time.monotonic() + (2 * self.lost_after_s + 5 * self.interval_s if timeout_s is None else timeout_s)
        while time.monotonic() < deadline:       # in slices: a signal (the launcher's SIGTERM) ends a sleep
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _run(self) -> None:
        keys = [f"{PREFIX}beat/{r}" for r in range(self.world_size)]
        start = time.monotonic()
        last_value: dict[int, bytes] = {}
        last_seen = {r: start for r in range(self.world_size)}
        reached = start
        n = 0
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                n += 1
                self.store.set(keys[self.rank], str(n))
                lost: list[int] = []
                if self.rank == 0:
                    values = self.store.multi_get(keys) if self._all_exist(keys) else \
                        [self.store.get(k) if self.store.check([k]) else b"" for k in keys]
                    for r, v in enumerate(values):
                        if v != last_value.get(r):
                            last_value[r], last_seen[r] = v, now
                    done = {r for r, v in last_value.items() if v == b"done"}
                    suspected = self.store.check([f"{PREFIX}suspect"])
                    lost = lost_ranks(last_seen, done, now, threshold(self.lost_after_s, self.interval_s, suspected))
                    if lost:       # then give the others time to read it: rank 0 may host the store
                        self.store.set(f"{PREFIX}lost", ",".join(map(str, lost)))
                        time.sleep(3 * self.interval_s)
                if not lost and self.store.check([f"{PREFIX}lost"]):
                    lost = [int(r) for r in self.store.get(f"{PREFIX}lost").decode().split(",")]
                reached = now
            except STORE_ERRORS:      # the store (rank 0's process, or node 0's launcher) is unreachable
                if now - reached <= self.lost_after_s:
                    continue
                lost = [0]
            if lost:
                self.on_lost(lost)
                return

    def _all_exist(self, keys: list[str]) -> bool:
        return self.store.check(keys)
