"""HunyuanVideo (13B) text-to-video: dual-stream blocks, then single-stream blocks, over text + video tokens."""
from __future__ import annotations

import math

from models.hunyuanvideo.config import HunyuanVideoConfig
from models.hunyuanvideo.embed import EmbedStage
from models.hunyuanvideo.opensora import OPENSORA
from models.hunyuanvideo.pipeline import LLAMA_CLIP, SAMPLING, HunyuanLatents
from models.hunyuanvideo.released import DIFFUSERS
from models.hunyuanvideo.timesteps import HUNYUAN_TIMESTEPS
from models.shared.mmdit import FinalStage, HunyuanBlock
from models.spec import FamilySpec

SPEC = FamilySpec(
    name="hunyuanvideo",
    config=HunyuanVideoConfig,
    embed=EmbedStage,
    layer=HunyuanBlock,
    final=FinalStage,
    text_in_sequence=True,
    # dual-stream: 4 on partial sequences (text, video x attention, FFN), 2 x b S H in all; single-stream: 1
    row_parallel_per_layer=lambda m: (2 * m.num_dual_layers + (m.num_layers - m.num_dual_layers)) / m.num_layers,
    attentions_per_layer=1,
    attention_pairs=lambda m, grid: (m.max_text_len + math.prod(grid)) ** 2,
    describe_layers=lambda m: f"{m.num_dual_layers} dual-stream + {m.num_single_layers} single-stream blocks",
    layer_noun="block",
    recompute_parts={"attention": ("attn.core",), "mlp": ("ffn", "mlp")},
    released=DIFFUSERS,
    checkpoint=OPENSORA,                     # Open-Sora 2.0's Open_Sora_v2.safetensors (configs/opensora2.0.yaml)
    condition=None,                          # text-to-video
    vae=HunyuanLatents(),                    # latents z * scaling_factor
    text_encoder=LLAMA_CLIP,                 # LLaMA (or T5) states + the CLIP pooled vector per row: captions.py
    timesteps=HUNYUAN_TIMESTEPS,             # uniform, or Open-Sora 2.0's (model.train_timesteps): timesteps.py
    sampling=SAMPLING,
)
