"""The `model:` section of the CogVideoX family: the shared fields plus CogVideoX's own."""
from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field, model_validator

from models.config import ModelConfig


class CogVideoXConfig(ModelConfig):
    """CogVideoX 1.0 (2B, 5B, 5B-I2V) and 1.5 (5B, 5B-I2V): full 3D attention over text + video tokens;
    defaults are 2B's. 1.5 is `patch_size_t: 2` (temporal patches, the rotary grid of integer positions)."""

    POS_EMBEDS: ClassVar[tuple[str, ...]] = ("sincos", "rope3d")   # 2B: 3D sin-cos added; 5B: 3D rotary

    family: Literal["cogvideox"] = "cogvideox"
    flip_sin_to_cos: bool = Field(True, description="timestep embedding order [cos, sin] (CogVideoX) or [sin, cos]")
    freq_shift: float = Field(0.0, description="timestep frequencies exp(-ln(1e4) i / (dim/2 - freq_shift))")
    spatial_interpolation_scale: float = Field(1.875, gt=0, description="sin-cos positions: (h, w) divided by it")
    temporal_interpolation_scale: float = Field(1.0, gt=0, description="sin-cos positions: frames divided by it")
    sample_height: int = Field(60, ge=1, description="latent height the model was trained at; rope3d positions "
                               "of other sizes are fitted into its patch grid (diffusers' sample_height)")
    sample_width: int = Field(90, ge=1, description="latent width, likewise (diffusers' sample_width)")
    sample_frames: int = Field(49, ge=1, description="video frames the model was trained at (diffusers' "
                               "sample_frames): sizes the learned position table, (F - 1) / 4 + 1 latent frames")
    patch_bias: bool = Field(True, description="bias of the 1.0 patch embedding (1.5: false in config.json, but "
                             "diffusers' temporal patch embedding always has one)")
    image_condition: bool = Field(False, description="image-to-video: the first frame's latent, zero-padded over "
                                  "the frames, is concatenated on channels (the transformer takes 2 x in_channels, "
                                  "predicts in_channels)")
    image_dropout: float = Field(0.05, ge=0, le=1, description="image-to-video training: probability that a "
                                 "sample's image latents are zeros (SAT noised_image_dropout 0.05)")
    learned_positions: bool = Field(False, description="5B-I2V: a stored position table [max_text_len + video "
                                    "tokens, hidden] added after the patch embedding (diffusers' "
                                    "use_learned_positional_embeddings; a buffer, not trained, as in diffusers)")
    ofs_embed_dim: Optional[int] = Field(None, ge=1, description="1.5-I2V: width of the 'ofs' embedding added to "
                                         "the time embedding (the pipelines feed ofs = 2.0)")

    def fixed_position_grid(self) -> Optional[str]:
        return "model.learned_positions=true" if self.learned_positions else super().fixed_position_grid()

    def largest_position_grid(self) -> Optional[tuple[tuple[int, int], str]]:
        if self.pos_embed != "rope3d" or self.rope_grid != "slice":
            return None    # 1.0's rotary table fits any grid into the sample size
        p = self.patch_size
        return ((self.sample_height // p, self.sample_width // p),
                f"model.sample_height={self.sample_height}, model.sample_width={self.sample_width} / "
                f"model.patch_size={p}")

    @model_validator(mode="after")
    def _i2v_parts(self) -> "CogVideoXConfig":
        if self.learned_positions and self.pos_embed != "rope3d":
            raise ValueError("model.learned_positions=true needs model.pos_embed=rope3d (as CogVideoX-5B-I2V; "
                             "diffusers refuses learned positions without rotary ones)")
        if self.ofs_embed_dim is not None and self.ofs_embed_dim != self.time_embed_dim:
            raise ValueError(f"model.ofs_embed_dim={self.ofs_embed_dim} must equal model.time_embed_dim="
                             f"{self.time_embed_dim}: the ofs embedding is added to the time embedding")
        return self

    @property
    def transformer_in_channels(self) -> int:
        """Channels of the transformer's input: the noisy latent, and the image latent under image_condition."""
        return 2 * self.in_channels if self.image_condition else self.in_channels

    @property
    def rope_grid(self) -> str:
        """diffusers' grid_type: 1.0 fits the grid into the sample size ("linspace"), 1.5 (temporal patches)
        takes integer positions ("slice"), as CogVideoXPipeline._prepare_rotary_positional_embeddings does."""
        return "slice" if self.patch_size_t > 1 else "linspace"
