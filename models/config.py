"""The `model:` section every family shares; each family subclasses it with its own fields (models/<family>/).

Typed with pydantic (`extra="forbid"`): a misspelt key, a wrong type or an impossible value is refused
with its dotted name when the experiment is loaded (parallel/experiment/config.py), before anything expensive.
"""
from __future__ import annotations

import json
import shlex
from typing import Any, ClassVar, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def flow_value(value: Any) -> str:
    """`value` as `--set` reads it back (YAML, parallel/experiment/config.py's parse_override), without spaces in
    lists: [4,6,6], true, null, 1.0e-05 (YAML reads 1e-05 as a string), t2v, '1' (a string that reads as
    a number is quoted)."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(flow_value(v) for v in value) + "]"
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().removesuffix("...").strip()
    return json.dumps(value) if text.startswith("'") else text


def set_flag(key: str, value: Any) -> str:
    """The advice `--set KEY=VALUE` that gives the dotted `key` this value, as one shell word: pasted into
    bash as printed it is one argument (brackets, braces and spaces quoted: '--set 'model.rope_axes_dim=
    [4,6,6]''), so every refusal that names a fix names it through here."""
    return f"--set {shlex.quote(f'{key}={flow_value(value)}')}"


class Section(BaseModel):
    """A config section: unknown keys refused, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class NoiseSchedule(Section):
    """The noise schedule: `shift` for flow_matching; the rest is the DDPM noise schedule of v_prediction, under the names of diffusers' scheduler_config.json (CogVideoX's
    CogVideoXDDIMScheduler / CogVideoXDPMScheduler); its prediction_type is model.objective. Defaults are 5B's;
    CogVideoX-2B sets snr_shift_scale 3.0 (SAT: ZeroSNRDDPMDiscretization shift_scale 3.0)."""

    beta_start: float = Field(0.00085, gt=0, lt=1)
    beta_end: float = Field(0.012, gt=0, lt=1)
    beta_schedule: Literal["scaled_linear"] = Field("scaled_linear", description="betas = linspace(sqrt(beta_start), "
                                                    "sqrt(beta_end), 1000) ** 2")
    snr_shift_scale: float = Field(1.0, gt=0, description="alphas_cumprod / (s + (1 - s) alphas_cumprod): the SNR "
                                   "divided by s, before the zero-SNR rescale")
    rescale_betas_zero_snr: bool = Field(True, description="rescale sqrt(alphas_cumprod) to reach 0 at t = 999")
    timestep_spacing: Literal["trailing", "leading", "linspace"] = Field("trailing", description="sampling timesteps "
                                                                         "(ddim and dpm), as diffusers spaces them")
    shift: float = Field(1.0, gt=0, description="flow_matching's timestep shift: noise level sigma = shift s / "
                         "(1 + (shift - 1) s) at s = t / 1000 (diffusers' shift / flow_shift; Wan 2.1: 3.0 at 480p, "
                         "5.0 at 720p)")
    sigma_min: float = Field(0.0, ge=0, lt=1, description="flow_matching's noise floor: x_t = (1 - s) x0 + (1 - (1 "
                             "- sigma_min)(1 - s)) e, target (1 - sigma_min) e - x0 (Open-Sora 2.0: 1e-5); 0: "
                             "x_t = (1 - s) x0 + s e")


class LoraConfig(Section):
    """Low-rank adapters (LoRA, as peft builds them) on the linear layers named by `targets`; the base is frozen.

    Each targeted weight W [out, in] gains A [rank, in] (kaiming-uniform, as peft starts it) and B [out, rank]
    (zeros): y = x W^T + b + (alpha / rank) * (dropout(x) A^T) B^T. parallel/model/lora.py does the rest."""

    rank: int = Field(ge=1, description="the adapters' rank r")
    alpha: Optional[float] = Field(None, gt=0, description="scaling = alpha / rank; default: rank (scaling 1)")
    targets: list[str] = Field(["to_q", "to_k", "to_v", "to_out.0"], min_length=1,
                               description="the released model's module names (peft's target_modules: a name "
                               "matches a module whose dotted name equals it or ends with .name)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input (peft's lora_dropout)")
    init_from: Optional[str] = Field(None, description="pytorch_lora_weights.safetensors (diffusers' LoRA keys, "
                                     "e.g. from python -m parallel.export --format diffusers-lora) to start from")
    base_dtype: Optional[Literal["float8_e4m3fn"]] = Field(
        None, description="store the frozen base's tensor-parallel linear weights in fp8 with one scale per tensor "
        "(per tp shard), computed in the run's dtype; default: the run's dtype")

    @model_validator(mode="before")
    @classmethod
    def _base_dtype_needs_adapters(cls, data):
        if isinstance(data, dict) and "rank" not in data and data.get("base_dtype") is not None:
            raise ValueError("model.lora.base_dtype needs LoRA (set model.lora.rank): only a frozen base can be "
                             "stored in fp8; full fine-tuning (no model.lora) trains the base in the run's dtype "
                             "(the DeepSpeed JSON's bf16/fp16)")
        return data

    @property
    def scaling(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank


class ModelConfig(Section):
    """Video DiT dimensions common to every family; defaults are CogVideoX-2B's where one exists."""

    # Positional schemes this family implements, the first being its default (set by each family).
    POS_EMBEDS: ClassVar[tuple[str, ...]] = ()
    # Those of them learned for one token grid (a table per position): other shapes (buckets) are refused.
    FIXED_GRID_POS_EMBEDS: ClassVar[tuple[str, ...]] = ()

    name: str = Field("custom", description="preset name, for reports")
    family: str = Field(description="the model family (models/registry.py)")
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    ffn_hidden_size: Optional[int] = Field(None, ge=1, description="default 4 x hidden_size")
    time_embed_dim: int = Field(512, ge=1, description="cogvideox: time embedding width; stdit: size of the "
                                "sinusoidal timestep features (Open-Sora's frequency_embedding_size, 256)")
    in_channels: int = Field(16, ge=1, description="latent channels")
    patch_size: int = Field(2, ge=1)
    patch_size_t: int = Field(1, ge=1)
    text_embed_dim: int = Field(4096, ge=1, description="T5 hidden size")
    max_text_len: int = Field(226, ge=1)
    pos_embed: Optional[str] = Field(None, description="positional scheme; default: the family's own")
    objective: Literal["v_prediction", "flow_matching"] = "v_prediction"
    schedule: NoiseSchedule = Field(default_factory=NoiseSchedule, description="v_prediction's noise schedule")
    vae_scale_spatial: int = Field(8, ge=1)
    vae_scale_temporal: int = Field(4, ge=1)
    init_from: Optional[str] = Field(None, description="folder of released weights in the diffusers layout "
                                     "(config.json + *.safetensors) to start from, or Open-Sora 2.0's checkpoint file "
                                     "(a .safetensors file, HunyuanVideo family); a resumed checkpoint wins")
    lora: Optional[LoraConfig] = Field(None, description="train low-rank adapters on a frozen base; default "
                                       "(none): full fine-tuning")

    @field_validator("pos_embed")
    @classmethod
    def _family_positions(cls, value: Optional[str]) -> str:
        if value is None:
            return cls.POS_EMBEDS[0]
        if value not in cls.POS_EMBEDS:
            family = cls.model_fields["family"].default
            allowed = " or ".join(cls.POS_EMBEDS) + (" (or leave it out)" if len(cls.POS_EMBEDS) == 1 else "")
            raise ValueError(f"model.pos_embed={value} does not fit model.family={family}; "
                             f"use model.pos_embed={allowed}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_positions(cls, data):
        """An absent pos_embed is the family's own (field validators do not run on defaults)."""
        if isinstance(data, dict) and data.get("pos_embed") is None and cls.POS_EMBEDS:
            data = {**data, "pos_embed": cls.POS_EMBEDS[0]}
        return data

    @model_validator(mode="after")
    def _flow_noise_floor(self) -> "ModelConfig":
        if self.objective != "flow_matching" and self.schedule.sigma_min:
            raise ValueError(f"model.schedule.sigma_min={self.schedule.sigma_min} is flow matching's noise floor "
                             f"(Open-Sora 2.0: 1e-5); model.objective={self.objective} takes 0: set --set "
                             f"model.schedule.sigma_min=0 or model.objective=flow_matching")
        return self

    @model_validator(mode="after")
    def _heads_times_dim(self) -> "ModelConfig":
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError(
                f"model.num_heads x model.head_dim = {self.num_heads} x {self.head_dim} = "
                f"{self.num_heads * self.head_dim} must equal model.hidden_size={self.hidden_size}; set "
                f"{set_flag('model.hidden_size', self.num_heads * self.head_dim)}, or model.num_heads and "
                f"model.head_dim whose product is {self.hidden_size}"
            )
        return self


    def fixed_position_grid(self) -> Optional[str]:
        """The setting that ties the model to one token grid (positions learned for it), else None: a
        bucketed run refuses other grids naming it."""
        return f"model.pos_embed={self.pos_embed}" if self.pos_embed in self.FIXED_GRID_POS_EMBEDS else None

    def largest_position_grid(self) -> Optional[tuple[tuple[int, int], str]]:
        """((height, width) patches, the setting) when the position table has a largest spatial grid it can
        serve (a table sliced to the grid), else None: a bucket beyond it is refused before training."""
        return None

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def transformer_in_channels(self) -> int:
        """Channels of the first stage's latents (image-to-video models take conditioning channels too)."""
        return self.in_channels

    @property
    def trained_experts(self) -> int:
        """Transformers one run trains side by side, each sample through the one its timestep picks (Wan 2.2
        A14B with both experts: 2); 1 for a model of one."""
        return 1

    def unsupported(self, run, purpose: str = "train") -> list[str]:
        """What the toolkit cannot do yet with this model section in experiment `run` (its data, val, parallel
        sections) for `purpose` ("train", "sample", "export", "verify": the command's job), each naming what is
        missing (parallel/check.py reports them with the layout's problems); [] for a family that does it all."""
        return []

    def extra_input_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes (without the batch) of the first stage's inputs after (latents, timesteps, text): a
        conditioning input the family's embed stage takes (Wan 2.1 I2V: the CLIP image states [257, 1280])."""
        return ()

    def clip_input_shapes(self, data) -> tuple[tuple[int, ...], ...]:
        """Shapes (without the batch) of the first stage's inputs after (latents, timesteps, text) for a clip of
        `data`'s shape: `extra_input_shapes`, and inputs whose length follows the clip's (LTX-2's audio latents).
        The planner traces the embed stage on these."""
        return self.extra_input_shapes()

    def tp_splits(self) -> dict[str, int]:
        """Dimensions tensor parallelism splits besides the heads, hidden size and FFN width every family has
        (parallel/experiment/splits.py), by dotted key: a second stream's heads and width (LTX-2's audio)."""
        return {}
