"""The `model:` section of the STDiT3 family: the shared fields; positions are the family's one scheme."""
from __future__ import annotations

from typing import ClassVar, Literal

from models.config import ModelConfig


class STDiTConfig(ModelConfig):
    """Open-Sora STDiT3-style (1.2/1.3): spatial + temporal blocks, cross-attention to the caption."""

    # 2D sin-cos added per frame, 1D rotary in temporal attention.
    POS_EMBEDS: ClassVar[tuple[str, ...]] = ("sincos2d_rope1d",)
    # Spatial and temporal attention regroup the sequence (per frame, per position): ring attention splits whole
    # frames (ring_size divides the latent frames, sp the tokens; parallel/check.py).
    RING_FRAMES: ClassVar[bool] = True

    family: Literal["stdit"] = "stdit"
