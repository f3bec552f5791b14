"""HunyuanVideo 1.5 (8.3B) text- and image-to-video: dual-stream blocks only, over image, glyph and text rows +
video tokens. The blocks and the head are HunyuanVideo's (models/shared/mmdit.py: the same dual-stream block and
adaLN-continuous head); the first stage and the released names are its own."""
from __future__ import annotations

import math

from models.diffusion import PER_SAMPLE
from models.hunyuanvideo15.config import HunyuanVideo15Config
from models.hunyuanvideo15.embed import EmbedStage
from models.hunyuanvideo15.image import image_condition
from models.hunyuanvideo15.pipeline import QWEN_BYT5, SAMPLING, Hunyuan15Latents
from models.hunyuanvideo15.released import DIFFUSERS
from models.shared.mmdit import FinalStage, HunyuanBlock
from models.spec import Costs, FamilySpec, Formats, Network, Wording

SPEC = FamilySpec(
    name="hunyuanvideo15",
    config=HunyuanVideo15Config,
    network=Network(
        embed=EmbedStage,
        layer=HunyuanBlock,                      # every block dual-stream (config.num_dual_layers = num_layers)
        final=FinalStage,
        recompute_parts={"attention": ("attn.core",), "mlp": ("ffn",)},
    ),
    costs=Costs(
        text_in_sequence=True,
        row_parallel_per_layer=2,                # 4 on partial sequences (text, video x attention, FFN): 2 x b S H
        attention_pairs=lambda m, grid: (m.max_text_len + math.prod(grid)) ** 2,
    ),
    wording=Wording(describe_layers=lambda m: f"{m.num_layers} dual-stream blocks"),
    formats=Formats(
        vae=Hunyuan15Latents(),                  # latents z * scaling_factor
        text_encoder=QWEN_BYT5,                  # Qwen2.5-VL + byT5 (+ zero SigLIP) rows: captions.py; I2V: siglip.py
        released=DIFFUSERS,
    ),
    timesteps=PER_SAMPLE,
    sampling=SAMPLING,
    condition=image_condition,               # model.image_condition: the first frame's latents and mask
)
