"""LTX-2 (Lightricks; diffusers' LTX2VideoTransformer3DModel): a video and an audio stream, each with self-attention
and a caption cross-attention, joined by audio-to-video and video-to-audio cross-attention in every block.

The stage tuple carries both streams (models/ltx2/model.py); the last stage returns (video, audio) predictions.
Training is refused by the checker until the batch, the loss and the samplers carry the audio stream
(LTX2Config.unsupported).
"""
from __future__ import annotations

import math

from models.diffusion import PER_SAMPLE
from models.ltx2.config import LTX2Config
from models.ltx2.embed import EmbedStage, FinalStage
from models.ltx2.model import LTX2Block
from models.ltx2.pipeline import GEMMA3, SAMPLING, LTX2Latents
from models.ltx2.released import DIFFUSERS
from models.spec import FamilySpec


def attention_pairs(m: LTX2Config, grid: tuple[int, int, int]) -> int:
    """The video stream's: self-attention S^2, caption cross-attention S L, audio-to-video S A (A is not in the
    grid: counted as the release's 5 s clip, 126 audio tokens, until the plan knows the audio stream)."""
    s = math.prod(grid)
    return s * s + s * m.max_text_len + s * 126


SPEC = FamilySpec(
    name="ltx2",
    config=LTX2Config,
    embed=EmbedStage,
    layer=LTX2Block,
    final=FinalStage,
    text_in_sequence=False,
    # b x S x H all-reduces: the video stream's self, caption and audio-to-video attention outputs and its FFN (the
    # audio stream's four are b x A x Da, A ~ S / 50 at the release's sizes)
    row_parallel_per_layer=4,
    attentions_per_layer=0,                  # sp is not built for this family yet: no all-to-alls (checker refuses)
    attention_pairs=attention_pairs,
    describe_layers=lambda m: f"{m.num_layers} audio-video blocks",
    layer_noun="block",
    recompute_parts={"attention": ("attn1", "audio_attn1"), "mlp": ("ff", "audio_ff")},
    released=DIFFUSERS,
    checkpoint=None,
    condition=None,
    vae=LTX2Latents(),
    text_encoder=GEMMA3,
    timesteps=PER_SAMPLE,
    sampling=SAMPLING,
)
