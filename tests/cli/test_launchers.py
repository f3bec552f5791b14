"""launch.sh on one host: `--launcher local` trains PP2 x TP2 to the same per-step losses as `deepspeed --num_gpus 4
train.py`, inside a Slurm allocation it picks srun, a killed rank takes the whole run down and its exit code reaches
the caller, and a collective with a stuck rank times out in every group. The launchers that span hosts (pdsh over
ssh, Open MPI, torchrun and `deepspeed --no_ssh` on two nodes, Slurm's sbatch, a refused layout, a lost node) run
once each in tests/cli/test_netns_hosts.py, on namespace hosts or, where none can be made, on loopback.

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


def launch(*launcher_args, out):
    """One `launch.sh ... -- train.py` run of the PP2 x TP2 layout; returns (exit code, its output)."""
    log = f"{out}.log"
    proc = start(["bash", "launch.sh", *launcher_args, "--", *train_args(out, *LAYOUT)], log, run_env())
    code, = finish([proc], str(out))
    return code, open(log).read()


def test_local_launcher_equals_direct_deepspeed(reference, tmp_path):
    out = tmp_path / "run"
    code, log = launch("--launcher", "local", "--nproc", "4", "--master-port", str(free_port()), out=out)
    assert code == 0, log[-4000:]
    assert "+ deepspeed --num_gpus 4 " in log
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
