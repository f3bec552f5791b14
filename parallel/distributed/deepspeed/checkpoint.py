"""Checkpoints loaded without unpickling code: DeepSpeed's torch checkpoint engine with weights_only=True.

use_weights_only_checkpoints(engine)  (0.19.8)
    does     swaps engine.checkpoint_engine, when exactly TorchCheckpointEngine, for
             WeightsOnlyCheckpointEngine: torch.load(weights_only=True) with LossScaler, ZeroStageEnum and
             fragment_address allowed by name
             that also saves through a CRC-32 of the bytes as they are written (`checksums`: path -> 8 hex
             digits), so the checkpoint's marker records them without reading the files back
    why      TorchCheckpointEngine.load unpickles with weights_only=False: a checkpoint can run any code;
             re-reading a checkpoint to checksum it reads every byte again after the save, hashing inline
             adds the CRC's time to the write's; CrcWriter overlaps the two (2 ranks on the shared 2-core
             test machine, save time over the plain save's: 1.3B, read back 1.56x, inline 0.99x,
             overlapped 0.89x; 1e8 at load 4-6, 1.45x, 1.64x, 1.08x, more when no core is idle:
             docs/training.md, "Checksum cost")
    relies   engine.checkpoint_engine, engine._config, TorchCheckpointEngine(config_params),
             .load(path, map_location=None) and .save(state_dict, path) (torch.save with
             self.zipfile_serialization), the three classes at their import paths
"""
from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

INLINE = 1 << 20        # writes below this are hashed on the caller's thread: a hop to the helper costs more
_helper: ThreadPoolExecutor | None = None


def _crc_thread() -> ThreadPoolExecutor:
    """The one helper thread CRC-32s run on (created on first use; one is enough: a CRC is sequential)."""
    global _helper
    if _helper is None:
        _helper = ThreadPoolExecutor(1, thread_name_prefix="crc32")
    return _helper


class CrcWriter:
    """A binary file that keeps the CRC-32 of what is written through it (torch.save writes to it).

    A write of `inline_below` bytes or more (torch.save's tensor storages, one write each) is hashed by a
    helper thread while this thread writes the same buffer: zlib.crc32 and the file write both release the
    GIL, so a chunk costs max(write, crc) rather than their sum. write() waits for its chunk's CRC before it
    returns, so the caller may reuse the buffer at once (no copy) and the CRCs chain in order (returning at
    once with a copy for the helper was slower: 2.42 s against 1.03 s, and 0.86 s unhashed, for 400 MB in
    one process on the loaded test machine). Smaller writes (headers, pickle records: most of torch.save's
    calls, few of its bytes) are hashed inline: a hop to the helper costs about 6% of a 1 MiB CRC.
    `inline_below=math.inf`: every write hashed inline (the bench's comparison)."""

    def __init__(self, raw, inline_below: float = INLINE):
        self.raw, self.crc, self.inline_below = raw, 0, inline_below

    def write(self, data) -> int:
        view = memoryview(data)
        if view.nbytes < self.inline_below:
            self.crc = zlib.crc32(view, self.crc)
            return self.raw.write(view)
        crc = _crc_thread().submit(zlib.crc32, view, self.crc)
        try:
            return self.raw.write(view)
        finally:
            self.crc = crc.result()             # before returning: the buffer is the caller's again

    def flush(self) -> None:
        self.raw.flush()

    def hexdigest(self) -> str:
        return f"{self.crc:08x}"


def safe_globals() -> list[type]:
    """The DeepSpeed records its optimizers pickle into checkpoints, allowed by name under weights_only."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, ZeroStageEnum, fragment_address]


class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, loading with `weights_only=True`: a checkpoint file can hold
    tensors, containers, plain values and the three DeepSpeed records its optimizers save (allowed by
    name), never code that runs when it is loaded."""

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.checksums: dict[str, str] = {}

    def load(self, path: str, map_location=None):
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)

    def save(self, state_dict, path: str):
        with open(path, "wb") as raw:
            writer = CrcWriter(raw)
            torch.save(state_dict, writer, _use_new_zipfile_serialization=self.zipfile_serialization)
        self.checksums[str(path)] = writer.hexdigest()


def use_weights_only_checkpoints(engine) -> None:
    """Load this engine's checkpoints with weights_only=True (other checkpoint engines are left alone)."""
    if type(engine.checkpoint_engine) is TorchCheckpointEngine:
        engine.checkpoint_engine = WeightsOnlyCheckpointEngine(engine._config)


def written_checksums(engine):
    """The engine's {path: crc32} of the files its checkpoint engine has written (WeightsOnlyCheckpointEngine),
    to clear before a save and read after it; None for another checkpoint engine."""
    return getattr(engine.checkpoint_engine, "checksums", None)
