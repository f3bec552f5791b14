"""The lost-rank and hang watchdog of a training run: parallel/distributed/heartbeat.py's verdicts turned into the
line a user acts on (which ranks, on which hosts, the checkpoint a rerun resumes from) and exit code 75 (a
rank lost) or 76 (a live rank stuck while the others wait in a collective)."""
from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from parallel.experiment.config import ExperimentConfig
from parallel.distributed.heartbeat import Heartbeat
from parallel.checkpoints import checkpoint


def peer_failure(e: BaseException) -> bool:
    """A collective failed because a peer went away: torch's DistError family (backend and network
    errors), or gloo's plain RuntimeError, which carries gloo's source path."""
    return isinstance(e, dist.DistError) or "/gloo/" in str(e)


LOST_RANK_EXIT = 75      # EX_TEMPFAIL: a peer was lost, rerunning the same command resumes
HUNG_RANK_EXIT = 76      # EX_PROTOCOL: a live rank stuck past train.collective_timeout_s (a rerun may hang again)


def timed_out(e: BaseException) -> bool:
    """A collective that waited out its timeout (gloo: "Timed out waiting ...", torch: DistTimeoutError)."""
    return isinstance(e, getattr(dist, "DistTimeoutError", ())) or "timed out" in str(e).lower() \
        or "timeout" in type(e).__name__.lower()


def restarts_left() -> int:
    """Restarts torchrun's elastic agent still makes after this attempt fails (launch.sh --nnodes MIN:MAX
    --max-restarts N); 0 under any other launcher."""
    env = os.environ
    return max(0, int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))


def store_attempt(environ=None) -> int:
    """The heartbeat's key prefix (Heartbeat's `attempt`): torchrun's restart count where the ranks meet at the
    agent's store, which outlives a restart with the last attempt's keys; 0 where they meet at rank 0's own
    store, new each rendezvous round (launch.sh sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, and torch then sets
    TORCHELASTIC_USE_AGENT_STORE=False). Not the count there: a node that joins a running job starts its
    agent at count 0 while the others' count their restarts, and the ranks would beat under different keys
    (rank 0 would call the newcomers lost)."""
    env = os.environ if environ is None else environ
    return int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0


_COMM_LAYERS = ("torch/distributed/", "deepspeed/comm/")      # wrappers between a caller and the collective


def collective_in(frames: list[traceback.FrameSummary]) -> str:
    """The collective a failed call was in, from its traceback (outermost first): the first torch.distributed
    function entered (all_reduce; all_gather_object rather than the all_gather inside it) and the first frame
    above it outside the communication wrappers, e.g. "all_reduce from deepspeed/runtime/engine.py
    allreduce_bucket"; "" when no torch.distributed function is on the stack."""
    at = next((i for i, f in enumerate(frames) if Path(f.filename).name == "distributed_c10d.py"), None)
    if at is None:
        return ""
    callers = [f for f in frames[:at] if not any(w in Path(f.filename).as_posix() for w in _COMM_LAYERS)]
    if not callers:
        return frames[at].name
    path = "/".join(Path(callers[-1].filename).parts[-3:])
    return f"{frames[at].name} from {path} {callers[-1].name}".replace(":", ".")


def start_heartbeat(cfg: ExperimentConfig, ctx, ckpt_dir: Path):
    """The lost-rank watchdog (parallel/distributed/heartbeat.py) when the ranks met through MASTER_ADDR:PORT:
    a rank silent for half the collective timeout (at most 30 s) is lost; every survivor then prints
    which ranks, on which hosts, and the checkpoint a rerun resumes from, and exits LOST_RANK_EXIT. A live rank
    at the same step and phase (Heartbeat.at) for longer than the collective timeout while another moved on
    or waited out a collective is stuck: every rank prints the stuck ranks, hosts, step and phase, where the
    others wait and the last checkpoint, and exits HUNG_RANK_EXIT."""
    if dist.get_world_size() == 1 or "MASTER_PORT" not in os.environ:
        return None
    lost_after = min(30.0, cfg.train.collective_timeout_s / 2)

    def last_checkpoint() -> str:
        steps = checkpoint.complete_steps(ckpt_dir)
        return f"{ckpt_dir}/step{steps[-1]}" if steps else "none"

    def on_hang(ranks: list[int], text: str) -> None:
        hosts = ", ".join(sorted(set(heartbeat.hosts(ranks))))
        print(f"\nrank {ctx.rank}: hung rank(s) {', '.join(map(str, ranks))} (host {hosts}) {text}, for more than "
              f"train.collective_timeout_s={cfg.train.collective_timeout_s} s; stopping this run; the last complete "
              f"checkpoint: {last_checkpoint()}", file=sys.stderr, flush=True)
        os._exit(HUNG_RANK_EXIT)

    def on_lost(ranks: list[int]) -> None:
        steps = checkpoint.complete_steps(ckpt_dir)
        left = restarts_left()
        rerun = (f"torchrun's elastic agent restarts the run on the nodes that remain ({left} restart(s) left)"
                 if left else "rerun the same command")
        resume = (f"the last complete checkpoint is {ckpt_dir}/step{steps[-1]}; {rerun} to "
                  f"resume there (on fewer nodes: with sizes that fit them, the checkpoint loads into any layout)"
                  if steps else f"there is no complete checkpoint yet ({rerun} to start over)")
        hosts = ", ".join(sorted(set(heartbeat.hosts(ranks))))
        print(f"\nrank {ctx.rank}: lost rank(s) {', '.join(map(str, ranks))} (host {hosts}): their heartbeats "
              f"stopped; stopping this run; {resume}", file=sys.stderr, flush=True)
        os._exit(LOST_RANK_EXIT)        # the main thread may be blocked in a collective that never returns

    heartbeat = Heartbeat(ctx.rank, dist.get_world_size(), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          on_lost, interval_s=1.0, lost_after_s=lost_after, on_hang=on_hang,
                          stuck_after_s=cfg.train.collective_timeout_s,
                          attempt=store_attempt())
    return heartbeat.start()
