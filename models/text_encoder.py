"""Caption -> text embeddings with a T5-family encoder from a local folder (`transformers`), as the
released pipeline that ships that encoder feeds its transformer.

The encoder class comes from the folder's config.json (`model_type`, else `architectures`), and each class is
used as the family that trains on it says (its FamilySpec.formats.text_encoder, a models.spec.TextEncoderFormat in the
family's folder or models/shared/: models/shared/pipeline.py's T5, models/wan/pipeline.py):
- not masked (CogVideoX's T5EncoderModel): the caption tokenised to exactly `max_len` tokens (padded,
  truncated), encoded without an attention mask; the last hidden state [max_len, d_model] is the text input,
  padding positions included.
- masked (Wan 2.1's UMT5EncoderModel): tokenised to `max_len` with the attention mask, encoded with that mask;
  the rows of the n real tokens kept and rows n..max_len-1 set to ZERO; `clean`: `prompt_clean` first.
Nothing is downloaded: `path` is a folder written by `save_pretrained` holding the encoder and its tokenizer.
A family whose captions need another recipe brings its own encoder (TextEncoderFormat.encoder: HunyuanVideo's
LLaMA + CLIP); `build_text_encoder` picks it.
"""
from __future__ import annotations

import html
import importlib.util
import json
import re
from functools import lru_cache
from pathlib import Path

import torch


def encoder_formats() -> dict:
    """The text-encoder formats of the registered families, by transformers class name."""
    from models.registry import text_encoder_formats
    return text_encoder_formats()


def encoder_class(config: dict) -> str | None:
    """The encoder class of a config.json ("T5EncoderModel", "UMT5EncoderModel"), or what it describes instead.
    By model_type first: a whole T5 checkpoint (T5ForConditionalGeneration: t5-v1_1-xxl, which SAT's CogVideoX
    reads) loads as its encoder alone, as the release's text_encoder/ folder holds it."""
    by_type = {f.model_type: name for name, f in encoder_formats().items()}
    return by_type.get(config.get("model_type")) or (config.get("architectures") or [None])[0]


def prompt_clean(text: str) -> str:
    """WanPipeline's prompt_clean (diffusers 0.42 pipelines/wan/pipeline_wan.py), ftfy only if installed as there."""
    if importlib.util.find_spec("ftfy") is not None:
        import ftfy
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def build_text_encoder(path: str | Path, max_len: int, expected_dim: int | None = None, device="cpu",
                       cache_size: int = 4096, expected=None, key: str = "data.text_encoder", model=None):
    """The caption encoder for a family's TextEncoderFormat `expected`: its own where it has one (HunyuanVideo's
    LLaMA + CLIP or Open-Sora 2.0's T5 + CLIP, by the model section `model`: models/hunyuanvideo/captions.py),
    else T5TextEncoder; `.encode(caption) -> [max_len, D]`."""
    if expected is not None and expected.encoder is not None:
        return expected.encoder(path, max_len, expected_dim, device, cache_size, key, model)
    return T5TextEncoder(path, max_len, expected_dim, device, cache_size, expected, key)


def check_encoder_folder(path: str | Path, expected, key: str) -> list[str] | None:
    """What a family's own encoder finds missing in `path` ([] when nothing), or None for the T5 path's check."""
    if expected is None or expected.encoder is None:
        return None
    return expected.encoder.check_folder(path, key) if hasattr(expected.encoder, "check_folder") else []


class T5TextEncoder:
    def __init__(self, path: str | Path, max_len: int, expected_dim: int | None = None, device="cpu",
                 cache_size: int = 4096, expected=None, key: str = "data.text_encoder"):
        """expected: the TextEncoderFormat the model's family trains on (FamilySpec.formats.text_encoder); None takes
        the folder's class as its registered family uses it."""
        import transformers

        path = Path(path)
        if expected is not None and not expected.prepared:
            raise ValueError(f"{key}={path}: this model family's captions are {expected.class_name} states as its "
                             f"release's pipeline builds them, not a T5 encoder's, and the toolkit does not encode them "
                             f"yet; give data prepared elsewhere (data.kind=directory, each caption's [max_text_len, text_embed_dim] "
                             f"tensor beside its latent: docs/data.md)")
        formats = encoder_formats()
        what = f"a folder saved with {' or '.join(formats)} .save_pretrained and its tokenizer"
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise FileNotFoundError(f"{key}={path}: cannot read config.json ({e}); expected {what}") from None
        name = encoder_class(config)
        if name not in formats:
            raise ValueError(f"{key}={path}: config.json describes {name!r}; expected {what}")
        if expected is not None and name != expected.class_name:
            raise ValueError(f"{key}={path}: a {name}, but this model family trains on {expected.class_name} "
                             "embeddings (the text_encoder/ folder of its release)")
        self.kind = expected or formats[name]
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
