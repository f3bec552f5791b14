"""launch.sh picks and prints the launcher command and the master each host uses, runs the checker on
--dry-run, prints its usage on --help; hostfiles are checked line by line."""
import os
import subprocess

import pytest

from parallel.distributed.hostfile import parse_hostfile

pytestmark = pytest.mark.cluster       # tests/conftest.py: the real launchers, signals and hosts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["train.py", "--config", "debug", "--deepspeed_config", "ds_configs/zero1_bf16.json"]


def dry_run(*options, env_extra=None, args=ARGS, lines=False):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR")}
    env.update(env_extra or {})
    p = subprocess.run(["bash", "launch.sh", *options, "--dry-run", "--", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    out = p.stderr.strip().splitlines()
    return p.returncode, out if lines else out[-1] if out else ""


@pytest.mark.parametrize("options, expected", [
    (["--nproc", "4"], "+ deepspeed --num_gpus 4 --master_port 29500 " + " ".join(ARGS)),
    (["--launcher", "torchrun", "--nproc", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3"],
     "+ torchrun --nproc_per_node 2 --nnodes 2 --node_rank 1 --master_addr 10.1.2.3 --master_port 29500 "
     + " ".join(ARGS)),
    (["--nproc", "2", "--nnodes", "1:2", "--max-restarts", "2", "--master-addr", "10.1.2.3"],
     "+ TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 VDP_ELASTIC_WORLDS=2,4 torchrun --nproc_per_node 2 --nnodes 1:2 "
     "--max-restarts 2 --rdzv-backend c10d --rdzv-endpoint 10.1.2.3:29500 --rdzv-id vdp-29500 "
     "--rdzv-conf last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=5 " + " ".join(ARGS)),
    (["--launcher", "openmpi", "--nproc", "8", "--master-port", "6000"],
     "+ MASTER_ADDR=127.0.0.1 MASTER_PORT=6000 mpirun -np 8 --bind-to none "
     + ("--allow-run-as-root " if os.getuid() == 0 else "")
     + "-x MASTER_ADDR -x MASTER_PORT -x PATH -x PYTHONPATH python " + " ".join(ARGS)),
    (["--launcher", "openmpi", "--nproc", "2", "--device", "cpu"],
     "+ DS_ACCELERATOR=cpu MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 mpirun -np 2 --bind-to none "
     + ("--allow-run-as-root " if os.getuid() == 0 else "")
     + "-x DS_ACCELERATOR -x MASTER_ADDR -x MASTER_PORT -x PATH -x PYTHONPATH python " + " ".join(ARGS)),
    (["--device", "npu", "--nproc", "8"],
     "+ DS_ACCELERATOR=npu ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 HCCL_CONNECT_TIMEOUT=1200 HCCL_EXEC_TIMEOUT=1200 "
     "deepspeed --num_gpus 8 --master_port 29500 " + " ".join(ARGS)),
])
def test_dry_run_prints_the_command(options, expected):
    code, line = dry_run(*options)
    assert code == 0 and line == expected


def test_bad_hostfile_is_refused_with_line_numbers(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node1 slots=8\nnode2 slots=eight\nnode1 slots=8\nnode3\n# comment\n")
    code, last = dry_run("--hostfile", str(hosts))
    assert code == 1 and last == f"  - {hosts}:4: expected 'hostname slots=N', got 'node3'"
    assert not os.path.exists(os.path.join(ROOT, ".deepspeed_env"))
    with pytest.raises(ValueError) as e:
        parse_hostfile(hosts)
    assert str(e.value).splitlines() == [f"{hosts}:2: slots=eight is not a positive whole number",
                                         f"{hosts}:3: host node1 is listed twice",
                                         f"{hosts}:4: expected 'hostname slots=N', got 'node3'"]


def test_good_hostfile(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("gpu-07 slots=8  # first\ngpu-08 slots=8\n")
    assert parse_hostfile(hosts) == {"gpu-07": 8, "gpu-08": 8}


def test_help_prints_the_usage():
    p = subprocess.run(["bash", "launch.sh", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stderr == ""
    assert p.stdout.startswith("One entry for every launcher.")
    assert "  launch.sh [--launcher auto|local|deepspeed|torchrun|slurm|openmpi] [--nproc N] [--hostfile FILE]" \
        in p.stdout.splitlines()
    assert "set -euo" not in p.stdout and "\n#" not in p.stdout


@pytest.mark.parametrize("launcher, master", [("deepspeed", None), ("openmpi", "10.231.0.7")])
def test_dry_run_prints_each_hosts_master_and_checks(tmp_path, launcher, master):
    """Hosts given by address (they resolve without DNS): never 127.0.0.1. Over ssh DeepSpeed asks the first
    host for its address itself (`--master_addr` left out); Open MPI's ranks get the first host's."""
    hosts = tmp_path / "hosts"
    hosts.write_text("10.231.0.7 slots=2\n10.231.0.8 slots=2\n")
    args = [*ARGS[:4], "ds_configs/zero0_fp32.json", "--set", "parallel.tp_size=2"]
    code, out = dry_run("--launcher", launcher, "--hostfile", str(hosts), args=args, lines=True)
    assert code == 0, out
    shown = master or "<10.231.0.7's address>"
    assert out[:2] == [f"launch.sh: 10.231.0.7: ranks 0-1, master {shown}:29500",
                       f"launch.sh: 10.231.0.8: ranks 2-3, master {shown}:29500"]
    assert out[-2].startswith("ok: debug tp=2 pp=1 dp=2 (world 4), ZeRO-0 fp32")       # the checker's summary
    assert "127.0.0.1" not in out[-1]
    if master:
        assert out[-1].startswith(f"+ MASTER_ADDR={master} MASTER_PORT=29500 mpirun -np 4 ")
    else:
        assert out[-1].startswith(f"+ deepspeed --hostfile {hosts} --master_port 29500 train.py ")


def test_dry_run_refuses_what_the_checker_refuses():
    code, out = dry_run("--nproc", "2", args=[*ARGS, "--set", "parallel.tp_size=4"], lines=True)
    assert code == 1
    assert out[-2:] == ["train.py refused (1 problem):",
                        "  - world size 2 is not divisible by parallel.tp_size x parallel.pp_size = 4 x 1 = 4; "
                        "world sizes that work are multiples of 4"]


@pytest.mark.parametrize("options, error", [
    (["--launcher", "openmpi", "--master-addr", "127.0.0.1"],
     "--master-addr 127.0.0.1 is a loopback address, but {hosts} lists 10.231.0.7, another machine, "
     "whose ranks would connect to themselves; pass 10.231.0.7's network address"),
    (["--launcher", "torchrun", "--nnodes", "2", "--nproc", "2", "--node-rank", "0"],
     "--nnodes 2: pass --master-addr with node 0's address (the same on every node; 127.0.0.1 only "
     "when every node is this machine)"),
])
def test_loopback_never_reaches_other_hosts(tmp_path, options, error):
    hosts = tmp_path / "hosts"
    hosts.write_text("10.231.0.7 slots=2\n10.231.0.8 slots=2\n")
    with_hosts = ["--hostfile", str(hosts)] if options[1] == "openmpi" else []
    assert dry_run(*options, *with_hosts, lines=True) == (1, ["launch.sh refused (1 problem):",
                                                              "  - " + error.format(hosts=hosts)])


def test_dry_run_counts_the_devices_without_nproc():
    """No --nproc: one rank per device (on a CPU-only machine DeepSpeed's CPU accelerator counts 1)."""
    from parallel.distributed.accelerator import device_count

    code, line = dry_run()
    assert (code, line) == (0, f"+ deepspeed --num_gpus {device_count()} --master_port 29500 " + " ".join(ARGS))


@pytest.mark.parametrize("options, error", [
    (["--nnodes", "1:2", "--launcher", "deepspeed", "--hostfile", "hosts"],
     "--nnodes 1:2 (elastic) runs under torchrun's agent: drop --launcher deepspeed"),
    (["--nnodes", "1:2", "--node-rank", "1"], "--nnodes 1:2 (elastic): the rendezvous numbers the nodes; "
     "drop --node-rank"),
    (["--nproc", "2", "--max-restarts", "2"], "--max-restarts: only an elastic run (--nnodes MIN:MAX) "
     "restarts"),
])
def test_elastic_options_that_cannot_work_are_refused(options, error):
    assert dry_run(*options, lines=True) == (1, ["launch.sh refused (1 problem):", "  - " + error])
