"""A lost node, the scenario `lose_node_then_rerun` (tests/cli/test_netns_hosts.py::test_lost_node runs it on two
hosts, namespace ones or loopback), and `rows`. Two torchrun nodes train TP2 x DP2 (node 1 holds ranks 2 and 3, the
second data-parallel replica); after a checkpoint node 1's launcher and ranks are killed at once (kill -9, as a
machine that dies). Every surviving process must be gone within 60 s, each surviving rank naming the lost ranks
and the last complete checkpoint; the same training command on the node that remains (dp 1) resumes there, keeps
the global batch by accumulating twice as many micro-batches, and repeats the steps the lost run had trained after
the checkpoint with its losses.
The survivors' collectives fail on the broken connections, so rank 0 names the silent ranks after 5 s
(parallel/distributed/heartbeat.py); train.collective_timeout_s=20 bounds the silent-machine case at 10 s."""
import json
import time

import torch

from parallel.checkpoints.checkpoint import complete_steps
from tests.helpers.launchers import finish, kill_marked, kill_node, marked_alive, train_args
from tests.dist_utils import free_port


STEPS = 16


def training(out) -> list[str]:
    """The training command, the same on two nodes (dp 2) and on one (dp 1)."""
    return train_args(out, "--set", "parallel.tp_size=2", "--set", "ckpt.every=2",
                      "--set", "train.collective_timeout_s=20", steps=STEPS)


def node_cmd(rank: int, port: str, out, master: str = "127.0.0.1") -> list[str]:
    return ["bash", "launch.sh", "--launcher", "torchrun", "--nnodes", "2", "--nproc", "2", "--node-rank", str(rank),
            "--master-addr", master, "--master-port", port, "--", *training(out)]


def rows(out) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def lose_node_then_rerun(tmp_path, run, master: str = "127.0.0.1") -> str:
    """The scenario on two nodes that `run(node, cmd, log)` starts a command on (a Popen): node 1 killed after a
    checkpoint, node 0's checks, the rerun on node 0. Returns node 0's log of the lost run."""
    out, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    port = str(free_port())
    procs = [run(r, node_cmd(r, port, out, master), tmp_path / f"node{r}.log") for r in (0, 1)]
    logs = lambda: "".join((tmp_path / f"node{r}.log").read_text()[-2500:] for r in (0, 1))
    try:
        deadline = time.monotonic() + 240
        while not (complete_steps(ckpt) and len(rows(out)) > complete_steps(ckpt)[-1]):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, logs()
            time.sleep(0.2)
        kill_node(procs[1])
        killed = time.monotonic()
        code = procs[0].wait(timeout=60)
        while marked_alive(str(out)):
            assert time.monotonic() - killed < 60, [p.info["cmdline"][:4] for p in marked_alive(str(out))]
            time.sleep(0.5)
        gone_after = time.monotonic() - killed
        procs[1].wait(timeout=10)
    finally:
        kill_marked(str(out))
    log0 = (tmp_path / "node0.log").read_text()
    assert code != 0, log0[-3000:]
    last = complete_steps(ckpt)[-1]
    trained = len(rows(out))
    assert trained < STEPS, "the run ended before node 1 was killed"
    for rank in (0, 1):       # each on a line of its own (rank 0's progress bar may precede it)
        line = next((x for x in log0.splitlines() if x.startswith(f"rank {rank}: lost rank(s) ")), None)
        assert line is not None, log0[-3000:]
        assert line.startswith(f"rank {rank}: lost rank(s) 2, 3 (host "), line
        assert f"the last complete checkpoint is {ckpt}/step{last}; rerun the same command" in line, line
    print(f"\nnode 1 killed after step {trained} (checkpoint step{last}); node 0 gone in {gone_after:.1f} s")

    # the same training command on the node that remains (dp 1): resumes at step{last} from the layout-free copy,
    # twice the micro-batches a step (debug: 2 x 2 x dp 2 -> 2 x 4 x dp 1) keep the global batch, and steps
    # last+1..trained repeat the lost run's losses (another layout: to fp32 round-off)
    one_node = ["bash", "launch.sh", "--launcher", "torchrun", "--nproc", "2", "--master-port", str(free_port()),
                "--", *training(out)]
    proc = run(0, one_node, tmp_path / "rerun.log")
    assert finish([proc], str(out)) == [0], (tmp_path / "rerun.log").read_text()[-3000:]
    assert "resuming at dp 1: train.grad_accum_steps=4 keeps the checkpoint's global batch 8" in \
        (tmp_path / "rerun.log").read_text()
    everything = rows(out)
    first, rerun = everything[:trained], everything[trained:]
    assert rerun[0]["resumed_from"] == last and [r["step"] for r in rerun] == list(range(last + 1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rerun[:trained - last]], dtype=torch.float64),
                               torch.tensor([r["loss"] for r in first[last:]], dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    return log0
