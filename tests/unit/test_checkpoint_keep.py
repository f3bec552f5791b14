"""checkpoint.save's publishing with a stand-in writer, in one gloo process: checksums in the marker, a
flipped byte found by damage(checksums=True), ckpt.keep pruning only after the newest is published and
never a damaged or the last good checkpoint, and a save that fails half-way deleting nothing."""
import json

import pytest
import torch.distributed as dist

from parallel.checkpoints import checkpoint
from parallel.checkpoints.checksums import file_crc32


class Writer:
    """TrainingEngine.save's stand-in: two files per step; `fail` raises after the first (a disk full
    half-way)."""

    def __init__(self, fail=False):
        self.fail = fail

    def save(self, directory, step):
        folder = directory / f"step{step}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model_states.pt").write_bytes(bytes([step]) * 3000)
        if self.fail:
            raise OSError(28, "No space left on device")
        (folder / "optim_states.pt").write_bytes(bytes([step + 1]) * 5000)


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    yield tmp_path / "ckpt"
    dist.destroy_process_group()


def steps(directory):
    return sorted(p.name for p in directory.iterdir() if p.is_dir())


def test_keep_prunes_after_publishing_never_a_damaged_or_the_last_good_and_a_failed_save_keeps_all(one_rank):
    d = one_rank
    for s in (1, 2, 3):
        checkpoint.save(Writer(), d, s, keep=2, layout={})
    assert steps(d) == ["step2", "step3"] and (d / "latest").read_text() == "step3"
    files = json.loads((d / "step3" / checkpoint.MARKER).read_text())["files"]
    assert files == {"model_states.pt": [3000, file_crc32(d / "step3" / "model_states.pt")],
                     "optim_states.pt": [5000, file_crc32(d / "step3" / "optim_states.pt")]}

    victim = d / "step3" / "optim_states.pt"         # a flipped byte: same size, only the checksum tells
    data = bytearray(victim.read_bytes())
    data[1234] ^= 1
    victim.write_bytes(bytes(data))
    assert checkpoint.damage(d / "step3") is None
    assert checkpoint.damage(d / "step3", checksums=True) == (
        f"optim_states.pt has crc32 {file_crc32(victim)}, {files['optim_states.pt'][1]} was written: its bytes "
        f"changed since the save")

    (d / "step2" / "model_states.pt").write_bytes(b"cut")        # damaged by size: never pruned
    checkpoint.save(Writer(), d, 4, keep=1, layout={})
    assert steps(d) == ["step2", "step4"]

    with pytest.raises(checkpoint.CheckpointError, match=r"step5 failed \(OSError: \[Errno 28\] No space left"):
        checkpoint.save(Writer(fail=True), d, 5, keep=1, layout={})
    assert steps(d) == ["step2", "step4"] and (d / "latest").read_text() == "step4"
    assert checkpoint.damage(d / "step4", checksums=True) is None

    checkpoint.save(Writer(), d, 4, keep=1, layout={})            # step4 again: the old one moved aside
    assert steps(d) == ["step2", "step4", "step4.replaced"]
