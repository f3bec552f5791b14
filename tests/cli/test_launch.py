"""launch.sh picks and prints the launcher command; hostfiles are checked line by line."""
import os
import subprocess

import pytest

from parallel.distributed.hostfile import parse_hostfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["train.py", "--config", "debug", "--deepspeed_config", "ds_configs/zero1_bf16.json"]


def dry_run(*options, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "OMP_NUM_THREADS"}
    env.update(env_extra or {})
    p = subprocess.run(["bash", "launch.sh", *options, "--dry-run", "--", *ARGS], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    return p.returncode, p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""


@pytest.mark.parametrize("options, expected", [
    (["--nproc", "4"], "+ deepspeed --num_gpus 4 --master_port 29500 " + " ".join(ARGS)),
    (["--launcher", "torchrun", "--nproc", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3"],
     "+ torchrun --nproc_per_node 2 --nnodes 2 --node_rank 1 --master_addr 10.1.2.3 --master_port 29500 "
     + " ".join(ARGS)),
    (["--launcher", "openmpi", "--nproc", "8", "--master-port", "6000"],
     "+ MASTER_ADDR=127.0.0.1 MASTER_PORT=6000 mpirun -np 8 --bind-to none "
     + ("--allow-run-as-root " if os.getuid() == 0 else "")
     + "-x MASTER_ADDR -x MASTER_PORT -x PATH -x PYTHONPATH python " + " ".join(ARGS)),
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
    assert code == 2 and last == f"{hosts}:4: expected 'hostname slots=N', got 'node3'"
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
