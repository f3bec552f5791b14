"""Slurm for real: a two-node Slurm cluster on this host (munged, slurmctld, two slurmd), and the sbatch
script of docs/multi-node.md running launch.sh -> srun -> train.py (PP2 x TP2, 2 nodes x 2 tasks) to the
per-step losses of `deepspeed --num_gpus 4 train.py`.

The cluster lives in the module's temp dir: its own munge key and socket, slurm.conf with ports from
free_port, state, spool and logs under the same dir; the daemons run in the foreground (-D / -F) as
children of the test and are stopped after the module. Two nodes on one host: Debian's slurm is built
without multiple-slurmd support (two nodes with one NodeHostname are refused), so each node has its own
name and NodeHostname, `slurmd -N <name>` tells each daemon which it is, and both have NodeAddr=127.0.0.1
and their own Port. The node names do not resolve; launch.sh takes MASTER_ADDR from the first node's
NodeAddr. gVisor-style sandboxes have no cgroups: proctrack/linuxproc and task/none need none.
Slurm, munge: scripts/system-deps.sh installs them (as root). `slurm_cluster` and `run_sbatch` also run the
cluster across two namespace hosts (tests/cli/test_netns_hosts.py::test_slurm_sbatch).
"""
import os

import pytest

from tests.helpers.launchers import losses
from tests.helpers.slurm import run_sbatch, slurm_cluster

pytestmark = pytest.mark.cluster       # tests/conftest.py: the real launchers, signals and hosts

NODES = ("vdp-n0", "vdp-n1")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running two-node cluster; yields the environment (SLURM_CONF) its client commands need."""
    with slurm_cluster(tmp_path_factory.mktemp("slurm"), {n: "127.0.0.1" for n in NODES},
                       (os.uname().nodename, "127.0.0.1")) as env:
        yield env


def test_sbatch_two_nodes_equals_direct_deepspeed(reference, slurm, tmp_path):
    """docs/multi-node.md's sbatch script: 2 nodes x 2 tasks, PP2 x TP2, the direct run's losses bit for bit."""
    text, port = run_sbatch(tmp_path, slurm)
    assert f"+ MASTER_ADDR=127.0.0.1 MASTER_PORT={port} srun --kill-on-bad-exit=1 " in text, text[-3000:]
    assert "nodes vdp-n[0-1], 4 tasks" in text, text[-3000:]
    assert losses(tmp_path / "run") == reference
