"""Lost ranks found in seconds, stuck ones at the collective timeout by name: a heartbeat through the rendezvous store.

A node that dies mid-run (power, kernel, network) leaves its peers blocked in a collective until
`train.collective_timeout_s` (600 s by default), and a killed process leaves them with a gloo/NCCL
"connection reset" that names no rank. Here every rank runs a daemon thread with its own client of the
store at MASTER_ADDR:MASTER_PORT (the one every launcher's ranks meet at: rank 0's TCPStore, or
torchrun's agent store) and every `interval_s`:

    set  beat/<rank> = n:s:p:w    (n counts up; the string "done" once the rank has finished; s:p where
                                   the main thread is: step s, phase PHASES[p]; w the collective
                                   that timed out, as "all_reduce from deepspeed/runtime/engine.py
                                   allreduce_bucket", else 0)
    rank 0 only: multi_get beat/0..beat/<world-1>; a rank whose value has not changed for `lost_after_s`
                 (on rank 0's own clock: no clock sync needed) is lost, and with it
                 every rank silent for half that (its node's)  -> set  lost = "2,3"
                 a live rank in the same (s, p) for longer than `stuck_after_s` while another is at a later
                 one or waits on a timed-out collective (stuck_ranks) -> set  lost = "hang 1 <where>"
    get  lost, if it exists       -> on_lost([2, 3])  (or on_hang(ranks, text))

so each surviving rank learns the verdict within lost_after_s + 2 x interval_s of the last beat. A rank whose
collective failed on a broken connection (a killed process, not a silent machine) sets `suspect`, and rank 0
then needs only 5 intervals of silence. A store
that cannot be reached for lost_after_s means rank 0's side is gone: on_lost([0]). Store traffic: one
set and one check per rank per interval, one multi_get of world_size keys on rank 0 (the main thread's place
rides in the beat's value: a few bytes more, no key or round trip more).

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
from collections.abc import Callable, Collection

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


PHASES = ("forward/backward", "validation", "checkpoint save", "shutdown")     # in the order a step enters them


def stuck_ranks(where: dict[int, tuple[int, int]], since: dict[int, float], waiting: Collection[int], now: float,
                stuck_after_s: float) -> list[int]:
    """The hang rule (pure, unit-tested). where[r] = (step, phase index) of live rank r's main thread, entered at
    since[r] (rank 0's clock); waiting = ranks whose collective timed out. A rank is stuck when it has sat at its
    place for longer than stuck_after_s and, at the same time, another rank is at a later place or waits on a
    timed-out collective while it does not (a rank that never reached the collective its peers wait in)."""
    def moved_past(r: int) -> bool:
        return any(q != r and (where[q] > where[r] or (q in waiting and r not in waiting)) for q in where)
    return sorted(r for r in where if now - since[r] > stuck_after_s and moved_past(r))


def describe_hang(where: dict[int, tuple[int, int]], stuck: list[int], waiting: dict[int, str]) -> str:
    """The verdict's words: the stuck ranks' step and phase, and where the others wait (waiting: rank -> the
    collective that timed out there, "" when unknown)."""
    def at(r: int) -> str:
        return f"step {where[r][0]} {PHASES[where[r][1]]}"
    others = sorted({at(q) + (f" ({waiting[q] or 'collective'} timed out)" if q in waiting else "")
                     for q in where if q not in stuck})
    return (f"stuck at {', '.join(sorted({at(r) for r in stuck}))}, while the others wait in "
            f"{'; '.join(others) or 'nothing'}")


def threshold(lost_after_s: float, interval_s: float, suspected: bool) -> float:
    """Silence that makes a rank lost: lost_after_s, or 5 intervals once a rank has reported a broken
    connection (a killed process: its peers know at once, only the names are missing)."""
    return min(lost_after_s, 5 * interval_s) if suspected else lost_after_s


class Heartbeat:
    def __init__(self, rank: int, world_size: int, host: str, port: int, on_lost: Callable[[list[int]], None],
                 interval_s: float = 1.0, lost_after_s: float = 30.0,
                 on_hang: Callable[[list[int], str], None] | None = None, stuck_after_s: float | None = None,
                 attempt: int = 0):
        self.prefix = f"{PREFIX}{attempt}/"     # torchrun's elastic restarts reuse the store: keys per attempt
        self.rank, self.world_size, self.on_lost, self.on_hang = rank, world_size, on_lost, on_hang
        self.interval_s, self.lost_after_s = interval_s, lost_after_s
        self.stuck_after_s = stuck_after_s if stuck_after_s is not None else 2 * lost_after_s
        self.place, self.timed_out = (-1, -1), ""     # set by the main thread, read by the beat
        self.store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=max(1.0, lost_after_s / 2)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self.store.set(f"{self.prefix}host/{rank}", socket.gethostname())

    def hosts(self, ranks: list[int]) -> list[str]:
        """The host names the given ranks reported at start ("?" where the store cannot say)."""
        try:
            return [self.store.get(f"{self.prefix}host/{r}").decode() for r in ranks]
        except STORE_ERRORS:
            return ["?"] * len(ranks)

    def at(self, step: int, phase: str) -> None:
        """The main thread enters `phase` (one of PHASES) of step `step`: published with the next beat."""
        self.place = (step, PHASES.index(phase))

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """This rank finished: rank 0 stops counting it (its silence from now on is not a loss)."""
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s)
        with contextlib.suppress(*STORE_ERRORS):    # the store's host finished first; nobody watches any more
            self.store.set(f"{self.prefix}beat/{self.rank}", "done")

    def await_verdict(self, timeout_s: float | None = None, collective: str = "") -> None:
        """Sleep while the watchdog reaches its verdict (on_lost then ends the process from the watchdog
        thread), at most timeout_s. The default leaves room for rank 0 to hear the silence late: its first
        read after a stall counts as a beat seen now. The main thread must not go on to tear down
        meanwhile: a blocked teardown collective could starve the watchdog of the interpreter lock.
        collective: the collective (its name and caller, watchdog.collective_in) whose timeout this rank waited
        out (a peer stuck, not gone): the beat says so, and rank 0 names the live rank that never joined
        (stuck_ranks) and the collective the others wait in."""
        self.timed_out = self.timed_out or collective.replace(":", ".")
        with contextlib.suppress(*STORE_ERRORS):
            self.store.set(f"{self.prefix}suspect", str(self.rank))     # rank 0 then waits 5 intervals, not lost_after_s
        deadline = time.monotonic() + (2 * self.lost_after_s + 5 * self.interval_s if timeout_s is None else timeout_s)
        while time.monotonic() < deadline:       # in slices: a signal (the launcher's SIGTERM) ends a sleep
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _run(self) -> None:
        keys = [f"{self.prefix}beat/{r}" for r in range(self.world_size)]
        start = time.monotonic()
        last_value: dict[int, bytes] = {}
        last_seen = {r: start for r in range(self.world_size)}
        reached = start
        place: dict[int, tuple[int, int]] = {}
        since: dict[int, float] = {}
        n = 0
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                n += 1
                self.store.set(keys[self.rank], f"{n}:{self.place[0]}:{self.place[1]}:{self.timed_out or 0}")
                lost: list[int] = []
                if self.rank == 0:
                    values = self.store.multi_get(keys) if self._all_exist(keys) else \
                        [self.store.get(k) if self.store.check([k]) else b"" for k in keys]
                    for r, v in enumerate(values):
                        if v != last_value.get(r):
                            last_value[r], last_seen[r] = v, now
                    done = {r for r, v in last_value.items() if v == b"done"}
                    suspected = self.store.check([f"{self.prefix}suspect"])
                    lost = lost_ranks(last_seen, done, now, threshold(self.lost_after_s, self.interval_s, suspected))
                    verdict = ",".join(map(str, lost)) if lost else \
                        self._hang_verdict(values, last_seen, place, since, now)
                    if verdict:       # then give the others time to read it: rank 0 may host the store
                        self.store.set(f"{self.prefix}lost", verdict)
                        time.sleep(3 * self.interval_s)
                if not lost and self.store.check([f"{self.prefix}lost"]):
                    verdict = self.store.get(f"{self.prefix}lost").decode()
                    if verdict.startswith("hang "):
                        ranks, text = verdict[5:].split(" ", 1)
                        if self.on_hang is not None:
                            self.on_hang([int(r) for r in ranks.split(",")], text)
                        return
                    lost = [int(r) for r in verdict.split(",")]
                reached = now
            except STORE_ERRORS:      # the store (rank 0's process, or node 0's launcher) is unreachable
                if now - reached <= self.lost_after_s:
                    continue
                lost = [0]
            if lost:
                self.on_lost(lost)
                return

    def _hang_verdict(self, values: list[bytes], last_seen: dict[int, float], place: dict, since: dict,
                      now: float) -> str:
        """Rank 0: "hang <ranks> <text>" when stuck_ranks finds live ranks stuck, else "". place/since carry
        each rank's last published place and when rank 0 first saw it there."""
        waiting: dict[int, str] = {}
        for r, v in enumerate(values):
            fields = v.decode(errors="replace").split(":")
            if len(fields) != 4 or now - last_seen[r] > 3 * self.interval_s or fields[1] == "-1":
                place.pop(r, None)       # finished, silent (the lost rule's) or not yet in the loop: not judged
                continue
            p = (int(fields[1]), int(fields[2]))
            if place.get(r) != p:
                place[r], since[r] = p, now
            if fields[3] != "0":
                waiting[r] = fields[3]
        stuck = stuck_ranks(place, since, waiting, now, self.stuck_after_s) if self.on_hang else []
        return f"hang {','.join(map(str, stuck))} {describe_hang(place, stuck, waiting)}" if stuck else ""

    def _all_exist(self, keys: list[str]) -> bool:
        return self.store.check(keys)
