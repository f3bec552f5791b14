"""LTX-2 (Lightricks; diffusers' LTX2VideoTransformer3DModel): a video and an audio stream, each with self-attention
and a caption cross-attention, joined by audio-to-video and video-to-audio cross-attention in every block.

The stage tuple carries both streams (models/ltx2/model.py); the last stage returns (video, audio) predictions.
Training batches carry the audio stream and the loss counts both (models/ltx2/training.py); image-to-video is
the same transformer with a clean first frame (models/ltx2/image.py); what is not built is refused by name
(LTX2Config.unsupported).
"""
from __future__ import annotations

import math

from models.ltx2.config import LTX2Config
from models.ltx2.embed import EmbedStage, FinalStage
from models.ltx2.image import image_condition
from models.ltx2.model import LTX2Block
from models.ltx2.pipeline import GEMMA3, SAMPLING, LTX2Latents
from models.ltx2.released import DIFFUSERS
from models.ltx2.training import AudioStream, LTX2Timesteps
from models.spec import Costs, FamilySpec, Formats, Network, Wording


def attention_pairs(m: LTX2Config, grid: tuple[int, int, int]) -> int:
    """(query, key) pairs of one block at the video width D (the planner's 12 L pairs D FLOPs): the video
    stream's self-attention S^2 and caption cross-attention S L, and the attentions of the audio width Da,
    scaled by Da / D: audio-to-video S A, the audio self-attention A^2, its caption cross-attention A L and
    video-to-audio A S. A: the audio tokens of the clip the grid's t latent frames come from ((t - 1) x
    vae_scale_temporal + 1 frames, the pipelines' 8k + 1)."""
    s, text = math.prod(grid), m.max_text_len
    a = m.audio_tokens_at(grid[0])
    return round(s * s + s * text + (2 * s * a + a * a + a * text) * m.audio_hidden_size / m.hidden_size)


SPEC = FamilySpec(
    name="ltx2",
    config=LTX2Config,
    network=Network(
        embed=EmbedStage,
        layer=LTX2Block,
        final=FinalStage,
        recompute_parts={"attention": ("attn1", "audio_attn1"), "mlp": ("ff", "audio_ff")},
        streams=2,                               # x and the audio stream a: both updated by every block
    ),
    costs=Costs(
        text_in_sequence=False,
        # b x S x H all-reduces: the video stream's self, caption and audio-to-video attention outputs and its FFN (the
        # audio stream's four are b x A x Da, A ~ S / 50 at the release's sizes). The step time's 6 N S FLOPs count
        # every block weight over the S video tokens: the audio stream's (a fifth of a block's) and the caption
        # keys' and values' see A and L tokens, so an LTX-2 step's compute is overestimated (~40% at the release's
        # 121 x 512 x 768), like STDiT's text keys and values (parallel/plan/search.py)
        row_parallel_per_layer=4,
        attention_pairs=attention_pairs,
        # the video self-attention's (Ulysses: 4 all-to-alls); the audio stream is whole on every sp rank, and
        # video-to-audio's merge is one all-gather of B x A x Da/tp (models/ltx2/model.py)
        attentions_per_layer=1,
    ),
    wording=Wording(describe_layers=lambda m: f"{m.num_layers} audio-video blocks"),
    formats=Formats(vae=LTX2Latents(), text_encoder=GEMMA3, released=DIFFUSERS),
    timesteps=LTX2Timesteps(),
    sampling=SAMPLING,
    condition=image_condition,               # model.image_condition: the clean first frame (models/ltx2/image.py)
    second_stream=AudioStream,
)
