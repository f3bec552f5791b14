"""The checker's part of LoRA: model.lora.targets against the model built on the meta device, before any
process group (parallel/check.py calls it; parallel/model/lora.py does the matching)."""
from __future__ import annotations

import torch

from models.config import ModelConfig
from parallel.model.build import layer_specs
from parallel.experiment.config import ExperimentConfig
from parallel.distributed.pipeline import SequentialDiT
from parallel.distributed.topology import ParallelContext
from parallel.model.lora import plan_adapters, released_format


def check_lora(m: ModelConfig) -> list[str]:
    """model.lora against the model: a target matching no adaptable layer is named with those that exist."""
    if m.lora is None:
        return []
    try:
        released_format(m)
    except ValueError as e:
        return [f"model.lora: {e}"]
    with torch.device("meta"):
        model = SequentialDiT(layer_specs(ExperimentConfig(model=m.model_copy(update={"lora": None})),
                                          ParallelContext.single()))
    _, hit, names = plan_adapters(model, m)
    missing = [t for t in m.lora.targets if t not in hit]
    if not missing:
        return []
    names = [n.rpartition("/")[2] for n in names]          # each Wan 2.2 A14B expert's names within its transformer
    tails = sorted({n.split(".", 2)[-1] if n.startswith("transformer_blocks.") else n for n in names})
    return [(f"model.lora.targets: {', '.join(missing)} match no tensor-parallel linear layer of "
             f"model.family={m.family}; targets that exist (released module names): {', '.join(tails)}")]
