"""Spawn gloo ranks in-process, so distributed tests need no launcher (`run_ranks`, from bench/ranks.py: the
benchmarks spawn theirs the same way, and bench/ imports nothing from tests/; `spawn_all`: several rank functions
in one spawn); and pick the ports that tests starting real launchers must pass them.

`free_port()` is for the tests that start launchers (deepspeed, torchrun, mpirun, pdsh, sshd) and so
need a real port: see its docstring.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import tempfile

import torch.multiprocessing as mp

from bench.ranks import PRELOAD, run_ranks  # noqa: F401  (every tier imports it from here)

# The tests' ranks also import the oracles (diffusers' classes pull in peft, transformers and dynamo: seconds
# of CPU for each rank): once, in the server the ranks are forked from. Absent packages are skipped.
mp.set_forkserver_preload([*PRELOAD, "diffusers", "diffusers.models.transformers", "peft"])

@contextlib.contextmanager
def count_all_to_alls():
    """torch.distributed.all_to_all_single calls inside (DeepSpeed's Ulysses makes them): a list of their input
    numels (parallel.distributed.comm.count_comm counts the toolkit's own collectives)."""
    import torch.distributed as dist
    calls, original = [], dist.all_to_all_single

    def counted(output, input, *args, **kwargs):
        calls.append(input.numel())
        return original(output, input, *args, **kwargs)
    dist.all_to_all_single = counted
    try:
        yield calls
    finally:
        dist.all_to_all_single = original


def _calls(rank, world_size, calls):
    return [fn(rank, world_size, *args) for fn, args in calls]


def spawn_all(calls: dict, seconds_each: float = 150) -> dict:
    """Every call of `calls` (name -> (world size, rank function, its args after rank and world size)) in one
    run_ranks spawn per world size, whose ranks make the calls in turn: name -> the function's results in rank
    order. Starting ranks costs more than what a test does in them (4 ranks: about 20 s on 2 busy cores, for their
    torch and DeepSpeed imports), so a module makes its calls together, in a module-scoped fixture (pytest-xdist's
    --dist loadfile keeps a module on one worker). The functions must leave the default group as they found it."""
    by_world: dict[int, list] = {}
    for name, (world_size, fn, args) in calls.items():
        by_world.setdefault(world_size, []).append((name, fn, tuple(args)))
    out = {}
    for world_size, named in sorted(by_world.items()):
        results = run_ranks(_calls, world_size, [(fn, args) for _, fn, args in named],
                            timeout=150 + seconds_each * len(named))
        for i, (name, _, _) in enumerate(named):
            out[name] = [r[i] for r in results]
    return out


# Candidate launcher ports: below the kernel's ephemeral range, and below 29500 (torch's and DeepSpeed's
# default MASTER_PORT, which a launcher started without a port takes).
PORT_RANGE = (20000, 29500)
PORT_LOCK_DIR = os.path.join(tempfile.gettempdir(), "vdp-test-ports")
_held_locks: dict[int, int] = {}       # port -> lock file descriptor, held until this process exits
_next_port: list[int] = []


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999                 # Linux's default


def _candidates() -> list[int]:
    low, high = _ephemeral_range()
    ports = [p for p in range(*PORT_RANGE) if not low <= p <= high]
    return ports or [p for p in range(1024, 65536) if not low <= p <= high and p != 29500]


def _nobody_listens(port: int) -> bool:
    """Bind the port as a launcher will (any address; SO_REUSEADDR as torch's TCPStore and sshd set it, so
    connections of an earlier run in TIME_WAIT do not count), on IPv4 and, where present, IPv6."""
    families = [(socket.AF_INET, "0.0.0.0")] + ([(socket.AF_INET6, "::")] if socket.has_ipv6 else [])
    for family, host in families:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind((host, port))
        except OSError as e:
            if family == socket.AF_INET6 and e.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):   # no IPv6
                continue
            return False
    return True


def _lock(port: int) -> bool:
    """Take <tmp>/vdp-test-ports/<port>.lock with flock, without waiting; kept until this process exits
    (the kernel releases it then, also after a crash or kill -9)."""
    if not os.path.isdir(PORT_LOCK_DIR):
        os.makedirs(PORT_LOCK_DIR, exist_ok=True)
        try:
            os.chmod(PORT_LOCK_DIR, 0o1777)         # shared by every user's test runs, like /tmp
        except OSError:
            pass
    try:
        fd = os.open(os.path.join(PORT_LOCK_DIR, f"{port}.lock"), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _held_locks[port] = fd
    return True


def free_port() -> int:
    """A port for a launcher's rendezvous (`--master_port`, MASTER_PORT) or a test's sshd, that no other
    process on this machine will be given before the launcher binds it.

    Why not bind port 0 and release it (the old way): the kernel hands out ports from the ephemeral
    range (net.ipv4.ip_local_port_range, 32768-60999 by default) to every bind(0) and every outgoing
    connect() on the machine, e.g. the gloo connections of other tests' ranks, so the released port
    could be given away before the launcher bound it. Why not retry the launch on "address already in
    use": the launcher tests start several processes (nodes, launchers, sshd) whose failure surfaces
    in a child's log, sometimes after the other node already trained or hung until a timeout; telling a
    port clash from a real failure there, and re-running the test bodies, is not something a helper can
    do reliably. Instead the port is chosen so that the race cannot happen:

      * from PORT_RANGE, outside the ephemeral range: the kernel never hands these out on its own, only
        a program naming the port can take it;
      * reserved among test processes (every worktree's pytest on this machine) by a lock file per port,
        flock'ed until this process exits, so two test processes never get the same port, and one
        process never gets a port twice (no reuse while a previous run's sockets linger);
      * starting at an offset keyed by the pid, so concurrent test processes do not contend for the
        same locks; a port that some other program already listens on is skipped.

    What remains is a program outside this scheme binding a fixed port of PORT_RANGE in the moment
    between this check and the launcher's bind.
    """
    ports = _candidates()
    if not _next_port:
        _next_port.append((os.getpid() * 37) % len(ports))
    for _ in range(len(ports)):
        port = ports[_next_port[0] % len(ports)]
        _next_port[0] += 1
        if port not in _held_locks and _lock(port):
            if _nobody_listens(port):
                return port
            os.close(_held_locks.pop(port))
    raise RuntimeError(f"no free port in {PORT_RANGE} (locks in {PORT_LOCK_DIR})")
