"""Launchers across hosts with their own addresses: two network-namespace nodes (tests/cli/netns_cluster.py,
vdp-node0 = 10.231.0.1, vdp-node1 = 10.231.0.2), 2 ranks each, PP2 x TP2 trained to the per-step losses of
`deepspeed --num_gpus 4 train.py` on one host (the `reference` fixture), bit for bit. Every launcher starts on
vdp-node0, as a user starts it on the first node; pdsh, mpirun's orted, torchrun's agents and Slurm's slurmd reach
vdp-node1 over the veth link. And a lost node (tests/cli/test_lost_node.py's scenario) across them, an elastic run
that loses vdp-node1 and takes it back, and a second cluster beside the first. Skipped with the reason where
namespaces cannot be made (not root, no `ip netns`).
"""
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.cli import netns_cluster
from parallel.checkpoints.checkpoint import complete_steps
from tests.helpers.launchers import LAYOUT, ROOT, finish, kill_marked, losses, run_env, train_args
from tests.helpers.lost_node import lose_node_then_rerun, rows
from tests.helpers.slurm import run_sbatch, slurm_cluster
from tests.dist_utils import free_port

pytestmark = pytest.mark.cluster       # tests/conftest.py: the real launchers, signals and hosts

VENV_BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    why = netns_cluster.unavailable()
    if why:
        pytest.skip(f"no namespace cluster: {why}")
    with netns_cluster.cluster(tmp_path_factory.mktemp("netns")) as c:
        yield c
    if os.path.exists(os.path.join(ROOT, ".deepspeed_env")):       # launch.sh's, for the pdsh runs
        os.remove(os.path.join(ROOT, ".deepspeed_env"))


def node_env(c, **extra):
    return run_env(PATH=f"{c.path}:{os.environ['PATH']}", **extra)


def on_nodes(c, tmp_path, commands: dict[int, list[str]], out, env) -> str:
    """Run each node's command at once; returns their logs after asserting every one exited 0."""
    procs = {i: c.run(i, cmd, ROOT, env, tmp_path / f"node{i}.log") for i, cmd in commands.items()}
    codes = finish(list(procs.values()), str(out))
    logs = "".join(f"--- node{i}\n" + (tmp_path / f"node{i}.log").read_text() for i in procs)
    assert codes == [0] * len(procs), logs[-6000:]
    return logs


def lands_home(c) -> tuple[str, str]:
    """(the network namespace, as /proc names it, that `ssh vdp-node1` from cluster c's vdp-node0 lands in, the
    one c made for vdp-node1): equal when ssh reaches the cluster's own node."""
    env = {**os.environ, "PATH": f"{c.path}:{os.environ['PATH']}"}
    seen = subprocess.run(c.command(0, ["ssh", c.nodes[1].name, "readlink /proc/self/ns/net"], "/"), env=env,
                          text=True, capture_output=True, timeout=60).stdout.strip()
    return seen, os.readlink(f"/proc/{c.nodes[1].init}/ns/net")


def test_two_clusters_at_once(hosts, tmp_path):
    """A second cluster beside the module's, as another CI job on this machine makes one: its namespaces and veth
    pair named apart, the same hostnames, subnet and sshd port; from each cluster's vdp-node0, ssh vdp-node1
    reaches that cluster's node (its network namespace), the first cluster's also after the second is removed."""
    with netns_cluster.cluster(tmp_path) as other:
        assert {n.netns for n in other.nodes}.isdisjoint(n.netns for n in hosts.nodes)
        for c in (other, hosts):
            seen, made = lands_home(c)
            assert seen == made
    seen, made = lands_home(hosts)
    assert seen == made
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split()
    assert not {n.netns for n in other.nodes} & set(listed)


def test_deepspeed_pdsh(reference, hosts, tmp_path):
    """`deepspeed --hostfile` as DeepSpeed documents it: no --master_addr (it asks `ssh vdp-node0 hostname -I`),
    the remote ranks' environment from a .deepspeed_env file (DS_ENV_FILE)."""
    out, ds_env = tmp_path / "run", tmp_path / "deepspeed_env"
    ds_env.write_text(f"PATH={VENV_BIN}:{os.environ['PATH']}\nPYTHONPATH={ROOT}\nOMP_NUM_THREADS=1\n"
                      + "".join(f"{v}={os.environ[v]}\n" for v in ("TORCH_EXTENSIONS_DIR",) if v in os.environ))
    cmd = [os.path.join(VENV_BIN, "deepspeed"), "--hostfile", str(hosts.hostfile(2)), "--master_port",
           str(free_port()), *train_args(out, *LAYOUT)]
    log = on_nodes(hosts, tmp_path, {0: cmd}, out, node_env(hosts, DS_ENV_FILE=str(ds_env)))
    assert "Using IP address of 10.231.0.1 for node vdp-node0" in log
    assert "cmd = pdsh -S -f 1024 -w vdp-node0,vdp-node1 " in log
    assert any(line.startswith("vdp-node1: ") for line in log.splitlines())     # pdsh's prefix: ranks ran there
    assert losses(out) == reference


def test_launch_sh_hostfile(reference, hosts, tmp_path):
    """`launch.sh --hostfile` on the first node: DeepSpeed over pdsh, the master left to DeepSpeed (never
    127.0.0.1); the dry run names it."""
    out, hostfile, port = tmp_path / "run", hosts.hostfile(2), free_port()
    launch = ["bash", "launch.sh", "--hostfile", str(hostfile), "--master-port", str(port)]
    log = on_nodes(hosts, tmp_path, {0: [*launch, "--dry-run", "--", *train_args(out, *LAYOUT)]}, out,
                   node_env(hosts))
    assert f"launch.sh: vdp-node1: ranks 2-3, master <vdp-node0's address>:{port}\n" in log
    log = on_nodes(hosts, tmp_path, {0: [*launch, "--", *train_args(out, *LAYOUT)]}, out, node_env(hosts))
    assert f"+ deepspeed --hostfile {hostfile} --master_port {port} train.py " in log
    assert "Using IP address of 10.231.0.1 for node vdp-node0" in log
    assert "127.0.0.1" not in log.split("cmd = pdsh", 1)[1].split("\n", 1)[0]
    assert losses(out) == reference


def test_launch_sh_openmpi(reference, hosts, tmp_path):
    """Open MPI over ssh: every rank gets MASTER_ADDR = the first host's address."""
    out = tmp_path / "run"
    cmd = ["bash", "launch.sh", "--launcher", "openmpi", "--hostfile", str(hosts.hostfile(2)),
           "--master-port", str(free_port()), "--", *train_args(out, *LAYOUT)]
    log = on_nodes(hosts, tmp_path, {0: cmd}, out, node_env(hosts))
    assert "+ MASTER_ADDR=10.231.0.1 MASTER_PORT=" in log and " mpirun -np 4 " in log
    assert losses(out) == reference


def test_torchrun_two_nodes(reference, hosts, tmp_path):
    """torchrun on each node (its own command), the rendezvous at vdp-node0 by name."""
    out, port = tmp_path / "run", str(free_port())
    cmds = {i: ["bash", "launch.sh", "--launcher", "torchrun", "--nnodes", "2", "--nproc", "2", "--node-rank", str(i),
                "--master-addr", "vdp-node0", "--master-port", port, "--", *train_args(out, *LAYOUT)] for i in (0, 1)}
    log = on_nodes(hosts, tmp_path, cmds, out, node_env(hosts))
    assert "--node_rank 1 --master_addr vdp-node0 " in log
    assert losses(out) == reference


def test_lost_node(hosts, tmp_path):
    """tests/cli/test_lost_node.py's scenario across the two nodes: vdp-node1's launcher and ranks killed after a
    checkpoint; node 0's ranks name ranks 2, 3 on vdp-node1 and the checkpoint; the rerun on vdp-node0 resumes."""
    env = node_env(hosts)
    log0 = lose_node_then_rerun(tmp_path, lambda node, cmd, log: hosts.run(node, cmd, ROOT, env, log),
                                master="vdp-node0")
    assert "rank 0: lost rank(s) 2, 3 (host vdp-node1)" in log0


def test_slurm_sbatch(reference, hosts, tmp_path):
    """tests/cli/test_slurm.py's cluster with slurmctld and slurmd on vdp-node0 and a slurmd on vdp-node1 (NodeAddr
    their own addresses; munged here, its socket on the shared file system): docs/multi-node.md's sbatch
    script gets MASTER_ADDR = vdp-node0's NodeAddr and trains across both."""
    addrs = {n.name: n.addr for n in hosts.nodes}
    wrap = lambda where, cmd: hosts.command(1 if where == "vdp-node1" else 0, cmd, ROOT)
    with slurm_cluster(tmp_path / "slurm", addrs, ("vdp-node0", "10.231.0.1"), wrap) as env:
        text, port = run_sbatch(tmp_path, {**node_env(hosts), **env}, wrap)
    assert f"+ MASTER_ADDR=10.231.0.1 MASTER_PORT={port} srun --kill-on-bad-exit=1 " in text, text[-3000:]
    assert "nodes vdp-node[0-1], 4 tasks" in text, text[-3000:]
    assert losses(tmp_path / "run") == reference


def ranks_of(proc) -> list[psutil.Process]:
    """The train.py ranks under a launcher process (not torchrun's agent, whose command line names train.py too)."""
    return [p for p in psutil.Process(proc.pid).children(recursive=True)
            if "train.py" in p.cmdline() and not any("torchrun" in a for a in p.cmdline())]


def test_elastic_restart_without_a_human(hosts, tmp_path):
    """launch.sh --nnodes 1:2 (torchrun's elastic agent) on both nodes, TP2 x DP2, then, with no command but the
    node's own: vdp-node1's launcher and ranks killed after the step-2 checkpoint; the agent on vdp-node0 restarts
    the run at dp 1, train.grad_accum_steps 4 keeping the global batch 8. Once it has trained a step, the same
    command started again on vdp-node1: the agent on vdp-node0 sees it wait at the rendezvous and stops its ranks
    (SIGTERM: a checkpoint at the step they are in, step k), and the run goes on at dp 2 on both nodes from step k,
    accumulation back to 2, for longer than the heartbeat takes to call a silent rank lost (the rejoined node's
    agent counts restarts from 0, vdp-node0's from 1: the ranks must beat under the same keys). The ranks are
    then stopped (SIGTERM, a checkpoint at step m) and both launchers exit 0. No step after the loss is missing
    or repeated; the first steps of each part equal, bit for bit, those of a run resumed by hand: at dp 1 from a
    copy of step 2, at dp 2 (one node, 4 ranks) from a copy of step k (train.decay_steps fixed, so that a shorter
    run by hand has the same schedule). Prints the time from the kill to the first step on vdp-node0 and from
    vdp-node1's start to the first step on both."""
    # the horizon only bounds the run (stopped by signal): steps at dp 1 while vdp-node1 starts, at dp 2 for 11 s
    out, hand, port, horizon, compared = tmp_path / "run", tmp_path / "hand", str(free_port()), 500, 4
    args = lambda o, steps: train_args(o, "--set", "parallel.tp_size=2", "--set", "ckpt.every=2",
                                       "--set", "train.collective_timeout_s=20", "--set", f"train.decay_steps={horizon}",
                                       steps=steps)
    cmd = ["bash", "launch.sh", "--nproc", "2", "--nnodes", "1:2", "--max-restarts", "1", "--master-addr", "vdp-node0",
           "--master-port", port, "--", *args(out, horizon)]
    env = node_env(hosts)
    procs = [hosts.run(i, cmd, ROOT, env, tmp_path / f"node{i}.log") for i in (0, 1)]
    log = lambda name: (tmp_path / f"{name}.log").read_text()
    logs = lambda: "".join(f"--- {n}\n" + log(n)[-3000:] for n in ("node0", "node1", "rejoin") if
                           (tmp_path / f"{n}.log").exists())
    ckpts = lambda: complete_steps(out / "checkpoints")

    def wait(until, timeout=180):
        deadline = time.monotonic() + timeout
        while not until():
            assert procs[0].poll() is None and time.monotonic() < deadline, logs()
            time.sleep(0.1)
        return time.monotonic()

    try:
        wait(lambda: ckpts() and len(rows(out)) > ckpts()[-1], 240)
        lost_at, trained = len(rows(out)), ckpts()[-1]
        node1 = psutil.Process(procs[1].pid)
        for p in [node1, *node1.children(recursive=True)]:
            p.send_signal(signal.SIGKILL)
        killed = time.monotonic()      # the checkpoint for the run by hand, before a later save prunes it
        shutil.copytree(out / "checkpoints" / f"step{trained}", hand / "dp1" / "checkpoints" / f"step{trained}")
        to_first_step = wait(lambda: len(rows(out)) > lost_at) - killed
        wait(lambda: len(rows(out)) > lost_at + 1)          # a step at dp 1, then vdp-node1 is back
        procs[1] = hosts.run(1, cmd, ROOT, env, tmp_path / "rejoin.log")
        joined = time.monotonic()
        wait(lambda: "stopped by signal after step" in log("node0"))
        k = int(log("node0").split("stopped by signal after step ")[1].split(";")[0])
        shutil.copytree(out / "checkpoints" / f"step{k}", hand / "dp2" / "checkpoints" / f"step{k}")
        rejoined = wait(lambda: any(r.get("resumed_from") == k for r in rows(out)))
        lost_after = 10      # train.collective_timeout_s / 2: the heartbeat started before the first step
        wait(lambda: time.monotonic() - rejoined > lost_after + 1 and rows(out)[-1]["step"] >= k + compared)
        for p in ranks_of(procs[0]) + ranks_of(procs[1]):
            p.send_signal(signal.SIGTERM)
        assert [p.wait(timeout=120) for p in procs] == [0, 0], logs()
    finally:
        kill_marked(str(out))
    print(f"\nvdp-node1 lost after step {lost_at}: the first step on vdp-node0 {to_first_step:.1f} s later; "
          f"vdp-node1 started again after step {k}: the first step on both {rejoined - joined:.1f} s later")
    text, rejoin = log("node0"), log("rejoin")
    assert f"the last complete checkpoint is {out}/checkpoints/step{trained}; torchrun's elastic agent restarts the " \
           f"run on the nodes that remain (1 restart(s) left)" in text, logs()
    assert "resuming at dp 1: train.grad_accum_steps=4 keeps the checkpoint's global batch 8" in text
    assert f"stopped by signal after step {k}; checkpoint {out}/checkpoints/step{k}" in text
    assert f"resumed from {out}/checkpoints/step{k} at step {k} (written at tp 2 sp 1 pp 1 dp 1 ZeRO-0, read from " \
           f"its layout-free copy)" in text + rejoin, logs()
    assert "resuming at dp 2: train.grad_accum_steps=2 keeps the checkpoint's global batch 8" in text + rejoin, logs()
    m = rows(out)[-1]["step"]
    assert f"stopped by signal after step {m}; checkpoint {out}/checkpoints/step{m}" in text + rejoin
    after = rows(out)[lost_at:]        # the steps after the loss: 3..k at dp 1, k+1..m at dp 2, none twice
    assert [r["step"] for r in after] == list(range(trained + 1, m + 1)), after
    assert [(r["step"], r.get("resumed_from")) for r in after if "resumed_from" in r] == [(trained + 1, trained),
                                                                                           (k + 1, k)]

    # by hand, at once: dp 1 (vdp-node0, 2 ranks) from the copy of step 2, dp 2 (vdp-node1, 4 ranks) from the copy
    # of step k, each for the first `compared` steps of its part
    ends = (min(k, trained + compared), k + compared)
    by_hand = lambda o, nproc, steps: ["bash", "launch.sh", "--launcher", "torchrun", "--nproc", str(nproc),
                                       "--master-port", str(free_port()), "--", *args(o, steps)]
    assert on_nodes(hosts, hand, {0: by_hand(hand / "dp1", 2, ends[0]), 1: by_hand(hand / "dp2", 4, ends[1])}, hand,
                    env)
    assert [(r["step"], r["loss"]) for r in rows(hand / "dp1") + rows(hand / "dp2")] == \
        [(r["step"], r["loss"]) for r in after if trained < r["step"] <= ends[0] or k < r["step"] <= ends[1]]
