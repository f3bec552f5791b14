"""Slurm for real, for tests/cli/test_netns_hosts.py::test_slurm_sbatch: `slurm_cluster`, a two-node Slurm cluster
(munged, slurmctld, two slurmd), and `run_sbatch`, the sbatch script of docs/multi-node.md running launch.sh -> srun
-> train.py.

The cluster lives in the caller's temp dir: its own munge key and socket, slurm.conf with ports from free_port,
state, spool and logs under the same dir; the daemons run in the foreground (-D / -F) as children of the test (or
of `wrap`'s nsenter, on namespace hosts) and are stopped on exit. Two nodes on one host (the loopback fallback):
Debian's slurm is built without multiple-slurmd support (two nodes with one NodeHostname are refused), so each node
has its own name and NodeHostname, `slurmd -N <name>` tells each daemon which it is, and both have
NodeAddr=127.0.0.1 and their own Port. The node names need not resolve; launch.sh takes MASTER_ADDR from the first
node's NodeAddr. gVisor-style sandboxes have no cgroups: proctrack/linuxproc and task/none need none.
Slurm, munge: scripts/system-deps.sh installs them (as root)."""
import contextlib
import getpass
import os
import re
import shutil
import subprocess
import textwrap
import time

import psutil
import pytest

from tests.helpers.launchers import ROOT, kill_marked, run_env
from tests.dist_utils import free_port


DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "scancel")


def sbatch_script() -> str:
    """The sbatch script of docs/multi-node.md's "Slurm" section (the block starting with #!/bin/bash)."""
    with open(os.path.join(ROOT, "docs", "multi-node.md")) as f:
        text = f.read()
    section = text.split("\n## Slurm\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(#!/bin/bash\n.*?)```", section, re.DOTALL)
    assert block, "docs/multi-node.md: the Slurm section has no ```bash block starting with #!/bin/bash"
    return block.group(1)


def slurm_conf(d, ports: dict, user: str, addrs: dict, ctld: tuple[str, str]) -> str:
    nodes = "\n".join(f"NodeName={n} NodeHostname={n} NodeAddr={a} Port={ports[n]} CPUs=2" for n, a in addrs.items())
    return textwrap.dedent(f"""\
        ClusterName=vdp-test
        SlurmctldHost={ctld[0]}({ctld[1]})
        SlurmctldPort={ports['slurmctld']}
        SlurmUser={user}
        SlurmdUser={user}
        AuthType=auth/munge
        CredType=cred/munge
        AuthInfo=socket={d}/munge.socket
        StateSaveLocation={d}/state
        SlurmdSpoolDir={d}/spool/%n
        SlurmctldPidFile={d}/slurmctld.pid
        SlurmdPidFile={d}/slurmd.%n.pid
        SlurmctldLogFile={d}/slurmctld.log
        SlurmdLogFile={d}/slurmd.%n.log
        PlugStackConfig={d}/plugstack.conf
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
        JobAcctGatherType=jobacct_gather/none
        AccountingStorageType=accounting_storage/none
        SwitchType=switch/none
        MpiDefault=none
        MailProg=/bin/true
        SchedulerType=sched/builtin
        SelectType=select/cons_tres
        SelectTypeParameters=CR_CPU
        ReturnToService=2
        """) + nodes + "\nPartitionName=debug Nodes=" + ",".join(addrs) + " Default=YES MaxTime=INFINITE State=UP\n"


def local(where: str, cmd: list[str]) -> list[str]:
    """Where a daemon or client command runs ("ctld" or a node's name): here, for the one-host cluster."""
    return cmd


def job_state(job: str, env: dict, timeout: float, wrap=local) -> dict:
    """JobState and ExitCode of a finished job, polled every 0.5 s (sbatch --wait backs off to 32 s); a job
    still running at the timeout is cancelled."""
    deadline = time.monotonic() + timeout
    while True:
        p = subprocess.run(wrap("ctld", ["scontrol", "show", "job", "-o", job]), env=env, capture_output=True,
                           text=True, timeout=30, check=False)
        fields = dict(f.split("=", 1) for f in p.stdout.split() if "=" in f)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return {k: fields[k] for k in ("JobState", "ExitCode")}
        if time.monotonic() > deadline:
            subprocess.run(wrap("ctld", ["scancel", job]), env=env, timeout=30, check=False)
            return {"JobState": f"still {fields.get('JobState')} after {timeout} s", "ExitCode": "-"}
        time.sleep(0.5)


@contextlib.contextmanager
def slurm_cluster(d, addrs: dict, ctld: tuple[str, str], wrap=local):
    """munged here; slurmctld and a slurmd per node (`addrs`: name -> NodeAddr) where `wrap` runs them."""
    missing = [c for c in DAEMONS if not shutil.which(c, path=os.environ["PATH"] + ":/usr/sbin")]
    if missing:
        pytest.fail(f"no Slurm here ({', '.join(missing)} missing): run scripts/system-deps.sh as root "
                    "(apt-get install slurm-wlm munge)")
    tic = time.monotonic()
    d.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    (d / "plugstack.conf").write_text("")
    (d / "munge.key").write_bytes(os.urandom(1024))
    (d / "munge.key").chmod(0o600)
    ports = {name: free_port() for name in ("slurmctld", *addrs)}
    (d / "slurm.conf").write_text(slurm_conf(d, ports, getpass.getuser(), addrs, ctld))
    env = run_env(SLURM_CONF=str(d / "slurm.conf"))
    sbin = lambda name: shutil.which(name, path="/usr/sbin:" + os.environ["PATH"])
    commands = {"munged": [sbin("munged"), "-F", "-f", f"--key-file={d}/munge.key", f"--socket={d}/munge.socket",
                           f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
                "slurmctld": wrap("ctld", [sbin("slurmctld"), "-D", "-f", str(d / "slurm.conf")]),
                **{n: wrap(n, [sbin("slurmd"), "-D", "-N", n, "-f", str(d / "slurm.conf")]) for n in addrs}}
    daemons = {}
    try:
        for name, cmd in commands.items():
            daemons[name] = subprocess.Popen(cmd, env=env, stdout=open(d / f"{name}.out", "w"),
                                             stderr=subprocess.STDOUT)
            if name == "munged":
                while not (d / "munge.socket").exists():
                    assert daemons[name].poll() is None and time.monotonic() - tic < 30, (d / "munged.out").read_text()
                    time.sleep(0.05)
        while True:       # both nodes registered and idle
            p = subprocess.run(wrap("ctld", ["sinfo", "-h", "-N", "-o", "%N %t"]), env=env, capture_output=True,
                               text=True, timeout=30, check=False)
            if sorted(p.stdout.split()) == sorted([*addrs, *["idle"] * len(addrs)]):
                break
            dead = [n for n, proc in daemons.items() if proc.poll() is not None]
            assert not dead and time.monotonic() - tic < 30, \
                f"slurm did not come up ({dead} exited): {p.stdout}{p.stderr}" + \
                "".join((d / f"{n}.out").read_text()[-1500:] for n in daemons)
            time.sleep(0.2)
        print(f"\nslurm cluster up in {time.monotonic() - tic:.1f} s", flush=True)
        yield env
    finally:
        for proc in reversed(daemons.values()):     # the daemon, also where a wrapper (nsenter) started it
            for child in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else ():
                with contextlib.suppress(psutil.Error):
                    child.terminate()
            proc.terminate()
        for proc in daemons.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_sbatch(tmp_path, env: dict, wrap=local) -> tuple[str, int]:
    """docs/multi-node.md's sbatch script for 3 steps into tmp_path/run, submitted where `wrap` says; asserts
    that the job completed and returns its log and master port."""
    out, port = tmp_path / "run", free_port()
    script = tmp_path / "train.sbatch"
    script.write_text(sbatch_script())
    log = tmp_path / "job.log"
    tic = time.monotonic()
    submit = subprocess.run(wrap("ctld", ["sbatch", "--parsable", f"--chdir={ROOT}", f"--output={log}", str(script),
                                          "--set", "train.max_steps=3", "--set", f"train.output_dir={out}"]),
                            env={**env, "MASTER_PORT": str(port)}, capture_output=True, text=True, timeout=60,
                            check=False)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    try:
        state = job_state(job, env, timeout=180, wrap=wrap)
    finally:
        kill_marked(str(out))
    text = log.read_text() if log.exists() else ""
    assert state == {"JobState": "COMPLETED", "ExitCode": "0:0"}, f"{state}\n{text[-4000:]}"
    print(f"sbatch job: {time.monotonic() - tic:.1f} s", flush=True)
    return text, port
