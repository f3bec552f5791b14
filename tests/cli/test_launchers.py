"""launch.sh with the real launchers on one host: each trains PP2 x TP2 to the same per-step losses as
`deepspeed --num_gpus 4 train.py`, a killed rank takes the whole run down, and exit codes reach the caller.

Every run pins OMP_NUM_THREADS=1: the intra-op thread count changes the order of float sums, so losses are
bit-equal across launchers only at one thread count (torchrun sets 1 when unset, DeepSpeed's launcher
leaves torch's default). Processes are found and cleaned up by the run's unique output directory.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tests.dist_utils import free_port
from tests.helpers.launchers import LAYOUT, ROOT, finish, kill_marked, losses, marked_alive, run_env, start, train_args

pytestmark = pytest.mark.cluster       # tests/conftest.py: the real launchers, signals and hosts


def environ(p: psutil.Process) -> dict:
    try:
        return p.environ()
    except psutil.Error:          # gone meanwhile
        return {}


def launch(*launcher_args, out, env=None):
    """One `launch.sh ... -- train.py` run of the PP2 x TP2 layout; returns (exit code, its output)."""
    log = f"{out}.log"
    proc = start(["bash", "launch.sh", *launcher_args, "--", *train_args(out, *LAYOUT)], log, env or run_env())
    code, = finish([proc], str(out))
    return code, open(log).read()


def test_local_launcher_equals_direct_deepspeed(reference, tmp_path):
    out = tmp_path / "run"
    code, log = launch("--launcher", "local", "--nproc", "4", "--master-port", str(free_port()), out=out)
    assert code == 0, log[-4000:]
    assert "+ deepspeed --num_gpus 4 " in log
    assert losses(out) == reference


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed --no_ssh"])
def test_two_nodes_on_one_host(reference, tmp_path, launcher):
    """Two node launchers started side by side, as on two machines; node 0 hosts the rendezvous."""
    out, port, hosts = tmp_path / "run", str(free_port()), tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n127.0.0.1 slots=2\n")
    node_args = {"torchrun": ["--launcher", "torchrun", "--nnodes", "2", "--nproc", "2",
                              "--master-addr", "127.0.0.1"],
                 "deepspeed --no_ssh": ["--hostfile", str(hosts)]}[launcher]
    procs = [start(["bash", "launch.sh", *node_args, "--node-rank", str(r), "--master-port", port, "--",
                    *train_args(out, *LAYOUT)], tmp_path / f"node{r}.log", run_env()) for r in (0, 1)]
    codes = finish(procs, str(out))
    assert codes == [0, 0], (tmp_path / "node0.log").read_text()[-3000:] + (tmp_path / "node1.log").read_text()[-3000:]
    command = (tmp_path / "node1.log").read_text().splitlines()[0]
    assert command.startswith(f"+ {launcher.split()[0]} ") and ("--no_ssh " in command) == ("no_ssh" in launcher)
    assert "--node_rank 1 " in command
    assert losses(out) == reference


@pytest.fixture
def sshd(tmp_path):
    """An sshd on a free loopback port with its own keys; yields a PATH entry whose `ssh` uses it."""
    d = tmp_path / "ssh"
    (d / "bin").mkdir(parents=True)
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True, timeout=30)
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    port = free_port()
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
    if os.getuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)    # sshd's privilege separation directory; no init made it here
    server = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(d / "sshd_config")],
                              stdout=open(d / "sshd.log", "w"), stderr=subprocess.STDOUT)
    try:
        check = ["ssh", "127.0.0.1", "true"]
        deadline = time.monotonic() + 30
        while subprocess.run(check, env={**os.environ, "PATH": f"{d}/bin:{os.environ['PATH']}"},
                             capture_output=True, timeout=30).returncode != 0:
            assert time.monotonic() < deadline and server.poll() is None, (d / "sshd.log").read_text()
            time.sleep(0.2)
        yield str(d / "bin")
    finally:
        server.terminate()
        server.wait(timeout=30)
        if os.path.exists(os.path.join(ROOT, ".deepspeed_env")):
            os.remove(os.path.join(ROOT, ".deepspeed_env"))


def test_pdsh_over_ssh(reference, tmp_path, sshd):
    """`launch.sh --hostfile`: DeepSpeed's pdsh runner over ssh to two 'hosts' (both this machine)."""
    out, hosts = tmp_path / "run", tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n127.0.0.1 slots=2\n")
    env = run_env(PATH=f"{sshd}:{os.environ['PATH']}")
    code, log = launch("--hostfile", str(hosts), "--master-port", str(free_port()), out=out, env=env)
    assert code == 0, log[-4000:]
    assert "cmd = pdsh -S -f 1024 -w localhost,127.0.0.1" in log
    # the remote ranks ran this venv's Python, from .deepspeed_env's PATH
    assert f"export PATH={os.path.dirname(sys.executable)}:" in log
    assert losses(out) == reference


def test_openmpi(reference, tmp_path):
    out, hosts = tmp_path / "run", tmp_path / "hosts"
    hosts.write_text("localhost slots=4\n")
    code, log = launch("--launcher", "openmpi", "--hostfile", str(hosts), "--master-port", str(free_port()), out=out)
    assert code == 0, log[-4000:]
    assert "mpirun -np 4 " in log
    assert losses(out) == reference


def test_slurm_allocation_dry_run(tmp_path):
    """Inside an allocation launch.sh picks srun, with the first node of the job's node list as master."""
    (tmp_path / "scontrol").write_text(textwrap.dedent("""\
        #!/bin/sh
        # `scontrol show hostnames gpu-[07-08]` of a two-node allocation
        [ "$1 $2 $3" = "show hostnames gpu-[07-08]" ] && printf 'gpu-07\\ngpu-08\\n'
        """))
    (tmp_path / "scontrol").chmod(0o755)
    env = run_env(SLURM_JOB_ID="42", SLURM_JOB_NODELIST="gpu-[07-08]", PATH=f"{tmp_path}:{os.environ['PATH']}")
    p = subprocess.run(["bash", "launch.sh", "--dry-run", "--", "train.py", "--config", "debug"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines()[-1] == \
        "+ MASTER_ADDR=gpu-07 MASTER_PORT=29500 srun --kill-on-bad-exit=1 python train.py --config debug"


@pytest.mark.parametrize("launcher", ["local", "torchrun"])
def test_killed_rank_stops_every_process(tmp_path, launcher):
    """kill -9 of one rank after the first step: the launcher and every rank are gone within 60 s."""
    out = tmp_path / "run"
    args = ["--launcher", launcher, "--nproc", "2", "--master-port", str(free_port()), "--",
            *train_args(out, "--set", "parallel.pp_size=2", steps=100)]
    proc = start(["bash", "launch.sh", *args], f"{out}.log", run_env())
    try:
        deadline = time.monotonic() + 180
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, open(f"{out}.log").read()[-3000:]
            time.sleep(0.5)
        rank1 = [p for p in marked_alive(str(out)) if environ(p).get("RANK") == "1"]
        assert len(rank1) == 1
        rank1[0].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = proc.wait(timeout=60)
        while marked_alive(str(out)):
            assert time.monotonic() - killed < 60, [p.info["cmdline"][:4] for p in marked_alive(str(out))]
            time.sleep(0.5)
    finally:
        kill_marked(str(out))
    assert code != 0
    assert len(losses(out)) < 100


@pytest.mark.parametrize("launcher", ["torchrun"])       # two nodes; one node ("local") is the same check
def test_refused_layout_stops_every_node_with_exit_code_1(tmp_path, launcher):
    """World size 2 with tp 2 x pp 2: every rank stops before any collective; each node says why."""
    out, port = tmp_path / "run", str(free_port())
    node_args = {"local": [["--launcher", "local", "--nproc", "2"]],
                 "torchrun": [["--launcher", "torchrun", "--nnodes", "2", "--nproc", "1", "--node-rank", str(r),
                               "--master-addr", "127.0.0.1"]
                              for r in (0, 1)]}[launcher]
    procs = [start(["bash", "launch.sh", *a, "--master-port", port, "--", *train_args(out, *LAYOUT)],
                   tmp_path / f"node{i}.log", run_env()) for i, a in enumerate(node_args)]
    assert finish(procs, str(out), timeout=120) == [1] * len(procs)
    for i in range(len(procs)):
        log = (tmp_path / f"node{i}.log").read_text()
        assert log.count("world size 2 is not divisible by parallel.tp_size x parallel.pp_size = 2 x 2 = 4") == 1
    assert not out.exists()


def test_collective_timeout_covers_every_group(tmp_path):
    """With a 2 s timeout, a collective with a stuck rank fails in about 2 s, in the toolkit's groups and in
    groups DeepSpeed creates (torch's new_group would otherwise wait 30 minutes)."""
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent("""\
        import sys, time
        import deepspeed.comm
        import torch
        import torch.distributed as dist
        from parallel.train.run import init_process_groups
        from parallel.distributed.topology import ParallelContext, ParallelDims

        init_process_groups(timeout_s=2)
        ctx = ParallelContext.build(ParallelDims(tp_size=2, pp_size=1, dp_size=1))
        groups = {"tp_group": ctx.tp_group, "deepspeed group": deepspeed.comm.new_group([0, 1])}
        if ctx.rank == 1:
            time.sleep(60)                   # a stuck rank
        for name, group in groups.items():
            start = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1), group=group)
            except RuntimeError:
                print(f"{name}: failed after {time.monotonic() - start:.1f} s", flush=True)
        sys.exit(3)
        """))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL,
                              env=run_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                          MASTER_PORT=port, PYTHONPATH=ROOT)) for r in (0, 1)]
    try:
        out, _ = procs[0].communicate(timeout=50)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    lines = [line for line in out.splitlines() if ": failed after " in line]
    assert [line.split(":")[0] for line in lines] == ["tp_group", "deepspeed group"], out
    for line in lines:
        assert 1.5 <= float(line.split()[-2]) < 10, line
