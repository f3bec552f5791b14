"""A save that fails on one rank (torch.save's error from a full disk) stops every rank with the same
CheckpointError, removes the partial folder and leaves `latest` at the last complete checkpoint."""
import json
from pathlib import Path

import torch.distributed as dist

from parallel.checkpoints import checkpoint
from tests.dist_utils import run_ranks


class DiskFillsOnRank1:
    def save(self, directory, step):
        folder = Path(directory) / f"step{step}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{dist.get_rank()}.pt").write_bytes(b"x" * 1000)
        if step == 6 and dist.get_rank() == 1:
            raise RuntimeError("basic_ios::clear: iostream error")


def _run(rank, world_size, directory):
    directory = Path(directory)
    checkpoint.save(DiskFillsOnRank1(), directory, 3, keep=2, layout={})
    try:
        checkpoint.save(DiskFillsOnRank1(), directory, 6, keep=2, layout={})
    except checkpoint.CheckpointError as e:
        return str(e)
    return None


def test_a_save_failing_on_one_rank_stops_all_with_the_checkpoint_to_resume(tmp_path):
    messages = run_ranks(_run, 2, str(tmp_path), timeout=120)
    assert messages[0] == messages[1] and messages[0] is not None
    assert messages[0].startswith(f"checkpoint save to {tmp_path}/step6 failed (RuntimeError: basic_ios::clear: "
                                  f"iostream error): needs ~2.")
    assert messages[0].endswith(f"free on that filesystem; the last complete checkpoint is {tmp_path}/step3 "
                                f"(resume with the same command once there is space)")
    assert (tmp_path / "latest").read_text() == "step3" and not (tmp_path / "step6").exists()
    assert json.loads((tmp_path / "step3" / checkpoint.MARKER).read_text())["step"] == 3
