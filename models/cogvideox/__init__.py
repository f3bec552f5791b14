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
from models.spec import Costs, FamilySpec, Formats, Network, Wording

SPEC = FamilySpec(
    name="cogvideox",
    config=CogVideoXConfig,
    network=Network(
        embed=EmbedStage,
        layer=DiTBlock,
        final=FinalStage,
        recompute_parts={"attention": ("attn.core",), "mlp": ("mlp",)},
    ),
    costs=Costs(
        text_in_sequence=True,
        row_parallel_per_layer=2,                # attention output, FFN output
        attention_pairs=lambda m, grid: (m.max_text_len + math.prod(grid)) ** 2,
    ),
    wording=Wording(describe_layers=lambda m: f"{m.num_layers} blocks"),
    formats=Formats(vae=CogVideoXLatents(), text_encoder=T5, released=DIFFUSERS),
    timesteps=PER_SAMPLE,
    sampling=SAMPLING,
    condition=first_frame_condition,         # image-to-video presets: the first frame's latents on channels
)
