"""HunyuanVideo (13B) text-to-video: dual-stream blocks, then single-stream blocks, over text + video tokens.

Open-Sora 2.0 (11B, configs/opensora2.0.yaml) is this family: the same network with other switches (no token
refiner, T5 + CLIP captions, cond_in), its own training timesteps and its own checkpoint file, all in opensora2.py."""
from __future__ import annotations

import math

from models.hunyuanvideo.config import HunyuanVideoConfig
from models.hunyuanvideo.embed import EmbedStage
from models.hunyuanvideo.opensora2 import HUNYUAN_TIMESTEPS, OPENSORA
from models.hunyuanvideo.pipeline import LLAMA_CLIP, SAMPLING, HunyuanLatents
from models.hunyuanvideo.released import DIFFUSERS
from models.shared.mmdit import FinalStage, HunyuanBlock
from models.spec import Costs, FamilySpec, Formats, Network, Wording

SPEC = FamilySpec(
    name="hunyuanvideo",
    config=HunyuanVideoConfig,
    network=Network(
        embed=EmbedStage,
        layer=HunyuanBlock,
        final=FinalStage,
        recompute_parts={"attention": ("attn.core",), "mlp": ("ffn", "mlp")},
    ),
    costs=Costs(
        text_in_sequence=True,
        # dual-stream: 4 on partial sequences (text, video x attention, FFN), 2 x b S H in all; single-stream: 1
        row_parallel_per_layer=lambda m: (2 * m.num_dual_layers + (m.num_layers - m.num_dual_layers)) / m.num_layers,
        attention_pairs=lambda m, grid: (m.max_text_len + math.prod(grid)) ** 2,
    ),
    wording=Wording(
        describe_layers=lambda m: f"{m.num_dual_layers} dual-stream + {m.num_single_layers} single-stream blocks",
    ),
    formats=Formats(
        vae=HunyuanLatents(),                    # latents z * scaling_factor
        text_encoder=LLAMA_CLIP,                 # LLaMA (or T5) states + the CLIP pooled vector per row: captions.py
        released=DIFFUSERS,
        checkpoint=OPENSORA,                     # Open-Sora 2.0's Open_Sora_v2.safetensors (configs/opensora2.0.yaml)
    ),
    timesteps=HUNYUAN_TIMESTEPS,             # uniform, or Open-Sora 2.0's (model.train_timesteps): opensora2.py
    sampling=SAMPLING,
    condition=None,                          # text-to-video
)
