"""The lost-rank rule of parallel/distributed/heartbeat.py, without a store: who is declared lost, and when."""
import traceback

from parallel.distributed.heartbeat import describe_hang, lost_ranks, stuck_ranks, threshold
from parallel.train.watchdog import collective_in, store_attempt


def test_nobody_lost_before_the_threshold():
    assert lost_ranks({0: 100.0, 1: 99.0, 2: 91.0}, set(), now=100.0, lost_after_s=10) == []


def test_a_node_is_lost_together():
    """Ranks 2 and 3 died together, their last beats a second apart: both are named when 3 crosses 10 s."""
    seen = {0: 100.0, 1: 99.5, 2: 90.5, 3: 89.5}
    assert lost_ranks(seen, set(), now=100.0, lost_after_s=10) == [2, 3]


def test_finished_ranks_are_not_lost():
    assert lost_ranks({0: 100.0, 1: 50.0, 2: 80.0}, {1}, now=100.0, lost_after_s=10) == [2]


def test_a_broken_connection_shortens_the_wait():
    """After a peer's collective failed (suspect), 5 one-second intervals of silence suffice, not 30 s."""
    seen = {0: 100.0, 1: 99.5, 2: 94.0, 3: 93.5}
    assert lost_ranks(seen, set(), 100.0, threshold(30, 1.0, suspected=False)) == []
    assert lost_ranks(seen, set(), 100.0, threshold(30, 1.0, suspected=True)) == [2, 3]


def test_a_live_rank_is_stuck_only_past_the_timeout_and_behind_the_others():
    """Rank 1 sat in step 3's forward/backward (phase 0) for 6 s while rank 0 waits on a timed-out collective
    there, or rank 0 moved on to step 3's checkpoint save (phase 2): rank 1 is stuck past 5 s, not before,
    and never while every rank sits at the same place without a timed-out collective."""
    since = {0: 94.0, 1: 94.0}
    assert stuck_ranks({0: (3, 0), 1: (3, 0)}, since, {0}, now=100.0, stuck_after_s=5) == [1]
    assert stuck_ranks({0: (3, 0), 1: (3, 0)}, since, {0}, now=98.0, stuck_after_s=5) == []
    assert stuck_ranks({0: (3, 2), 1: (3, 0)}, since, set(), now=100.0, stuck_after_s=5) == [1]
    assert stuck_ranks({0: (3, 0), 1: (3, 0)}, since, set(), now=100.0, stuck_after_s=5) == []
    assert stuck_ranks({0: (3, 0), 1: (3, 0)}, since, {0, 1}, now=100.0, stuck_after_s=5) == []
    assert describe_hang({0: (3, 0), 1: (3, 0)}, [1], {0: ""}) == \
        "stuck at step 3 forward/backward, while the others wait in step 3 forward/backward (collective timed out)"
    assert describe_hang({0: (3, 0), 1: (3, 0), 2: (3, 0)}, [1], {0: "broadcast", 2: "broadcast"}) == \
        "stuck at step 3 forward/backward, while the others wait in step 3 forward/backward (broadcast timed out)"


def test_the_collective_is_named_from_the_traceback():
    """The first torch.distributed function entered (all_gather_object, not the all_gather it calls) and the
    first caller outside torch.distributed and deepspeed.comm; nothing without a torch.distributed frame."""
    site = "/venv/lib/python3.11/site-packages"
    frame = lambda path, name: traceback.FrameSummary(path, 1, name)
    stack = [frame("/repo/parallel/train/trainer.py", "fit"), frame("/repo/parallel/checkpoints/checkpoint.py", "_write"),
             frame(f"{site}/torch/distributed/c10d_logger.py", "wrapper"),
             frame(f"{site}/torch/distributed/distributed_c10d.py", "all_gather_object"),
             frame(f"{site}/torch/distributed/distributed_c10d.py", "all_gather")]
    assert collective_in(stack) == "all_gather_object from parallel/checkpoints/checkpoint.py _write"
    stack = [frame(f"{site}/deepspeed/runtime/engine.py", "allreduce_bucket"),
             frame(f"{site}/deepspeed/comm/comm.py", "all_reduce"), frame(f"{site}/deepspeed/comm/torch.py", "all_reduce"),
             frame(f"{site}/torch/distributed/distributed_c10d.py", "all_reduce")]
    assert collective_in(stack) == "all_reduce from deepspeed/runtime/engine.py allreduce_bucket"
    assert collective_in(stack[:2]) == ""


def test_the_ranks_of_a_round_beat_under_one_prefix():
    """A node that joins an elastic run starts its agent at restart count 0 while vdp-node0's counts 1: at
    launch.sh's rank-0 store (new each round, TORCHELASTIC_USE_AGENT_STORE=False) the keys take no count, so
    every rank of the round beats where rank 0 reads; torchrun's shared agent store keeps the last attempt's
    keys, and there the count (the same on every node until a node joins) keeps them apart."""
    own = {"TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert [store_attempt({**own, "TORCHELASTIC_RESTART_COUNT": n}) for n in ("1", "0")] == [0, 0]
    assert store_attempt({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert store_attempt({}) == 0
