"""Where the ranks of a launch.sh job meet: the master address for each launcher, the world size, and the
per-host plan `launch.sh --dry-run` prints. No loopback address reaches a job whose hosts are other machines.

    python -m parallel.distributed.master --launcher deepspeed --hostfile hosts [--master-addr A] [--describe]
    # stdout: "MASTER WORLD NPROC" ("-" for none: DeepSpeed resolves the master itself, the world is unknown)

The master, in order: `--master-addr`; else, with a hostfile, the first host as DeepSpeed resolves it
(`deepspeed` over ssh: left to DeepSpeed, which asks `ssh FIRST hostname -I`; Open MPI and `--node-rank`
runs: its address resolved here, this machine's first `hostname -I` address when it names this machine);
else Slurm's first node (its NodeAddr); else this host (127.0.0.1) for one-node launches. A hostfile whose
hosts all name this machine (localhost, 127.0.0.1) is one host: 127.0.0.1.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Optional

from parallel.distributed.hostfile import parse_hostfile

LOOPBACK = "127.0.0.1"


class LaunchError(ValueError):
    """A launch that cannot work as asked; the message says what would."""


@dataclass(frozen=True)
class Plan:
    master: str                      # "" when the launcher resolves it (deepspeed over ssh)
    world: Optional[int]             # None when only the launcher knows it
    nproc: Optional[int]
    lines: list[str] = field(default_factory=list)   # what each host uses, for --dry-run


def resolve(host: str) -> Optional[str]:
    """The host's first address as this machine resolves it, or None."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError):
        return None


def is_loopback(host: str) -> bool:
    addr = resolve(host)
    return addr is not None and ipaddress.ip_address(addr.split("%")[0]).is_loopback


def own_address() -> Optional[str]:
    """This machine's first non-loopback address, as DeepSpeed reads it from `hostname -I`."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def host_address(host: str, where: str) -> str:
    """The address other machines reach `host` at: resolved here; this machine's own when it names this one."""
    addr = resolve(host)
    if addr is None:
        raise LaunchError(f"{where}: host {host} does not resolve here; pass --master-addr with its address")
    if ipaddress.ip_address(addr.split("%")[0]).is_loopback:
        addr = own_address()
        if addr is None:
            raise LaunchError(f"{where}: host {host} is this machine ({host} resolves to {resolve(host)}) and "
                              "`hostname -I` lists no other address; pass --master-addr with its network address")
    return addr


def _ranges(hosts: dict[str, int], world: int) -> list[tuple[str, str]]:
    """(host, 'ranks a-b') filling each host's slots in file order, as DeepSpeed and Open MPI place ranks."""
    out, first = [], 0
    for host, slots in hosts.items():
        n = max(0, min(slots, world - first))
        out.append((host, f"ranks {first}-{first + n - 1}" if n > 1 else f"rank {first}" if n else "no ranks"))
        first += n
    return out


def _hostfile_master(hosts: dict[str, int], hostfile: str, given: str, resolved_by_launcher: bool) -> tuple[str, str]:
    """(address passed on, how it was chosen) for a hostfile launch."""
    one_machine = all(is_loopback(h) for h in hosts)
    first = next(iter(hosts))
    if given:
        if is_loopback(given) and not one_machine:
            other = next(h for h in hosts if not is_loopback(h))
            raise LaunchError(f"--master-addr {given} is a loopback address, but {hostfile} lists {other}, another "
                              f"machine, whose ranks would connect to themselves; pass {first}'s network address")
        return given, "--master-addr"
    if one_machine:
        return LOOPBACK, f"every host in {hostfile} is this machine"
    if resolved_by_launcher:
        return "", f"{first}'s first `hostname -I` address, which DeepSpeed asks over ssh at launch"
    return host_address(first, hostfile), f"the address of {first}, the first host of {hostfile}"


def _slurm_master(given: str) -> tuple[str, list[str]]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise LaunchError("--launcher slurm runs inside an allocation: SLURM_JOB_NODELIST is not set "
                          "(sbatch or salloc set it)")
    nodes = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                           timeout=60).stdout.split()
    if not nodes:
        raise LaunchError(f"`scontrol show hostnames {nodelist}` listed no nodes")
    if given:
        return given, nodes
    # The node's NodeAddr (slurm.conf; it defaults to the node name): node names need not resolve
    node = subprocess.run(["scontrol", "show", "node", "-o", nodes[0]], capture_output=True, text=True,
                          timeout=60).stdout
    addr = next((f.split("=", 1)[1] for f in node.split() if f.startswith("NodeAddr=")), nodes[0])
    return addr, nodes


def node_range(nnodes: int | str) -> tuple[int, int]:
    """--nnodes N -> (N, N); MIN:MAX (torchrun's elastic range) -> (MIN, MAX)."""
    parts = str(nnodes).split(":")
    if len(parts) > 2 or not all(p.isdigit() for p in parts) or not 1 <= int(parts[0]) <= int(parts[-1]):
        raise LaunchError(f"--nnodes {nnodes}: give a node count (2) or an elastic range MIN:MAX (1:2), "
                          "1 <= MIN <= MAX")
    return int(parts[0]), int(parts[-1])


def plan(launcher: str, hostfile: str = "", master_addr: str = "", master_port: int = 29500,
         nproc: Optional[int] = None, nnodes: int | str = 1, node_rank: Optional[int] = None) -> Plan:
    """The master, world size and per-host lines of one launch.sh invocation (launcher already picked). An
    elastic range (nnodes MIN:MAX, torchrun) plans its largest world; the rendezvous numbers the nodes."""
    port = f":{master_port}"
    low, nnodes = node_range(nnodes)
    if low != nnodes:
        if launcher != "torchrun":
            raise LaunchError(f"--nnodes {low}:{nnodes} (elastic) runs under torchrun's agent: --launcher torchrun")
        if not master_addr:
            raise LaunchError(f"--nnodes {low}:{nnodes}: pass --master-addr with the rendezvous host's address "
                              "(the same on every node; it must stay up: its agent hosts the rendezvous)")
        worlds = ", ".join(str(n * nproc) for n in range(low, nnodes + 1)) if nproc else "?"
        return Plan(master_addr, nproc * nnodes if nproc else None, nproc,
                    [f"elastic: {low} to {nnodes} nodes of {nproc or '?'} ranks (world {worlds}), c10d "
                     f"rendezvous at {master_addr}{port}, which numbers the nodes", "master: --master-addr"])
    if launcher in ("deepspeed", "openmpi") and hostfile:
        hosts = parse_hostfile(hostfile)
        if launcher == "openmpi":
            nproc = nproc or sum(hosts.values())
        world = nproc if launcher == "openmpi" else sum(hosts.values())
        master, why = _hostfile_master(hosts, hostfile, master_addr,
                                       resolved_by_launcher=launcher == "deepspeed" and node_rank is None)
        shown = (master or f"<{next(iter(hosts))}'s address>") + port
        lines = [f"{host}{' (this node)' if node_rank == i else ''}: {ranks}, master {shown}"
                 for i, (host, ranks) in enumerate(_ranges(hosts, world))]
        return Plan(master, world, nproc, [*lines, f"master: {why}"])
    if launcher == "slurm":
        master, nodes = _slurm_master(master_addr)
        ntasks = os.environ.get("SLURM_NTASKS", "")
        world = int(ntasks) if ntasks.isdigit() else None
        why = "--master-addr" if master_addr else f"NodeAddr of {nodes[0]}, the allocation's first node"
        return Plan(master, world, None, [f"{n}: master {master}{port}" for n in nodes] + [f"master: {why}"])
    if launcher in ("torchrun", "local", "openmpi"):
        if nnodes > 1 and not master_addr:
            raise LaunchError(f"--nnodes {nnodes}: pass --master-addr with node 0's address (the same on every "
                              "node; 127.0.0.1 only when every node is this machine)")
        master = master_addr or LOOPBACK
        world = nproc * nnodes if nproc else None
        node = f"node {node_rank or 0} of {nnodes}" if nnodes > 1 else "this host"
        first = (node_rank or 0) * (nproc or 0)
        ranks = f"ranks {first}-{first + nproc - 1}" if nproc else "ranks ?"
        why = "--master-addr" if master_addr else "one host: its loopback"
        return Plan(master, world, nproc, [f"{node}: {ranks}, master {master}{port}", f"master: {why}"])
    raise LaunchError(f"--launcher {launcher}: use auto, local, deepspeed, torchrun, slurm or openmpi")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parallel.distributed.master", description=__doc__.splitlines()[0])
    ap.add_argument("--launcher", required=True)
    ap.add_argument("--hostfile", default="")
    ap.add_argument("--master-addr", default="")
    ap.add_argument("--master-port", type=int, default=29500)
    ap.add_argument("--nproc", type=int, default=None)
    ap.add_argument("--nnodes", default="1")
    ap.add_argument("--node-rank", type=int, default=None)
    ap.add_argument("--describe", action="store_true", help="print what each host uses to stderr")
    a = ap.parse_args(argv)
    try:
        p = plan(a.launcher, a.hostfile, a.master_addr, a.master_port, a.nproc, a.nnodes, a.node_rank)
    except (OSError, ValueError) as e:     # parallel.experiment.cli.refused's heading (this layer cannot import it)
        lines = str(e).splitlines()
        print(f"launch.sh refused ({len(lines)} problem{'' if len(lines) == 1 else 's'}):", file=sys.stderr)
        print("\n".join(f"  - {line}" for line in lines), file=sys.stderr)
        return 1
    if a.describe:
        print("\n".join(f"launch.sh: {line}" for line in p.lines), file=sys.stderr)
    print(p.master or "-", p.world or "-", p.nproc or "-")
    return 0


if __name__ == "__main__":
    sys.exit(main())
