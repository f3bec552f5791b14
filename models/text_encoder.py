"""Caption -> text embeddings with a T5-family encoder from a local folder (`transformers`), as the
released pipeline that ships that encoder feeds its transformer.

The encoder class comes from the folder's config.json (`architectures`), and each class is used as its
pipeline uses it (`ENCODERS`; a family names the class it trains with in its FamilySpec.text_encoder):
- `T5EncoderModel` (CogVideoX, `CogVideoXPipeline._get_t5_prompt_embeds`): the caption tokenised to exactly
  `max_len` tokens (padded, truncated), encoded without an attention mask; the last hidden state
  [max_len, d_model] is the text input, padding positions included (CogVideoX attends to all 226).
- `UMT5EncoderModel` (Wan 2.1, `WanPipeline._get_t5_prompt_embeds`, diffusers 0.42): the caption cleaned
  (`prompt_clean`: ftfy when installed, HTML entities unescaped twice, runs of whitespace to one space),
  tokenised to `max_len` with the attention mask, encoded with that mask; the rows of the n real tokens
  kept and rows n..max_len-1 set to ZERO ([max_len, d_model], zeros where the padding was).
Nothing is downloaded: `path` is a folder written by `save_pretrained` holding the encoder and its tokenizer.
"""
from __future__ import annotations

import html
import importlib.util
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch


@dataclass(frozen=True)
class EncoderKind:
    """How the pipeline that ships one encoder class turns a caption into its transformer's text input."""

    masked: bool          # encode with the attention mask and zero the padding rows (Wan); else keep them
    clean: bool           # WanPipeline's prompt_clean before tokenising


ENCODERS = {"T5EncoderModel": EncoderKind(masked=False, clean=False),
            "UMT5EncoderModel": EncoderKind(masked=True, clean=True)}
# By model_type: a whole T5 checkpoint (T5ForConditionalGeneration: t5-v1_1-xxl, which SAT's CogVideoX reads)
# loads as its encoder alone, as the release's text_encoder/ folder holds it.
_MODEL_TYPES = {"t5": "T5EncoderModel", "umt5": "UMT5EncoderModel"}


def encoder_class(config: dict) -> str | None:
    """The encoder class of a config.json ("T5EncoderModel", "UMT5EncoderModel"), or what it describes instead."""
    return _MODEL_TYPES.get(config.get("model_type")) or (config.get("architectures") or [None])[0]


def prompt_clean(text: str) -> str:
    """WanPipeline's prompt_clean (diffusers 0.42 pipelines/wan/pipeline_wan.py), ftfy only if installed as there."""
    if importlib.util.find_spec("ftfy") is not None:
        import ftfy
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class T5TextEncoder:
    def __init__(self, path: str | Path, max_len: int, expected_dim: int | None = None, device="cpu",
                 cache_size: int = 4096, expected_class: str | None = None, key: str = "data.text_encoder"):
        import transformers

        path = Path(path)
        what = "a folder saved with T5EncoderModel or UMT5EncoderModel .save_pretrained and its tokenizer"
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise FileNotFoundError(f"{key}={path}: cannot read config.json ({e}); expected {what}") from None
        name = encoder_class(config)
        if name not in ENCODERS:
            raise ValueError(f"{key}={path}: config.json describes {name!r}; expected {what}")
        if expected_class is not None and name != expected_class:
            raise ValueError(f"{key}={path}: a {name}, but this model family trains on {expected_class} "
                             "embeddings (the text_encoder/ folder of its release)")
        self.kind = ENCODERS[name]
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        self.model = getattr(transformers, name).from_pretrained(str(path)).to(device).eval()
        dim = self.model.config.d_model
        if expected_dim is not None and dim != expected_dim:
            raise ValueError(f"{key}={path}: d_model {dim} != model.text_embed_dim {expected_dim}")
        self.max_len, self.device = max_len, device
        self.encode = lru_cache(maxsize=cache_size)(self._encode)

    @torch.no_grad()
    def _encode(self, caption: str) -> torch.Tensor:
        """caption -> [max_len, d_model] fp32 on the CPU."""
        caption = prompt_clean(caption) if self.kind.clean else caption
        tokens = self.tokenizer(caption, padding="max_length", max_length=self.max_len, truncation=True,
                                add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids = tokens.input_ids.to(self.device)
        if not self.kind.masked:
            return self.model(input_ids=ids).last_hidden_state[0].float().cpu()      # (max_len, d)
        mask = tokens.attention_mask.to(self.device)
        hidden = self.model(ids, mask).last_hidden_state[0].float().cpu()            # (max_len, d)
        n = int(mask.gt(0).sum())                                                    # real tokens, EOS included
        hidden[n:] = 0.0
        return hidden
