"""Checkpoints loaded without unpickling code: DeepSpeed's torch checkpoint engine with weights_only=True.

use_weights_only_checkpoints(engine)  (0.19.8)
    does     swaps engine.checkpoint_engine, when exactly TorchCheckpointEngine, for
             WeightsOnlyCheckpointEngine: torch.load(weights_only=True) with LossScaler, ZeroStageEnum and
             fragment_address allowed by name
    why      TorchCheckpointEngine.load unpickles with weights_only=False: a checkpoint can run any code
    relies   engine.checkpoint_engine, engine._config, TorchCheckpointEngine(config_params) and
             .load(path, map_location=None), the three classes at their import paths
"""
from __future__ import annotations

import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine


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

    def load(self, path: str, map_location=None):
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)


def use_weights_only_checkpoints(engine) -> None:
    """Load this engine's checkpoints with weights_only=True (other checkpoint engines are left alone)."""
    if type(engine.checkpoint_engine) is TorchCheckpointEngine:
        engine.checkpoint_engine = WeightsOnlyCheckpointEngine(engine._config)
