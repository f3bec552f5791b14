"""The helpers and fixtures of the launcher tests (tests/cli/test_launchers.py, test_netns_hosts.py): `LAYOUT`, `ROOT`,
`finish`, `kill_marked`, `kill_node`, `losses`, `marked_alive`, `reference_losses`, `run_env`, `start`, `train_args`
(a test module imports no other test module)."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.dist_utils import free_port
from tests.helpers.launch_env import without_launcher_vars


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUT = ["--set", "parallel.tp_size=2", "--set", "parallel.pp_size=2"]


def train_args(out, *extra, steps=3):
    return ["train.py", "--config", "debug", "--deepspeed_config", "ds_configs/zero0_fp32.json",
            "--set", f"train.max_steps={steps}", "--set", f"train.output_dir={out}", *extra]


def run_env(**extra):
    env = {k: v for k, v in without_launcher_vars().items() if not k.startswith(("SLURM_", "OMPI_"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def kill_marked(marker: str) -> None:
    """Kill every process whose command line names `marker` (a test's own temp path)."""
    for p in psutil.process_iter(["cmdline"]):
        if p.pid != os.getpid() and any(marker in a for a in p.info["cmdline"] or ()):
            try:
                p.kill()
            except psutil.Error:
                pass


def kill_node(proc) -> None:
    """Kill a node's launcher (torchrun, or nsenter before it) and every process under it at once (kill -9, as a
    machine that dies)."""
    launcher = psutil.Process(proc.pid)
    for p in [launcher, *launcher.children(recursive=True)]:
        p.send_signal(signal.SIGKILL)


def marked_alive(marker: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline", "status"])
            if any(marker in a for a in p.info["cmdline"] or ()) and p.info["status"] != psutil.STATUS_ZOMBIE]


def start(cmd, log, env):
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)


def finish(procs, marker, timeout=240):
    """Exit codes of launcher processes started together; on a timeout everything marked is killed."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1, deadline - time.monotonic())) for p in procs]
    finally:
        kill_marked(marker)


def losses(out):
    return [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))]


def reference_losses(tmp_path_factory):
    """Per-step losses of the direct `deepspeed --num_gpus 4 train.py ...` run (the session fixture
    `reference` of tests/cli/conftest.py, shared by the launcher tests). It leaves no shared-memory
    all-reduce buffer behind (DeepSpeed's CPU all-reduce creates one per rank: 4 x 69 MB of RAM a run)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    port = free_port()
    proc = start([deepspeed, "--num_gpus", "4", "--master_port", str(port), *train_args(out, *LAYOUT)],
                 f"{out}.log", run_env())
    code, = finish([proc], str(out))
    assert code == 0, open(f"{out}.log").read()[-4000:]
    assert glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*") == []
    # The run's own check of the memory plan, per pipeline stage (tests/distributed/test_plan_states.py: the
    # other layouts, rank by rank).
    check = json.loads((out / "memory_check.json").read_text())
    assert [s["stage"] for s in check["stages"]] == [0, 1]
    for s in check["stages"]:
        states, acts = s["model_states"], s["activations_per_micro_batch"]
        assert states["measured"] == pytest.approx(states["predicted"], rel=0.01)
        assert acts["measured"] == pytest.approx(acts["predicted"], rel=0.05)
    result = losses(out)
    assert len(result) == 3 and len(set(result)) == 3
    return result
