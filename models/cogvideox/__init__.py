"""CogVideoX (2B, 5B, 5B-I2V; 1.5: 5B, 5B-I2V): full 3D attention over text + video tokens, adaLN-zero blocks."""
from __future__ import annotations

import math

from models.cogvideox.config import CogVideoXConfig
from models.cogvideox.image import first_frame_condition
from models.cogvideox.model import DiTBlock, EmbedStage, FinalStage
from models.cogvideox.pipeline import SAMPLING
from models.cogvideox.released import DIFFUSERS
from models.diffusion import PER_SAMPLE
from models.shared.pipeline import T5, CogVideoXLatents
from models.spec import FamilySpec

SPEC = FamilySpec(
    name="cogvideox",
    config=CogVideoXConfig,
    embed=EmbedStage,
    layer=DiTBlock,
    final=FinalStage,
    text_in_sequence=True,
    row_parallel_per_layer=2,                # attention output, FFN output
    attentions_per_layer=1,
    attention_pairs=lambda m, grid: (m.max_text_len + math.prod(grid)) ** 2,
    describe_layers=lambda m: f"{m.num_layers} blocks",
    layer_noun="block",
    recompute_parts={"attention": ("attn.core",), "mlp": ("mlp",)},
    released=DIFFUSERS,
    checkpoint=None,
    condition=first_frame_condition,         # image-to-video presets: the first frame's latents on channels
    vae=CogVideoXLatents(),
    text_encoder=T5,
    timesteps=PER_SAMPLE,
    sampling=SAMPLING,
    experts=(),
)
