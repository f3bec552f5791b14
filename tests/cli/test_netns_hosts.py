"""Each launcher that spans hosts, run once: two nodes, 2 ranks each, PP2 x TP2 trained to the per-step losses of
`deepspeed --num_gpus 4 train.py` on one host (the `reference` fixture), bit for bit, and the commands launch.sh
prints. Every launcher starts on node 0, as a user starts it on the first node; pdsh, mpirun's orted, torchrun's
agents and Slurm's slurmd reach node 1. Also `deepspeed --no_ssh` on each node, a refused layout stopping both
nodes, a lost node (tests/helpers/lost_node.py's scenario), an elastic run that loses node 1 and takes it back, and
a second cluster beside the first.

The `hosts` are two network-namespace nodes with their own addresses (tests/cli/netns_cluster.py, vdp-node0 =
10.231.0.1, vdp-node1 = 10.231.0.2, over a veth link) where the machine can make them (root, `ip netns`: CI); else,
or with VDP_LOOPBACK_HOSTS=1, two names of this machine, localhost and 127.0.0.1, with an sshd on loopback
(tests/cli/loopback_hosts.py): the same runs and checks, less those that need hosts with their own addresses
(`hosts.own_addresses`). The tests that exist only across namespaces (the elastic run, DeepSpeed's own address
lookup, two clusters) skip on loopback, with the reason.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tests.cli import loopback_hosts, netns_cluster
from parallel.checkpoints.checkpoint import complete_steps
from tests.helpers.launchers import LAYOUT, ROOT, finish, kill_marked, kill_node, losses, run_env, train_args
from tests.helpers.lost_node import lose_node_then_rerun, rows
from tests.helpers.slurm import run_sbatch, slurm_cluster
from tests.dist_utils import free_port

pytestmark = pytest.mark.cluster       # tests/conftest.py: the real launchers, signals and hosts

VENV_BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    why = "VDP_LOOPBACK_HOSTS=1" if os.environ.get("VDP_LOOPBACK_HOSTS") == "1" else netns_cluster.unavailable()
    try:
        if why:
            with loopback_hosts.cluster(tmp_path_factory.mktemp("loopback"), why) as c:
                yield c
        else:
            with netns_cluster.cluster(tmp_path_factory.mktemp("netns")) as c:
                yield c
    finally:
        if os.path.exists(os.path.join(ROOT, ".deepspeed_env")):       # launch.sh's, for the pdsh runs
            os.remove(os.path.join(ROOT, ".deepspeed_env"))


def needs_own_addresses(hosts) -> None:
    """For a test that exists only across hosts with their own addresses: skipped on loopback, with the reason."""
    if not hosts.own_addresses:
        pytest.skip(f"no namespace cluster: {hosts.why}")


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
    needs_own_addresses(hosts)
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
    needs_own_addresses(hosts)
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
    """`launch.sh --hostfile` on the first node: DeepSpeed over pdsh, the remote ranks on this venv's Python (from
    .deepspeed_env's PATH); across hosts with their own addresses the master is left to DeepSpeed (never
    127.0.0.1), on loopback every host is this machine: 127.0.0.1. The dry run names it."""
    (n0, n1), own = hosts.nodes, hosts.own_addresses
    out, hostfile, port = tmp_path / "run", hosts.hostfile(2), free_port()
    launch = ["bash", "launch.sh", "--hostfile", str(hostfile), "--master-port", str(port)]
    log = on_nodes(hosts, tmp_path, {0: [*launch, "--dry-run", "--", *train_args(out, *LAYOUT)]}, out,
                   node_env(hosts))
    master = f"<{n0.name}'s address>" if own else "127.0.0.1"
    assert f"launch.sh: {n1.name}: ranks 2-3, master {master}:{port}\n" in log
    log = on_nodes(hosts, tmp_path, {0: [*launch, "--", *train_args(out, *LAYOUT)]}, out, node_env(hosts))
    given = "" if own else "--master_addr 127.0.0.1 "
    assert f"+ deepspeed --hostfile {hostfile} {given}--master_port {port} train.py " in log
    assert f"cmd = pdsh -S -f 1024 -w {n0.name},{n1.name} " in log
    assert f"export PATH={VENV_BIN}:" in log
    if own:
        assert f"Using IP address of {n0.addr} for node {n0.name}" in log
        assert "127.0.0.1" not in log.split("cmd = pdsh", 1)[1].split("\n", 1)[0]
    assert losses(out) == reference


def test_launch_sh_openmpi(reference, hosts, tmp_path):
    """Open MPI over ssh: every rank gets MASTER_ADDR = the first host's address. On loopback one hostfile line
    of 4 slots (Open MPI takes localhost and 127.0.0.1 for one host and stops with an internal error)."""
    out, hostfile = tmp_path / "run", hosts.hostfile(2)
    if not hosts.own_addresses:
        hostfile = tmp_path / "hosts"
        hostfile.write_text(f"{hosts.nodes[0].name} slots=4\n")
    cmd = ["bash", "launch.sh", "--launcher", "openmpi", "--hostfile", str(hostfile),
           "--master-port", str(free_port()), "--", *train_args(out, *LAYOUT)]
    log = on_nodes(hosts, tmp_path, {0: cmd}, out, node_env(hosts))
    assert f"+ MASTER_ADDR={hosts.nodes[0].addr} MASTER_PORT=" in log and " mpirun -np 4 " in log
    assert losses(out) == reference


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed --no_ssh"])
def test_two_node_launchers(reference, hosts, tmp_path, launcher):
    """A node launcher on each node (its own command, node 0 hosts the rendezvous): torchrun, the master named
    (vdp-node0, or 127.0.0.1 on loopback), and DeepSpeed's --no_ssh, the master the first host's address as
    launch.sh resolves it."""
    out, port = tmp_path / "run", str(free_port())
    node_args = {"torchrun": ["--launcher", "torchrun", "--nnodes", "2", "--nproc", "2", "--master-addr", hosts.master],
                 "deepspeed --no_ssh": ["--hostfile", str(hosts.hostfile(2))]}[launcher]
    cmds = {i: ["bash", "launch.sh", *node_args, "--node-rank", str(i), "--master-port", port, "--",
                *train_args(out, *LAYOUT)] for i in (0, 1)}
    on_nodes(hosts, tmp_path, cmds, out, node_env(hosts))
    command = (tmp_path / "node1.log").read_text().splitlines()[0]
    assert command.startswith(f"+ {launcher.split()[0]} ") and ("--no_ssh " in command) == ("no_ssh" in launcher)
    if launcher == "torchrun":
        assert f"--node_rank 1 --master_addr {hosts.master} " in command
    else:
        assert f"--master_addr {hosts.nodes[0].addr} --master_port {port} --no_ssh --node_rank 1 " in command
    assert losses(out) == reference


def test_refused_layout_stops_every_node_with_exit_code_1(hosts, tmp_path):
    """World size 2 with tp 2 x pp 2, torchrun on two nodes: every rank stops before any collective; each says why."""
    out, port = tmp_path / "run", str(free_port())
    procs = [hosts.run(r, ["bash", "launch.sh", "--launcher", "torchrun", "--nnodes", "2", "--nproc", "1",
                           "--node-rank", str(r), "--master-addr", hosts.master, "--master-port", port, "--",
                           *train_args(out, *LAYOUT)], ROOT, node_env(hosts), tmp_path / f"node{r}.log")
             for r in (0, 1)]
    assert finish(procs, str(out), timeout=120) == [1, 1]
    for r in (0, 1):
        log = (tmp_path / f"node{r}.log").read_text()
        assert log.count("world size 2 is not divisible by parallel.tp_size x parallel.pp_size = 2 x 2 = 4") == 1
    assert not out.exists()


def test_lost_node(hosts, tmp_path):
    """tests/helpers/lost_node.py's scenario across the two nodes: node 1's launcher and ranks killed after a
    checkpoint; node 0's ranks name ranks 2, 3 on node 1's host and the checkpoint; the rerun on node 0 resumes."""
    env = node_env(hosts)
    log0 = lose_node_then_rerun(tmp_path, lambda node, cmd, log: hosts.run(node, cmd, ROOT, env, log),
                                master=hosts.master)
    host = hosts.nodes[1].name if hosts.own_addresses else socket.gethostname()     # loopback: this machine's
    assert f"rank 0: lost rank(s) 2, 3 (host {host})" in log0


def test_slurm_sbatch(reference, hosts, tmp_path):
    """tests/helpers/slurm.py's cluster, slurmctld and a slurmd on node 0 and a slurmd on node 1 (NodeAddr their
    addresses; munged here, its socket on the shared file system): docs/multi-node.md's sbatch script gets
    MASTER_ADDR = node 0's NodeAddr and trains across both. On loopback the Slurm nodes are vdp-n0, vdp-n1 (node
    names that need not resolve, each its own NodeHostname: Debian's slurm refuses two nodes with one), both
    NodeAddr 127.0.0.1, the controller this machine."""
    if hosts.own_addresses:
        names, ctld = [n.name for n in hosts.nodes], (hosts.nodes[0].name, hosts.nodes[0].addr)
    else:
        names, ctld = ["vdp-n0", "vdp-n1"], (os.uname().nodename, "127.0.0.1")
    addrs = {name: n.addr for name, n in zip(names, hosts.nodes)}
    wrap = lambda where, cmd: hosts.command(1 if where == names[1] else 0, cmd, ROOT)
    with slurm_cluster(tmp_path / "slurm", addrs, ctld, wrap) as env:
        text, port = run_sbatch(tmp_path, {**node_env(hosts), **env}, wrap)
    assert f"+ MASTER_ADDR={hosts.nodes[0].addr} MASTER_PORT={port} srun --kill-on-bad-exit=1 " in text, text[-3000:]
    assert f"nodes {names[0][:-1]}[0-1], 4 tasks" in text, text[-3000:]
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
    needs_own_addresses(hosts)
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
        kill_node(procs[1])
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
