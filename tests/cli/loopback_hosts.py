"""The fallback of tests/cli/test_netns_hosts.py's `hosts` where network namespaces cannot be made (not root, no
`ip netns`): two "hosts" that are both this machine, `localhost` and `127.0.0.1` (two names, as DeepSpeed's pdsh
runner needs; both 127.0.0.1), reached over ssh through an sshd on a free loopback port with its own keys.

The same interface as tests/cli/netns_cluster.py's Cluster (`nodes`, `path`, `hostfile`, `command`, `run`,
`master`), so each launcher test runs as it is on either, with `own_addresses` False: the checks of what only hosts
with their own addresses show (DeepSpeed resolving the first host's address, no 127.0.0.1 anywhere) are left out.
A command runs here as it is (`command` adds no nsenter).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from tests.cli.netns_cluster import Cluster, Node, _keys_and_configs
from tests.dist_utils import free_port


@dataclass
class LoopbackCluster(Cluster):
    why: str = ""              # why no namespace cluster could be made here
    own_addresses = False

    @property
    def master(self) -> str:
        return "127.0.0.1"

    def command(self, i: int, cmd: list[str], cwd: str) -> list[str]:
        return cmd

    def run(self, i: int, cmd: list[str], cwd: str, env: dict, log, **kw) -> subprocess.Popen:
        with open(log, "w") as f:
            return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, **kw)


def _configs(d: Path, port: int) -> None:
    """The namespace cluster's keys and ssh wrapper for an sshd at 127.0.0.1:`port`, and that sshd's config."""
    _keys_and_configs(d, port)
    (d / "sshd_config").write_text(textwrap.dedent(f"""\
        ListenAddress 127.0.0.1:{port}
        HostKey {d}/host_key
        AuthorizedKeysFile {d}/authorized_keys
        PidFile {d}/sshd.pid
        StrictModes no
        UsePAM no
        PasswordAuthentication no
        KbdInteractiveAuthentication no
        PermitRootLogin prohibit-password
        """))


@contextlib.contextmanager
def cluster(d: Path, why: str):
    """`localhost` and `127.0.0.1`, the sshd up (`ssh 127.0.0.1 true` answers); the sshd stopped on exit."""
    port = free_port()
    _configs(d, port)
    if os.getuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)    # sshd's privilege separation directory; no init made it here
    server = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(d / "sshd_config")],
                              stdout=open(d / "sshd.log", "w"), stderr=subprocess.STDOUT)
    c = LoopbackCluster(d, [Node("localhost", "127.0.0.1", ""), Node("127.0.0.1", "127.0.0.1", "")], str(d / "bin"),
                        [server], why)
    try:
        env = {**os.environ, "PATH": f"{c.path}:{os.environ['PATH']}"}
        deadline = time.monotonic() + 30
        while subprocess.run(["ssh", "127.0.0.1", "true"], env=env, capture_output=True, timeout=30).returncode:
            assert time.monotonic() < deadline and server.poll() is None, (d / "sshd.log").read_text()
            time.sleep(0.2)
        yield c
    finally:
        server.terminate()
        server.wait(timeout=30)
