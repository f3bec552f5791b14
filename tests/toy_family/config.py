"""The `model:` section of the toy family: the shared fields, one positional scheme."""
from __future__ import annotations

from typing import ClassVar, Literal

from models.config import ModelConfig


class ToyConfig(ModelConfig):
    """A tiny DiT with per-token timesteps and two timestep experts (tests/toy_family/model.py)."""

    POS_EMBEDS: ClassVar[tuple[str, ...]] = ("sincos3d",)

    family: Literal["toy"] = "toy"
