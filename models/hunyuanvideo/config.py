"""The `model:` section of the HunyuanVideo family: the shared fields plus HunyuanVideo's own."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from models.config import ModelConfig

# HunyuanVideoPipeline's default guidance_scale: the distilled guidance the transformer embeds (x 1000).
EMBEDDED_GUIDANCE = 6.0


class HunyuanVideoConfig(ModelConfig):
    """HunyuanVideo text-to-video (diffusers' HunyuanVideoTransformer3DModel): `num_dual_layers` dual-stream blocks
    then num_layers - num_dual_layers single-stream blocks, one list (pipeline stages split it anywhere);
    flow matching. Defaults are the release's.

    The text input [L, text_embed_dim] carries two encoders: each row is one LLaMA token state (the first
    text_embed_dim - pooled_projection_dim channels; a padding row is zero there) followed by the caption's
    CLIP pooled vector (the last pooled_projection_dim channels, the same on every row), so the data path's
    one text tensor per sample holds both; diffusers' text_embed_dim is `llama_dim`."""

    POS_EMBEDS: ClassVar[tuple[str, ...]] = ("rope3d",)      # rotary over (t, h, w) with rope_axes_dim channels

    family: Literal["hunyuanvideo"] = "hunyuanvideo"
    num_layers: int = Field(60, ge=1, description="dual-stream + single-stream blocks (the release: 20 + 40)")
    num_dual_layers: int = Field(20, ge=0, description="the first blocks, dual-stream (diffusers' num_layers)")
    num_refiner_layers: int = Field(2, ge=0, description="token refiner blocks on the LLaMA states; 0: the text "
                                    "rows through one linear alone (Open-Sora 2.0's txt_in), no refiner embedders")
    guidance_embed: bool = Field(True, description="the embedded (distilled) guidance term in the modulation "
                                 "vector (HunyuanVideo); false: timestep + pooled vector alone (Open-Sora 2.0)")
    text_mask: bool = Field(True, description="padding text rows (all-zero text channels) are no attention key "
                            "(HunyuanVideo); false: every text row is a key (Open-Sora 2.0's unmasked attention)")
    text_encoder: Literal["llama_clip", "t5_clip"] = Field(
        "llama_clip", description="how data.text_encoder / prepare_data --t5 encode a caption "
        "(models/hunyuanvideo/captions.py): llama_clip, HunyuanVideoPipeline's LLaMA template + CLIP pooled vector; "
        "t5_clip, Open-Sora 2.0's T5 states (no mask, max_text_len tokens) + CLIP pooled vector")
    cond_embed: bool = Field(False, description="Open-Sora 2.0's cond_in: a linear of (in_channels + 1) x "
                             "patch volume inputs (a mask channel + condition latents, patched as the video) added "
                             "to the patch embedding; text-to-video feeds it zeros")
    train_timesteps: Literal["uniform", "opensora"] = Field(
        "uniform", description="the training draw (models/hunyuanvideo/opensora2.py): uniform, integer timesteps "
        "shifted by model.schedule.shift; opensora, Open-Sora 2.0's sigmoid of a normal draw shifted by the "
        "sample's own resolution (flow_matching, 2 x 2 patches)")
    hidden_size: int = 3072
    num_heads: int = 24
    head_dim: int = 128
    time_embed_dim: int = Field(256, description="sinusoidal timestep (and guidance) features (diffusers: 256)")
    text_embed_dim: int = Field(4096 + 768, ge=2, description="channels of a text row: LLaMA state (4096) + CLIP "
                                "pooled vector (pooled_projection_dim)")
    pooled_projection_dim: int = Field(768, ge=1, description="CLIP pooled vector width (the last channels of "
                                       "every text row)")
    max_text_len: int = Field(256, ge=1, description="LLaMA tokens (HunyuanVideoPipeline's max_sequence_length)")
    rope_axes_dim: tuple[int, int, int] = Field((16, 56, 56), description="head_dim channels rotated by frame, "
                                                "row and column position")
    rope_theta: float = Field(256.0, gt=0)
    objective: Literal["v_prediction", "flow_matching"] = "flow_matching"

    @property
    def llama_dim(self) -> int:
        """diffusers' text_embed_dim: the LLaMA states' width."""
        return self.text_embed_dim - self.pooled_projection_dim

    @property
    def num_single_layers(self) -> int:
        return self.num_layers - self.num_dual_layers

    @model_validator(mode="after")
    def _hunyuan_dims(self) -> "HunyuanVideoConfig":
        if self.num_dual_layers > self.num_layers:
            raise ValueError(f"model.num_dual_layers={self.num_dual_layers} exceeds model.num_layers="
                             f"{self.num_layers} (dual-stream + single-stream blocks)")
        if sum(self.rope_axes_dim) != self.head_dim or any(d % 2 for d in self.rope_axes_dim):
            raise ValueError(f"model.rope_axes_dim={list(self.rope_axes_dim)} must be even and sum to model.head_dim="
                             f"{self.head_dim} (the release: [16, 56, 56] for 128)")
        if self.train_timesteps == "opensora" and (self.objective != "flow_matching" or self.patch_size != 2):
            raise ValueError(f"model.train_timesteps=opensora is Open-Sora 2.0's flow-matching draw on 2 x 2 patches; "
                             f"model.objective={self.objective}, model.patch_size={self.patch_size}: set "
                             f"model.objective=flow_matching and model.patch_size=2, or model.train_timesteps=uniform")
        if self.pooled_projection_dim >= self.text_embed_dim:
            raise ValueError(f"model.text_embed_dim={self.text_embed_dim} is the LLaMA width plus model."
                             f"pooled_projection_dim={self.pooled_projection_dim}; it must be larger")
        return self
