"""A lost node: two torchrun "nodes" on this host train TP2 x DP2 (node 1 holds ranks 2 and 3, the second
data-parallel replica); after a checkpoint node 1's launcher and ranks are killed at once (kill -9, as a machine
that dies). Every surviving process must be gone within 60 s, each surviving rank naming the lost ranks
and the last complete checkpoint; the same training command on the node that remains (dp 1) resumes there,
keeps the global batch by accumulating twice as many micro-batches, and repeats the steps the lost run had trained after
the checkpoint with its losses.
The survivors' collectives fail on the broken connections, so rank 0 names the silent ranks after 5 s
(parallel/distributed/heartbeat.py); train.collective_timeout_s=20 bounds the silent-machine case at 10 s.
`lose_node_then_rerun` is the scenario; tests/cli/test_netns_hosts.py runs it across two namespace hosts.
"""


import pytest

from tests.helpers.launchers import run_env, start
from tests.helpers.lost_node import lose_node_then_rerun

pytestmark = pytest.mark.cluster       # tests/conftest.py: the real launchers, signals and hosts


def test_lost_node_names_ranks_and_checkpoint_then_rerun_resumes(tmp_path):
    lose_node_then_rerun(tmp_path, lambda node, cmd, log: start(cmd, log, run_env()))
