"""parallel/distributed/master.py: the master address each launcher gets; never a loopback address for a
job whose hosts are other machines. Names resolve through a table (no DNS)."""
import pytest

from parallel.distributed import master
from parallel.distributed.master import LaunchError, node_range, plan

TABLE = {"localhost": "127.0.0.1", "127.0.0.1": "127.0.0.1", "gpu-07": "10.0.0.7", "gpu-08": "10.0.0.8",
         "this-node": "127.0.1.1"}     # Debian's /etc/hosts line for the machine's own name


@pytest.fixture(autouse=True)
def names(monkeypatch):
    monkeypatch.setattr(master, "resolve", TABLE.get)
    monkeypatch.setattr(master, "own_address", lambda: "10.0.0.5")   # `hostname -I`'s first address


def hostfile(tmp_path, *hosts):
    path = tmp_path / "hosts"
    path.write_text("".join(f"{h} slots=2\n" for h in hosts))
    return str(path)


def test_deepspeed_over_ssh_leaves_the_master_to_deepspeed(tmp_path):
    p = plan("deepspeed", hostfile(tmp_path, "gpu-07", "gpu-08"))
    assert (p.master, p.world) == ("", 4)
    assert p.lines == ["gpu-07: ranks 0-1, master <gpu-07's address>:29500",
                       "gpu-08: ranks 2-3, master <gpu-07's address>:29500",
                       "master: gpu-07's first `hostname -I` address, which DeepSpeed asks over ssh at launch"]


@pytest.mark.parametrize("launcher, node_rank", [("openmpi", None), ("deepspeed", 1)])
def test_first_host_address_for_open_mpi_and_no_ssh(tmp_path, launcher, node_rank):
    p = plan(launcher, hostfile(tmp_path, "gpu-07", "gpu-08"), node_rank=node_rank)
    assert (p.master, p.world) == ("10.0.0.7", 4)
    assert p.lines[1] == f"gpu-08{' (this node)' if node_rank else ''}: ranks 2-3, master 10.0.0.7:29500"


def test_first_host_naming_this_machine_gets_its_network_address(tmp_path):
    """this-node resolves to 127.0.1.1 here; the other hosts reach it at `hostname -I`'s address."""
    assert plan("openmpi", hostfile(tmp_path, "this-node", "gpu-08")).master == "10.0.0.5"


def test_one_machine_hostfile_uses_loopback(tmp_path):
    assert plan("deepspeed", hostfile(tmp_path, "localhost", "127.0.0.1")).master == "127.0.0.1"
    assert plan("openmpi", hostfile(tmp_path, "localhost")).nproc == 2


def test_loopback_master_for_other_machines_is_refused(tmp_path):
    path = hostfile(tmp_path, "gpu-07", "gpu-08")
    with pytest.raises(LaunchError, match=r"--master-addr 127.0.0.1 is a loopback address, but .* lists gpu-07, "
                                          r"another machine, .*; pass gpu-07's network address"):
        plan("openmpi", path, master_addr="127.0.0.1")
    assert plan("openmpi", path, master_addr="10.9.9.9").master == "10.9.9.9"


def test_unresolvable_first_host_names_the_option(tmp_path):
    with pytest.raises(LaunchError, match="host gpu-99 does not resolve here; pass --master-addr"):
        plan("openmpi", hostfile(tmp_path, "gpu-99", "gpu-08"))


def test_torchrun_on_several_nodes_needs_the_master():
    with pytest.raises(LaunchError, match="--nnodes 2: pass --master-addr with node 0's address"):
        plan("torchrun", nproc=2, nnodes=2, node_rank=1)
    p = plan("torchrun", master_addr="10.0.0.7", nproc=2, nnodes=2, node_rank=1)
    assert (p.master, p.world, p.lines[0]) == ("10.0.0.7", 4, "node 1 of 2: ranks 2-3, master 10.0.0.7:29500")
    assert plan("local", nproc=4).master == "127.0.0.1"


def test_slurm_first_node_address(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu-[07-08]")
    monkeypatch.setenv("SLURM_NTASKS", "16")

    def scontrol(cmd, **kw):
        out = {"hostnames": "gpu-07\ngpu-08\n", "node": "NodeName=gpu-07 Arch=x86_64 NodeAddr=10.0.0.7 Port=0"}
        return type("Done", (), {"stdout": out[cmd[2]]})

    monkeypatch.setattr(master.subprocess, "run", scontrol)
    p = plan("slurm")
    assert (p.master, p.world) == ("10.0.0.7", 16)
    assert p.lines == ["gpu-07: master 10.0.0.7:29500", "gpu-08: master 10.0.0.7:29500",
                       "master: NodeAddr of gpu-07, the allocation's first node"]
    assert plan("slurm", master_addr="10.1.1.1").master == "10.1.1.1"


def test_an_elastic_range_plans_its_largest_world_under_torchrun():
    """--nnodes MIN:MAX: torchrun's agent, a rendezvous host named, the largest world checked; the rest refused."""
    p = plan("torchrun", master_addr="10.0.0.7", nproc=2, nnodes="1:3")
    assert (p.master, p.world, p.nproc) == ("10.0.0.7", 6, 2)
    assert p.lines[0] == ("elastic: 1 to 3 nodes of 2 ranks (world 2, 4, 6), c10d rendezvous at 10.0.0.7:29500, "
                          "which numbers the nodes")
    with pytest.raises(LaunchError, match="--nnodes 1:2: pass --master-addr with the rendezvous host's address"):
        plan("torchrun", nproc=2, nnodes="1:2")
    with pytest.raises(LaunchError, match=r"--nnodes 1:2 \(elastic\) runs under torchrun's agent"):
        plan("openmpi", master_addr="10.0.0.7", nproc=2, nnodes="1:2")
    for bad in ("2:1", "0:2", "1:2:3", "x"):
        with pytest.raises(LaunchError, match=f"--nnodes {bad}: give a node count"):
            node_range(bad)
