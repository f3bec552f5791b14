"""A live rank stuck past train.collective_timeout_s ends the run (parallel/distributed/heartbeat.py's hang rule,
parallel/train/watchdog.py): under the deepspeed launcher at dp 2, rank 1 sleeps inside step K's
forward/backward while its heartbeat thread beats on; rank 0 waits in the step's gradient all-reduce until
gloo's timeout. Both ranks then print one line naming rank 1, step K and the phase, and the collective rank 0
waits in (DeepSpeed's gradient all_reduce, found in its traceback), the launcher exits with
HUNG_RANK_EXIT within the timeout + 15 s of step K, and no traceback is printed."""
import os
import subprocess
import sys
import time

import pytest

from parallel.train.watchdog import HUNG_RANK_EXIT
from tests.dist_utils import free_port

pytestmark = pytest.mark.cluster       # tests/conftest.py: the real launchers, signals and hosts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K, TIMEOUT = 2, 8        # a timeout of a few seconds, with room for start-up on a loaded machine

SCRIPT = '''
import os
import sys
import time
import torch.distributed as dist
from parallel.check import load_and_check
from parallel.distributed.topology import read_launch_env
from parallel.plan.memory import run_plan
from parallel.train.trainer import Trainer

argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]       # the launcher's
out, K, timeout = argv[0], int(argv[1]), int(argv[2])


class Stuck(Trainer):
    """Rank 1 sleeps inside step K's forward/backward, far past the collective timeout."""
    n = 0

    def step(self, batches):
        Stuck.n += 1
        if Stuck.n == K:
            # one write (the launcher runs `python -u`: print would write the text and the newline apart,
            # and two ranks entering in the same microsecond would share a line)
            os.write(1, f"rank {dist.get_rank()} entering step {K} at {time.time()}\\n".encode())
            if dist.get_rank() == 1:
                time.sleep(20 * timeout)
        return super().step(batches)


cfg, ds, layout = load_and_check("debug", [f"train.output_dir={out}", "train.max_steps=4", "ckpt.every=1",
                                           f"train.collective_timeout_s={timeout}"],
                                 "ds_configs/zero0_fp32.json", int(os.environ["WORLD_SIZE"]))
sys.exit(Stuck(cfg, ds, layout, read_launch_env(), resume=False, planner=run_plan).fit())
'''


def test_a_stuck_rank_is_named_by_every_rank_and_the_run_ends(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    p = subprocess.run([deepspeed, "--num_gpus", "2", "--master_port", str(free_port()), str(tmp_path / "script.py"),
                        str(tmp_path / "out"), str(K), str(TIMEOUT)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    ended = time.time()
    log = p.stdout + p.stderr
    assert p.returncode == HUNG_RANK_EXIT, log[-4000:]
    entered = [float(x.rsplit(" ", 1)[1]) for x in p.stdout.splitlines() if f"entering step {K} at " in x]
    assert len(entered) == 2 and ended - max(entered) < TIMEOUT + 15, (ended - max(entered), log[-3000:])
    for rank in (0, 1):
        line = next((x for x in log.splitlines() if x.startswith(f"rank {rank}: hung rank(s) ")), None)
        assert line is not None, log[-4000:]
        assert line.startswith(f"rank {rank}: hung rank(s) 1 (host "), line
        assert f"stuck at step {K} forward/backward, while the others wait in step {K} forward/backward " \
               "(all_reduce from deepspeed/runtime/engine.py allreduce_bucket timed out)" in line, line
        assert f"last complete checkpoint: {tmp_path}/out/checkpoints/step{K - 1}" in line, line
    assert "Traceback" not in log, log[-4000:]
