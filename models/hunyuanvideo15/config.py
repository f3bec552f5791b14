"""The `model:` section of the HunyuanVideo 1.5 family: the shared fields plus HunyuanVideo 1.5's own."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from models.config import ModelConfig


class HunyuanVideo15Config(ModelConfig):
    """HunyuanVideo 1.5 (diffusers' HunyuanVideo15Transformer3DModel): `num_layers` dual-stream blocks (text and video
    tokens with their own weights, one joint attention), no single-stream ones; flow matching. Defaults are the
    8.3B release's (480p and 720p, T2V and I2V share the transformer's shape).

    The transformer takes 2 in_channels + 1 channels (the noisy latents, the condition latents, a mask: zeros for
    text-to-video, the first frame's latents and a 1 on its frame for image-to-video, `image_condition`:
    models/hunyuanvideo15/image.py) and predicts in_channels.

    The text input [max_text_len, text_embed_dim] carries three encoders' states as rows, in diffusers' order:
    `image_len` SigLIP image states (the first image_dim channels; all zero for text-to-video), `glyph_len` byT5
    states of the caption's quoted text (the first glyph_dim channels), then the Qwen2.5-VL states (the remaining
    rows, text_embed_dim channels). A row whose channels are all zero is padding (the pipelines' masks)."""

    POS_EMBEDS: ClassVar[tuple[str, ...]] = ("rope3d",)      # rotary over (t, h, w) with rope_axes_dim channels
    family: Literal["hunyuanvideo15"] = "hunyuanvideo15"
    num_layers: int = Field(54, ge=1, description="dual-stream blocks")
    num_refiner_layers: int = Field(2, ge=1, description="token refiner blocks on the Qwen2.5-VL states")
    hidden_size: int = 2048
    num_heads: int = 16
    head_dim: int = 128
    time_embed_dim: int = Field(256, description="sinusoidal timestep features (diffusers: 256)")
    in_channels: int = Field(32, ge=1, description="latent channels (the transformer takes 2 x + 1)")
    patch_size: int = 1
    vae_scale_spatial: int = 16
    text_embed_dim: int = Field(3584, ge=1, description="Qwen2.5-VL state width (diffusers' text_embed_dim)")
    glyph_dim: int = Field(1472, ge=1, description="byT5 state width (diffusers' text_embed_2_dim)")
    image_dim: int = Field(1152, ge=1, description="SigLIP image state width (diffusers' image_embed_dim)")
    image_len: int = Field(729, ge=1, description="image rows, first in the text input (the pipelines' 729)")
    glyph_len: int = Field(256, ge=1, description="byT5 rows after them (the pipelines' tokenizer_2_max_length)")
    max_text_len: int = Field(729 + 256 + 1000, ge=3, description="text rows in all: image_len + glyph_len + "
                              "the Qwen2.5-VL tokens (the pipelines' tokenizer_max_length 1000)")
    rope_axes_dim: tuple[int, int, int] = Field((16, 56, 56), description="head_dim channels rotated by frame, "
                                                "row and column position")
    rope_theta: float = Field(256.0, gt=0)
    objective: Literal["v_prediction", "flow_matching"] = "flow_matching"
    image_condition: bool = Field(False, description="image-to-video training and sampling: the first frame's latents "
                                  "and a mask on the condition channels (HunyuanVideo15ImageToVideoPipeline's); "
                                  "false: zeros (text-to-video)")
    task_type: Literal["t2v", "i2v"] = Field("t2v", description="the release's task_type (config.json; the "
                                             "transformer is the same, the pipeline differs)")
    target_size: int = Field(640, ge=1, description="the release's target_size (config.json: the pipeline's "
                             "default resolution class in pixels: 480, 720)")

    @property
    def num_dual_layers(self) -> int:
        """Every block is dual-stream (models/shared/mmdit.py's HunyuanBlock reads this)."""
        return self.num_layers

    @property
    def text_mask(self) -> bool:
        """Padding text rows are never attention keys (HunyuanBlock reads this; HunyuanVideo's switch for Open-Sora
        2.0, which 1.5 does not have)."""
        return True

    @property
    def qwen_len(self) -> int:
        """Qwen2.5-VL rows: the last ones of the text input."""
        return self.max_text_len - self.image_len - self.glyph_len

    @property
    def transformer_in_channels(self) -> int:
        return 2 * self.in_channels + 1

    @model_validator(mode="after")
    def _hunyuan15_dims(self) -> "HunyuanVideo15Config":
        if sum(self.rope_axes_dim) != self.head_dim or any(d % 2 for d in self.rope_axes_dim):
            raise ValueError(f"model.rope_axes_dim={list(self.rope_axes_dim)} must be even and sum to model.head_dim="
                             f"{self.head_dim} (the release: [16, 56, 56] for 128)")
        if self.qwen_len < 1:
            raise ValueError(f"model.max_text_len={self.max_text_len} must exceed model.image_len + model.glyph_len = "
                             f"{self.image_len + self.glyph_len} (the Qwen2.5-VL rows come last; the release: "
                             f"{self.image_len + self.glyph_len + 1000})")
        for key in ("glyph_dim", "image_dim"):
            if getattr(self, key) > self.text_embed_dim:
                raise ValueError(f"model.{key}={getattr(self, key)} exceeds model.text_embed_dim={self.text_embed_dim}"
                                 f": its states travel in the first channels of text rows that wide")
        return self
