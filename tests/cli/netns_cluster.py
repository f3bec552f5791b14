"""Test hosts with their own addresses: two "nodes" on this machine as Linux network namespaces joined by a veth
pair (10.231.0.1, 10.231.0.2; the addresses exist only inside the namespaces), each with its own sshd, sharing the
file system.

Each node is one process tree: `nsenter --net=/run/netns/NS unshare --uts --mount --pid --fork --mount-proc sh -c
SETUP`,
whose PID 1 sets the node's hostname, binds a hosts file over /etc/hosts and a tmpfs over /dev/shm (its mount
namespace) and execs sshd. Why each piece (DESIGN.md, "Test hosts as network namespaces"):
- gloo takes a rank's address from its hostname: each node needs its own name resolving to its own address,
  or the ranks connect to 127.0.0.1 (`Gloo connectFullMesh ... remote=[127.0.0.1]`);
- DeepSpeed calls plain `ssh HOST hostname` and `ssh HOST hostname -I`: the `ssh` on `Cluster.path` carries the
  test's key and options;
- DeepSpeed's pdsh runner stops with `pkill -f "python -u -m deepspeed.launcher.launch"` on every host: in its own
  PID namespace that reaches only the node's processes, not every DeepSpeed run on the machine;
- /dev/shm: DeepSpeed's CPU all-reduce names its buffers by port, the same on both nodes.
`Cluster.run(i, cmd)` starts a command on node i (nsenter into its namespaces). `cluster()` tears everything
down by PID and name (sshd, namespaces, the veth with them), also when the test failed. `unavailable()` says
why no cluster can be made here (not root, tools missing, no `ip netns`), for the fallback to loopback
(tests/cli/loopback_hosts.py) or a skip.

Several clusters may be up at once on one machine (two CI jobs, or a test beside a developer's): the
namespaces are named per cluster, vdp-<pid>-<k>-n<i> (this process's k-th cluster), and so is the veth pair,
although its ends only ever exist inside the cluster's namespaces (created there, never in the machine's
own namespace). The rest is private to a cluster: the addresses, hosts file, sshd on port 22 and /dev/shm live in
its namespaces (the same subnet in two clusters does not meet), keys and configs in its own directory.
A namespace whose process is gone (a killed session) is removed by the next cluster; a live one never.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

TOOLS = ("ip", "unshare", "nsenter", "ssh", "ssh-keygen", "/usr/sbin/sshd", "pdsh", "hostname")
SUBNET = "10.231.0"
_CLUSTERS = itertools.count()        # this process's clusters, for their names


@dataclass
class Node:
    name: str              # its hostname, e.g. vdp-node0
    addr: str
    netns: str
    init: int = 0          # PID (as this machine sees it) of the node's PID 1, sshd


@dataclass
class Cluster:
    dir: Path
    nodes: list[Node]
    path: str              # a PATH entry whose `ssh` reaches the nodes (also from inside them)
    procs: list[subprocess.Popen] = field(default_factory=list)
    own_addresses = True   # each node its own address and hostname (tests/cli/loopback_hosts.py: both this machine)

    @property
    def master(self) -> str:
        """What node 0 is reached at, for --master-addr: its hostname (each node's /etc/hosts resolves it)."""
        return self.nodes[0].name

    def hostfile(self, slots: int) -> Path:
        path = self.dir / f"hosts{slots}"
        path.write_text("".join(f"{n.name} slots={slots}\n" for n in self.nodes))
        return path

    def command(self, i: int, cmd: list[str], cwd: str) -> list[str]:
        """`cmd` inside node i's network, UTS, mount and PID namespaces."""
        return ["nsenter", "-t", str(self.nodes[i].init), "-n", "-u", "-m", "-p", f"--wd={cwd}", "--", *cmd]

    def run(self, i: int, cmd: list[str], cwd: str, env: dict, log, **kw) -> subprocess.Popen:
        with open(log, "w") as f:
            return subprocess.Popen(self.command(i, cmd, cwd), env=env, stdout=f, stderr=subprocess.STDOUT, **kw)


def unavailable() -> str | None:
    """Why no namespace cluster can be made here, or None."""
    if os.getuid() != 0:
        return "network namespaces need root"
    missing = [t for t in TOOLS if not shutil.which(t)]
    if missing:
        return f"missing {', '.join(missing)} (iproute2, util-linux, openssh-server, pdsh)"
    name = f"vdp-probe-{os.getpid()}"
    p = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        return f"`ip netns add` fails here: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return None


def _remove(netns: str) -> None:
    """Kill every process inside the namespace (by PID), then delete it; its veth end goes with it."""
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)


def _remove_stale() -> None:
    """Namespaces left by a test session that was killed (SIGKILL skips finalizers): vdp-<pid>-<k>-n<i> (or
    vdp-<pid>-n<i>, the older names) whose pid is gone."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        m = re.fullmatch(r"vdp-(\d+)(?:-\d+)?-n\d+", name)
        if m and not psutil.pid_exists(int(m.group(1))):
            _remove(name)


def _sh(*cmd: str) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip()}")


def _keys_and_configs(d: Path, port: int = 22) -> None:
    """Host and client keys in `d`, an ssh_config for every host at `port`, and `d/bin/ssh` that uses it (DeepSpeed's
    plain `ssh HOST hostname` does not see pdsh's options)."""
    (d / "bin").mkdir(parents=True)
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True, timeout=30)
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    (d / "ssh_config").write_text(textwrap.dedent(f"""\
        Host *
          Port {port}
          IdentityFile {d}/client_key
          IdentitiesOnly yes
          BatchMode yes
          StrictHostKeyChecking no
          UserKnownHostsFile /dev/null
          LogLevel ERROR
        """))
    (d / "bin" / "ssh").write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {d}/ssh_config "$@"\n')
    (d / "bin" / "ssh").chmod(0o755)


def _sshd_config(d: Path, node: Node) -> Path:
    path = d / f"sshd_{node.name}"
    path.write_text(textwrap.dedent(f"""\
        ListenAddress {node.addr}:22
        HostKey {d}/host_key
        AuthorizedKeysFile {d}/authorized_keys
        PidFile {d}/sshd_{node.name}.pid
        StrictModes no
        UsePAM no
        PasswordAuthentication no
        KbdInteractiveAuthentication no
        PermitRootLogin prohibit-password
        MaxStartups 100
        """))
    return path


def _wait_up(c: Cluster, timeout: float = 30) -> None:
    """Every node answers `ssh OTHER hostname` from inside the other with the other's name."""
    env = {**os.environ, "PATH": f"{c.path}:{os.environ['PATH']}"}
    deadline = time.monotonic() + timeout
    for i, node in enumerate(c.nodes):
        other = c.nodes[1 - i]
        while True:
            p = subprocess.run(c.command(i, ["ssh", other.name, "hostname"], "/"), env=env, capture_output=True,
                               text=True, timeout=30)
            if p.stdout.strip() == other.name:
                break
            dead = [n.name for n, proc in zip(c.nodes, c.procs) if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "".join((c.dir / f"{n.name}.log").read_text()[-1500:] for n in c.nodes)
                raise RuntimeError(f"namespace cluster did not come up ({dead} exited): {p.stderr}\n{logs}")
            time.sleep(0.2)


@contextlib.contextmanager
def cluster(d: Path, nodes: int = 2):
    """Two nodes (vdp-node0, vdp-node1) up and reachable over ssh; everything removed on exit."""
    _remove_stale()
    pid, k = os.getpid(), next(_CLUSTERS)
    c = Cluster(d, [Node(f"vdp-node{i}", f"{SUBNET}.{i + 1}", f"vdp-{pid}-{k}-n{i}") for i in range(nodes)],
                str(d / "bin"))
    veth = (f"vdp{pid}.{k}a", f"vdp{pid}.{k}b")    # at most 15 characters (pid <= 7 digits, k < 100)
    _keys_and_configs(d)
    hosts = d / "etc_hosts"
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.name}\n" for n in c.nodes))
    os.makedirs("/run/sshd", exist_ok=True)       # sshd's privilege separation directory
    made: list[str] = []
    try:
        for n in c.nodes:
            _sh("ip", "netns", "add", n.netns)
            made.append(n.netns)
            _sh("ip", "-n", n.netns, "link", "set", "lo", "up")
        _sh("ip", "link", "add", veth[0], "netns", c.nodes[0].netns, "type", "veth",
            "peer", "name", veth[1], "netns", c.nodes[1].netns)
        for n, v in zip(c.nodes, veth):
            _sh("ip", "-n", n.netns, "addr", "add", f"{n.addr}/24", "dev", v)
            _sh("ip", "-n", n.netns, "link", "set", v, "up")
        for n in c.nodes:
            setup = (f"hostname {n.name} && mount --bind {hosts} /etc/hosts && mount -t tmpfs -o size=1g tmpfs "
                     f"/dev/shm && exec /usr/sbin/sshd -D -e -f {_sshd_config(d, n)}")
            # nsenter rather than `ip netns exec`, which remounts /sys and so hides the cgroup mounts slurmd needs
            proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{n.netns}", "unshare", "--uts", "--mount", "--pid",
                                     "--fork", "--mount-proc", "sh", "-c", setup],
                                    stdout=open(d / f"{n.name}.log", "w"), stderr=subprocess.STDOUT)
            c.procs.append(proc)
            deadline = time.monotonic() + 30
            while not (kids := psutil.Process(proc.pid).children()):      # unshare's forked child: PID 1
                assert proc.poll() is None and time.monotonic() < deadline, (d / f"{n.name}.log").read_text()
                time.sleep(0.05)
            n.init = kids[0].pid
        _wait_up(c)
        yield c
    finally:
        for n in c.nodes:          # PID 1 of a PID namespace: its end kills every process of the node
            if n.init:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(n.init, signal.SIGKILL)
        for proc in c.procs:
            proc.kill()
            proc.wait(timeout=30)
        for ns in made:            # anything left inside (by PID); the veth pair goes with its namespaces
            _remove(ns)
