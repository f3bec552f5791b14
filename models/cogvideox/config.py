"""The `model:` section of the CogVideoX family: the shared fields plus CogVideoX's own."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from models.config import ModelConfig


class CogVideoXConfig(ModelConfig):
    """CogVideoX (1.0, 2B and 5B): full 3D attention over text + video tokens; defaults are 2B's."""

    POS_EMBEDS: ClassVar[tuple[str, ...]] = ("sincos", "rope3d")   # 2B: 3D sin-cos added; 5B: 3D rotary

    family: Literal["cogvideox"] = "cogvideox"
    flip_sin_to_cos: bool = Field(True, description="timestep embedding order [cos, sin] (CogVideoX) or [sin, cos]")
    freq_shift: float = Field(0.0, description="timestep frequencies exp(-ln(1e4) i / (dim/2 - freq_shift))")
    spatial_interpolation_scale: float = Field(1.875, gt=0, description="sin-cos positions: (h, w) divided by it")
    temporal_interpolation_scale: float = Field(1.0, gt=0, description="sin-cos positions: frames divided by it")
    sample_height: int = Field(60, ge=1, description="latent height the model was trained at; rope3d positions "
                               "of other sizes are fitted into its patch grid (diffusers' sample_height)")
    sample_width: int = Field(90, ge=1, description="latent width, likewise (diffusers' sample_width)")
