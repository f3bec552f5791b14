"""The `model:` section of the LTX-2 family (diffusers' LTX2VideoTransformer3DModel): a video stream and an audio
stream side by side, with the release's defaults (the 19B LTX-2: 48 blocks, video 32 x 128, audio 32 x 64).

The video fields are the shared ones (hidden_size, num_heads, head_dim, in_channels, text_embed_dim = Gemma-3's
caption_channels); the audio stream has its own `audio_*` fields. The audio stream's length follows the clip:
data.num_frames / model.frame_rate seconds at audio_sampling_rate / audio_hop_length / audio_scale_factor latent
frames a second (25 at the release's 16 kHz, hop 160, 4 x), rounded, as LTX2Pipeline computes audio_num_frames.
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from models.config import ModelConfig


class LTX2Config(ModelConfig):
    """LTX-2: video and audio self-attention, a text cross-attention per stream, audio-to-video and video-to-audio
    cross-attention, AdaLN modulation of each, RMS q/k norm across heads; 3D rotary positions for video, 1D for
    audio. LTX-2.3: gated attention (`gated_attn`, `audio_gated_attn`) and cross-attention modulation
    (`cross_attn_mod`, `audio_cross_attn_mod`). Image-to-video: `image_condition` (models/ltx2/image.py)."""

    POS_EMBEDS: ClassVar[tuple[str, ...]] = ("rope_av",)       # the class's video (t, h, w) and audio (t) rotary

    family: Literal["ltx2"] = "ltx2"
    num_layers: int = Field(48, ge=1)
    hidden_size: int = Field(4096, ge=1)
    num_heads: int = Field(32, ge=1)
    head_dim: int = Field(128, ge=2)
    time_embed_dim: Literal[256] = Field(256, description="sinusoidal timestep features (the class's Timesteps(256))")
    in_channels: int = Field(128, ge=1, description="video latent channels")
    patch_size: Literal[1] = Field(1, description="the release's; the class packs latents with patch 1")
    patch_size_t: Literal[1] = 1
    text_embed_dim: int = Field(3840, ge=1, description="Gemma-3 features after the pipeline's connector "
                                "(diffusers' caption_channels)")
    max_text_len: int = Field(1024, ge=1, description="caption tokens (the pipeline's max_sequence_length)")
    objective: Literal["flow_matching"] = "flow_matching"
    vae_scale_spatial: int = Field(32, ge=1, description="AutoencoderKLLTX2Video's spatial compression (also the "
                                   "video rotary positions' scale, diffusers' vae_scale_factors[1:])")
    vae_scale_temporal: int = Field(8, ge=1, description="its temporal compression (vae_scale_factors[0])")

    audio_hidden_size: int = Field(2048, ge=1, description="audio stream width (audio heads x audio head_dim)")
    audio_num_heads: int = Field(32, ge=1)
    audio_head_dim: int = Field(64, ge=2)
    audio_in_channels: int = Field(128, ge=1, description="packed audio latent channels (audio VAE channels x mel "
                                   "bins: 8 x 16)")
    audio_scale_factor: int = Field(4, ge=1, description="AutoencoderKLLTX2Audio's temporal compression")
    audio_sampling_rate: int = Field(16000, ge=1)
    audio_hop_length: int = Field(160, ge=1)
    frame_rate: float = Field(24.0, gt=0, description="video frames a second (the pipeline's frame_rate): the "
                              "video rotary positions' time axis and the audio stream's length")

    pos_embed_max_pos: int = Field(20, ge=1, description="video rotary positions: seconds the time axis spans")
    audio_pos_embed_max_pos: int = Field(20, ge=1)
    base_height: int = Field(2048, ge=1, description="video rotary positions: pixels the row axis spans")
    base_width: int = Field(2048, ge=1)
    rope_theta: float = Field(10000.0, gt=0)
    rope_type: Literal["interleaved", "split"] = Field("interleaved", description="channel pairs rotated: "
                                                       "neighbours (interleaved) or halves of each head (split)")
    causal_offset: int = Field(1, ge=0, description="the causal VAE's first frame: positions shifted by it")
    timestep_scale_multiplier: int = Field(1000, ge=1)
    cross_attn_timestep_scale_multiplier: int = Field(1000, ge=1, description="the a2v/v2a gates see timesteps x "
                                                      "this / timestep_scale_multiplier")
    cross_timestep: bool = Field(True, description="the pipelines' use_cross_timestep (their default, true): each "
                                 "stream's audio-video cross-attention modulation takes the other stream's timestep")

    gated_attn: bool = Field(False, description="LTX-2.3: a per-head gate 2 sigmoid(W x) on each video attention")
    audio_gated_attn: bool = False
    cross_attn_mod: bool = Field(False, description="LTX-2.3: modulated text cross-attention (queries, gate) for "
                                 "video, and timestep-modulated caption keys and values")
    audio_cross_attn_mod: bool = False
    image_condition: bool = Field(False, description="image-to-video (LTX2ImageToVideoPipeline; the same "
                                  "transformer as text-to-video): the first latent frame is the clean picture "
                                  "latent, its tokens at timestep 0, left out of the loss")
    image_dropout: float = Field(0.0, ge=0, le=1, description="image-to-video training: probability that a sample "
                                 "is trained as text-to-video (its first frame noised, at the sample's timestep and "
                                 "in the loss): 1 - the `probability` of ltx-trainer's first_frame condition (its "
                                 "default 1: 0 here; its i2v_lora.yaml 0.5, the ltx2-i2v preset's)")
    prompt_embeddings: bool = Field(True, description="diffusers' use_prompt_embeddings: the transformer projects "
                                    "the caption (LTX-2.0); false: the connector did (LTX-2.3), text_embed_dim is "
                                    "then hidden_size for the video caption and audio_hidden_size for the audio's")

    @model_validator(mode="after")
    def _ltx2_widths(self) -> "LTX2Config":
        if self.audio_num_heads * self.audio_head_dim != self.audio_hidden_size:
            raise ValueError(f"model.audio_num_heads x model.audio_head_dim = {self.audio_num_heads} x "
                             f"{self.audio_head_dim} must equal model.audio_hidden_size={self.audio_hidden_size}")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size != 4 * self.hidden_size:
            raise ValueError(f"model.ffn_hidden_size={self.ffn_hidden_size}: LTX-2's FeedForward is 4 x hidden_size "
                             f"= {4 * self.hidden_size} (diffusers has no key for it); leave it out")
        if self.head_dim % 2 or self.audio_head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} and model.audio_head_dim={self.audio_head_dim} must be "
                             f"even: rotary positions turn channel pairs")
        if not self.prompt_embeddings and self.text_embed_dim != self.hidden_size:
            raise ValueError(f"model.prompt_embeddings=false: the caption comes projected; set --set "
                             f"model.text_embed_dim={self.hidden_size} (model.hidden_size)")
        return self

    @property
    def audio_ffn_size(self) -> int:
        return 4 * self.audio_hidden_size

    @property
    def cross_attn_adaln(self) -> bool:
        """The blocks hold prompt scale/shift tables (either stream modulated)."""
        return self.cross_attn_mod or self.audio_cross_attn_mod

    def audio_tokens(self, data) -> int:
        """Audio latent frames of a data.num_frames clip, as LTX2Pipeline: round(seconds x latents a second)."""
        return self.audio_tokens_of(data.num_frames)

    def audio_tokens_at(self, latent_frames: int) -> int:
        """Audio tokens of the clip whose video latent has `latent_frames` frames ((t - 1) x vae_scale_temporal + 1
        video frames, the pipelines' 8k + 1): a step's audio length from its token grid."""
        return self.audio_tokens_of((latent_frames - 1) * self.vae_scale_temporal + 1)

    def audio_tokens_of(self, frames: int) -> int:
        """round(frames / frame_rate x audio_sampling_rate / audio_hop_length / audio_scale_factor): LTX2Pipeline's
        audio_num_frames (AutoencoderKLLTX2Audio: 16 kHz, mel hop 160, 4 x temporal compression: 25 a second)."""
        per_second = self.audio_sampling_rate / self.audio_hop_length / self.audio_scale_factor
        return round(frames / self.frame_rate * per_second)

    @property
    def audio_caption_dim(self) -> int:
        """Width of the audio caption states the transformer takes (projected by it, or by the connector)."""
        return self.text_embed_dim if self.prompt_embeddings else self.audio_hidden_size

    def clip_input_shapes(self, data) -> tuple[tuple[int, ...], ...]:
        """(audio latents [A, audio_in_channels], audio caption [L, audio_caption_dim], audio timesteps []) after
        (latents, timesteps, caption): the embed stage's inputs (models/ltx2/embed.py)."""
        return (self.audio_tokens(data), self.audio_in_channels), (self.max_text_len, self.audio_caption_dim), ()

    def tp_splits(self) -> dict[str, int]:
        """The audio stream's heads (its self-attention, caption cross-attention and both audio-video
        cross-attentions) and width (its FFN, 4 x, splits with it)."""
        return {"model.audio_num_heads": self.audio_num_heads, "model.audio_hidden_size": self.audio_hidden_size}

    def unsupported(self, run, purpose: str = "train") -> list[str]:
        """What the toolkit cannot do with this model yet (parallel/check.py's load_and_check refuses runs with it;
        the planner plans it). Training from latents with both streams works (models/ltx2/training.py; LoRA too;
        caption dropout drops both streams' captions: parallel/train/data.py), and so do parallel.export, parallel.verify and parallel.sample (both streams). `purpose` refuses nothing of
        its own."""
        why = "docs/models.md#ltx-2"
        problems = []
        if run.data.text_encoder:
            problems.append(f"data.text_encoder={run.data.text_encoder} with model.family=ltx2: LTX-2's captions are "
                            f"two connector states (video, audio) that the toolkit encodes in data preparation only; "
                            f"prepare them (python -m parallel.prepare_data --t5 <release folder>) and unset "
                            f"data.text_encoder ({why})")
        if run.val.every:
            problems.append(f"val.every={run.val.every} with model.family=ltx2: validation sees the video stream "
                            f"only; set --set val.every=0 ({why})")
        return problems
