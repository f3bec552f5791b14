"""The helpers and fixtures of tests/unit/test_wan22_released.py that other test modules use too: `MIXED`, `inputs`,
`overrides`, `write_release` (a test module imports no other test module)."""
import json

import torch
from diffusers import WanTransformer3DModel

from tests.released_utils import random_release
from tests.helpers.wan import DIFFUSERS_TINY, HEIGHT, WIDTH


BOUNDARY = 0.875
MIXED = [950.0, 3.0]            # row 0 high noise, row 1 low noise


def overrides(folder, *extra) -> list[str]:
    return ["model.num_layers=2", f"data.width={WIDTH * 8}", f"model.init_from={folder}", *extra]


def tiny(seed: int) -> WanTransformer3DModel:
    return random_release(WanTransformer3DModel, seed, **DIFFUSERS_TINY)


def write_release(folder, boundary=BOUNDARY):
    """(folder, (high-noise model, low-noise model)): a WanPipeline-like folder of two transformers."""
    high, low = tiny(0), tiny(1)
    high.save_pretrained(folder / "transformer", max_shard_size="100KB")
    low.save_pretrained(folder / "transformer_2")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "boundary_ratio": boundary}))
    return folder, (high, low)


def inputs(timesteps):
    g = torch.Generator().manual_seed(7)
    return (torch.randn(2, 4, 3, HEIGHT, WIDTH, generator=g), torch.tensor(timesteps), torch.randn(2, 8, 32, generator=g))
