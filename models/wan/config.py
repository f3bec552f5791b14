"""The `model:` section of the Wan 2.1 family: the shared fields with Wan's defaults."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from models.config import ModelConfig


class WanConfig(ModelConfig):
    """Wan 2.1 text-to-video (diffusers' WanTransformer3DModel): self-attention over the video tokens with 3D
    rotary positions, cross-attention to the UMT5 caption; flow matching. Defaults are the release's where the
    1.3B and 14B models agree (time_embed_dim is diffusers' freq_dim, the sinusoidal timestep features)."""

    POS_EMBEDS: ClassVar[tuple[str, ...]] = ("rope3d",)     # head_dim split over (t, h, w): Wan's own rotary

    family: Literal["wan"] = "wan"
    time_embed_dim: int = Field(256, ge=2, description="sinusoidal timestep features (diffusers' freq_dim)")
    text_embed_dim: int = Field(4096, ge=1, description="UMT5 hidden size (diffusers' text_dim)")
    max_text_len: int = Field(512, ge=1, description="UMT5 tokens the caption is padded to")
    objective: Literal["v_prediction", "flow_matching"] = "flow_matching"

    @field_validator("head_dim")
    @classmethod
    def _even_head_dim(cls, value: int) -> int:
        if value % 2 or value < 6:
            raise ValueError(f"Wan's rotary positions rotate channel pairs of (t, h, w) parts of head_dim: "
                             f"model.head_dim={value} must be even and >= 6 (the releases: 128)")
        return value
