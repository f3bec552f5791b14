"""Wan 2.1 text-to-video (1.3B, 14B) and image-to-video (14B), Wan 2.2 A14B (two experts) and TI2V-5B (a timestep
per token): self-attention with 3D rotary positions, cross-attention to UMT5 (and to the CLIP image tokens)."""
from __future__ import annotations

import math

from models.spec import Costs, FamilySpec, Formats, Network, Wording
from models.wan.config import WanConfig
from models.wan.image import image_condition
from models.wan.model import EmbedStage, FinalStage, WanBlock
from models.wan.pipeline import SAMPLING, UMT5, WanLatents
from models.wan.released import DIFFUSERS
from models.wan.ti2v import TI2VTimesteps


def attention_pairs(m: WanConfig, grid: tuple[int, int, int]) -> int:
    """Self-attention S^2 + cross-attention S (L + I) (S = t h w video tokens, L text tokens, I image tokens)."""
    s = math.prod(grid)
    return s * s + s * (m.max_text_len + (m.image_len if m.image_dim is not None else 0))


SPEC = FamilySpec(
    name="wan",
    config=WanConfig,
    network=Network(
        embed=EmbedStage,
        layer=WanBlock,
        final=FinalStage,
        recompute_parts={"attention": ("attn1.core",), "mlp": ("ffn",)},     # self-attention; cross-attention is S x L
    ),
    costs=Costs(
        text_in_sequence=False,
        row_parallel_per_layer=3,                # self-attention, cross-attention and FFN outputs
        attention_pairs=attention_pairs,
    ),
    wording=Wording(describe_layers=lambda m: f"{m.num_layers} blocks"),
    formats=Formats(
        vae=WanLatents(),                        # latents (x - latents_mean) / latents_std per channel
        text_encoder=UMT5,                       # padding rows zeroed, as WanPipeline
        released=DIFFUSERS,
    ),
    timesteps=TI2VTimesteps(),              # per sample; in one expert's band (model.experts.train); per token
                                             # for Wan 2.2 TI2V (model.expand_timesteps, models/wan/ti2v.py)
    sampling=SAMPLING,
    condition=image_condition,               # I2V: mask + image latents on channels, CLIP states (models/wan/image.py)
)
