"""The `model:` section of the Wan 2.1 family: the shared fields with Wan's defaults."""
from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field, field_validator, model_validator

from models.config import ModelConfig, Section

# diffusers' WanAttnProcessor takes the last 512 cross-attention tokens as the caption ("512 is the context
# length of the text encoder, hardcoded for now"), the ones before them as the image.
I2V_TEXT_LEN = 512


class WanExperts(Section):
    """Wan 2.2 A14B: a high-noise and a low-noise transformer (models/wan/experts.py)."""

    boundary_ratio: float = Field(gt=0, lt=1, description="the pipeline's boundary_ratio: model timesteps t >= "
                                  "boundary_ratio x 1000 go to the high-noise expert (transformer/), the rest to the "
                                  "low-noise one (transformer_2/); T2V-A14B 0.875, I2V-A14B 0.9")
    train: Literal["both", "high_noise", "low_noise"] = Field("both", description="both experts in one run (each "
                                                              "sample through the expert its timestep picks), or "
                                                              "one expert with training timesteps in its band")

    @field_validator("boundary_ratio")
    @classmethod
    def _whole_timestep(cls, value: float) -> float:
        if abs(value * 1000 - round(value * 1000)) > 1e-6:
            raise ValueError(f"model.experts.boundary_ratio={value}: boundary_ratio x 1000 must be a whole timestep "
                             f"(the releases: 0.875, 0.9)")
        return value


class WanConfig(ModelConfig):
    """Wan 2.1 text-to-video (diffusers' WanTransformer3DModel): self-attention over the video tokens with 3D
    rotary positions, cross-attention to the UMT5 caption; flow matching. Defaults are the release's where the
    1.3B and 14B models agree (time_embed_dim is diffusers' freq_dim, the sinusoidal timestep features).
    Image-to-video (Wan 2.1 I2V 14B): `image_condition` (36 input channels) and `image_dim` /
    `added_kv_proj_dim` (a cross-attention to the CLIP image tokens beside the caption's)."""

    POS_EMBEDS: ClassVar[tuple[str, ...]] = ("rope3d",)     # head_dim split over (t, h, w): Wan's own rotary

    family: Literal["wan"] = "wan"
    time_embed_dim: int = Field(256, ge=2, description="sinusoidal timestep features (diffusers' freq_dim)")
    text_embed_dim: int = Field(4096, ge=1, description="UMT5 hidden size (diffusers' text_dim)")
    max_text_len: int = Field(512, ge=1, description="UMT5 tokens the caption is padded to")
    objective: Literal["v_prediction", "flow_matching"] = "flow_matching"
    image_condition: bool = Field(False, description="image-to-video: the transformer takes the noisy latent, a "
                                  "first-frame mask (model.vae_scale_temporal channels) and the first frame's "
                                  "conditioning latents on channels, 2 x in_channels + 4 = 36 (diffusers' "
                                  "in_channels), and predicts in_channels")
    image_dim: Optional[int] = Field(None, ge=1, description="width of the CLIP image states (ViT-H/14: 1280; "
                                     "diffusers' image_dim); set: a cross-attention to the image tokens beside the "
                                     "caption's")
    added_kv_proj_dim: Optional[int] = Field(None, ge=1, description="input width of the image cross-attention's "
                                             "k and v projections (diffusers' added_kv_proj_dim): the projected "
                                             "image tokens, so model.hidden_size")
    experts: Optional[WanExperts] = Field(None, description="Wan 2.2 A14B: two experts chosen by timestep")
    image_len: int = Field(257, ge=1, description="CLIP image tokens (ViT-H/14 at 224 px: 256 patches + the class "
                           "token; the penultimate hidden states)")
    expand_timesteps: bool = Field(False, description="Wan 2.2 TI2V-5B (the pipelines' expand_timesteps): a timestep "
                                   "per token; with model.image_condition the first latent frame is the clean "
                                   "conditioning frame (t = 0, no mask or image channels; models/wan/ti2v.py)")

    @property
    def trained_experts(self) -> int:
        return 2 if self.experts is not None and self.experts.train == "both" else 1

    @field_validator("head_dim")
    @classmethod
    def _even_head_dim(cls, value: int) -> int:
        if value % 2 or value < 6:
            raise ValueError(f"Wan's rotary positions rotate channel pairs of (t, h, w) parts of head_dim: "
                             f"model.head_dim={value} must be even and >= 6 (the releases: 128)")
        return value

    @model_validator(mode="after")
    def _experts_lora(self) -> "WanConfig":
        if (self.lora is not None and self.lora.init_from is not None and self.experts is not None
                and self.experts.train == "both"):
            raise ValueError(f"model.lora.init_from={self.lora.init_from} with model.experts.train=both: reading "
                             f"both experts' adapters back is not built yet (export writes transformer/ and "
                             f"transformer_2/ files); start both experts' adapters fresh (--set "
                             f"model.lora.init_from=null) or continue one expert (--set model.experts.train="
                             f"high_noise with that expert's file)")
        return self

    @model_validator(mode="after")
    def _image_parts(self) -> "WanConfig":
        if (self.image_dim is None) != (self.added_kv_proj_dim is None):
            raise ValueError(f"model.image_dim={self.image_dim} and model.added_kv_proj_dim={self.added_kv_proj_dim}: "
                             f"set both (the image cross-attention) or neither")
        if self.image_dim is None:
            return self
        if self.added_kv_proj_dim != self.hidden_size:
            raise ValueError(f"model.added_kv_proj_dim={self.added_kv_proj_dim} must equal model.hidden_size="
                             f"{self.hidden_size}: the image tokens are projected to hidden_size before their k/v")
        if not self.image_condition:
            raise ValueError("model.image_dim needs model.image_condition=true (Wan 2.1 I2V takes both the CLIP "
                             "image tokens and the first frame's latents)")
        if self.max_text_len != I2V_TEXT_LEN:
            raise ValueError(f"model.max_text_len={self.max_text_len} with model.image_dim: diffusers' Wan reads the "
                             f"last {I2V_TEXT_LEN} cross-attention tokens as the caption; set "
                             f"--set model.max_text_len={I2V_TEXT_LEN}")
        return self

    @model_validator(mode="after")
    def _expand_timesteps(self) -> "WanConfig":
        if not self.expand_timesteps:
            return self
        if self.image_dim is not None or self.experts is not None:
            raise ValueError(f"model.expand_timesteps=true with model.{'image_dim' if self.image_dim else 'experts'}:"
                             f" Wan 2.2 TI2V-5B has one transformer and no image cross-attention; set "
                             f"--set model.expand_timesteps=false or use the wan2.2-ti2v-5b preset")
        if self.patch_size_t != 1:
            raise ValueError(f"model.patch_size_t={self.patch_size_t} with model.expand_timesteps=true: the clean first "
                             f"latent frame must be whole tokens; set --set model.patch_size_t=1 (the release's)")
        return self

    @property
    def transformer_in_channels(self) -> int:
        """Image-to-video (Wan 2.1 I2V, Wan 2.2 I2V-A14B): noisy latent, mask (one channel per frame of a temporal
        VAE step), image latents. TI2V (expand_timesteps) puts its image in the latent itself."""
        if self.image_condition and not self.expand_timesteps:
            return 2 * self.in_channels + self.vae_scale_temporal
        return self.in_channels

    def extra_input_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.image_len, self.image_dim),) if self.image_dim is not None else ()
