"""Checkpoints loaded without unpickling code: DeepSpeed's torch checkpoint engine with weights_only=True.

use_weights_only_checkpoints(engine)  (0.19.8)
    does     swaps engine.checkpoint_engine, when exactly TorchCheckpointEngine, for
             WeightsOnlyCheckpointEngine: torch.load(weights_only=True) with LossScaler, ZeroStageEnum and
             fragment_address allowed by name
             that also saves through a CRC-32 of the bytes as they are written (`checksums`: path -> 8 hex
             digits), so the checkpoint's marker records them without reading the files back
    why      TorchCheckpointEngine.load unpickles with weights_only=False: a checkpoint can run any code;
             re-reading a checkpoint to checksum it costs about a third of the save (bench/ckpt_checksums.py)
    relies   engine.checkpoint_engine, engine._config, TorchCheckpointEngine(config_params),
             .load(path, map_location=None) and .save(state_dict, path) (torch.save with
             self.zipfile_serialization), the three classes at their import paths
"""
from __future__ import annotations

import zlib

import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine


class CrcWriter:
    """A binary file that keeps the CRC-32 of what is written through it (torch.save writes to it)."""

    def __init__(self, raw):
        self.raw, self.crc = raw, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        return self.raw.write(data)

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
