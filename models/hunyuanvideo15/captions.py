"""Caption -> HunyuanVideo 1.5's text input, as HunyuanVideo15Pipeline.encode_prompt builds it (diffusers 0.42):

    qwen  = Qwen2_5_VLTextModel(chat_template([system, caption]), mask).hidden_states[-3][108:]     [Lq, 3584]
            (tokenised with add_generation_prompt to Lq + 108, padded and truncated; the template's first 108
            tokens dropped; rows past the caption's real tokens set to zero: the family reads that as the mask)
    glyph = T5EncoderModel(byT5 tokens('Text "a". Text "b". '), mask)[0]                            [G, 1472]
            (the caption's "quoted" or “quoted” texts, once each; none: all rows zero, as the pipeline's mask)
    rows  = [image_len zero rows (text-to-video: no SigLIP states); glyph; qwen]       [max_text_len, text_embed_dim]
            (glyph rows on their first glyph_dim channels, the rest zero: models/hunyuanvideo15/config.py)

`path` is a HunyuanVideo 1.5 pipeline folder (or one with the same four subfolders): text_encoder/
(Qwen2_5_VLTextModel), tokenizer/ (Qwen2Tokenizer with its chat template), text_encoder_2/ (T5EncoderModel, byT5),
tokenizer_2/ (ByT5Tokenizer). Nothing is downloaded. Image-to-video's SigLIP rows come from the first frame, not the
caption: models/hunyuanvideo15/siglip.py encodes them, and training and sampling put them in these zero rows.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import torch

from models.spec import missing_subfolders

# HunyuanVideo15Pipeline's system_message (its backslash-continued literal: the 8 spaces stay) and constants
SYSTEM_MESSAGE = ("You are a helpful assistant. Describe the video by detailing the following aspects: "
                  "        1. The main content and theme of the video. "
                  "        2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects. "
                  "        3. Actions, events, behaviors temporal relationships, physical movement changes of the objects. "
                  "        4. background environment, light, style and atmosphere. "
                  "        5. camera angles, movements, and transitions used in the video.")
CROP_START = 108                # prompt_template_encode_start_idx: the template's tokens before the caption
SKIP_LAYERS = 2                 # num_hidden_layers_to_skip: hidden_states[-3]
FOLDERS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")


def glyph_text(caption: str) -> str | None:
    """The pipeline's extract_glyph_texts: 'Text "a". Text "b". ' from the caption's quoted texts, or None."""
    found = [a or b for a, b in re.findall(r"\"(.*?)\"|“(.*?)”", caption)]
    found = list(dict.fromkeys(found)) if len(found) > 1 else found
    return ". ".join(f'Text "{text}"' for text in found) + ". " if found else None


def check_folder(path: str | Path, key: str) -> list[str]:
    """What the folder lacks (before anything is loaded)."""
    return missing_subfolders(path, key, FOLDERS, "HunyuanVideo 1.5 captions need a pipeline folder with {}/ "
                              "(Qwen2_5_VLTextModel; its tokenizer with the chat template; T5EncoderModel (byT5); "
                              "ByT5Tokenizer)")


class QwenByT5TextEncoder:
    """`encode(caption) -> [max_text_len, text_embed_dim]` fp32 on the CPU (models/text_encoder.py's interface)."""

    def __init__(self, path: str | Path, max_len: int, expected_dim: int | None = None, device="cpu",
                 cache_size: int = 4096, key: str = "data.text_encoder", model=None, crop_start: int = CROP_START):
        import transformers

        problems = check_folder(path, key)
        if problems:
            raise FileNotFoundError(problems[0])
        path = Path(path)
        self.image_len = getattr(model, "image_len", 729)
        self.glyph_len = getattr(model, "glyph_len", 256)
        self.qwen_len = max_len - self.image_len - self.glyph_len
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path / "tokenizer"))
        self.qwen = transformers.Qwen2_5_VLTextModel.from_pretrained(str(path / "text_encoder")).to(device).eval()
        self.tokenizer_2 = transformers.AutoTokenizer.from_pretrained(str(path / "tokenizer_2"))
        self.byt5 = transformers.T5EncoderModel.from_pretrained(str(path / "text_encoder_2")).to(device).eval()
        dims = {"text_embed_dim": (self.qwen.config.hidden_size, "Qwen2.5-VL hidden_size", expected_dim),
                "glyph_dim": (self.byt5.config.d_model, "byT5 d_model", getattr(model, "glyph_dim", None))}
        for name, (dim, what, want) in dims.items():
            if want is not None and dim != want:
                raise ValueError(f"{key}={path}: {what} {dim} != model.{name} {want}")
        if self.byt5.config.d_model > self.qwen.config.hidden_size:
            raise ValueError(f"{key}={path}: byT5 d_model {self.byt5.config.d_model} is wider than the Qwen2.5-VL "
                             f"rows ({self.qwen.config.hidden_size}); the text input packs it in their channels")
        self.device, self.crop_start = device, crop_start
        self.encode = lru_cache(maxsize=cache_size)(self._encode)

    @torch.no_grad()
    def _qwen(self, caption: str) -> torch.Tensor:
        chat = [[{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": caption or " "}]]
        tokens = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                    padding="max_length", truncation=True, return_tensors="pt",
                                                    max_length=self.qwen_len + self.crop_start)
        mask = tokens["attention_mask"].to(self.device)
        hidden = self.qwen(input_ids=tokens["input_ids"].to(self.device), attention_mask=mask,
                           output_hidden_states=True).hidden_states[-(SKIP_LAYERS + 1)]
        qwen = hidden[0, self.crop_start:].float().cpu()                                 # (Lq, d_qwen)
        qwen[~mask[0, self.crop_start:].bool().cpu()] = 0.0                              # padding rows: zero
        return qwen

    @torch.no_grad()
    def _glyph(self, caption: str) -> torch.Tensor:
        text = glyph_text(caption)
        if text is None:                                                   # no quoted text: all rows padding
            return torch.zeros(self.glyph_len, self.byt5.config.d_model)
        tokens = self.tokenizer_2(text, padding="max_length", max_length=self.glyph_len, truncation=True,
                                  add_special_tokens=True, return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        glyph = self.byt5(input_ids=tokens.input_ids.to(self.device), attention_mask=mask.float())[0][0].float().cpu()
        glyph[~mask[0].bool().cpu()] = 0.0                                               # padding rows: zero
        return glyph                                                                     # (G, d_byt5)

    def _encode(self, caption: str) -> torch.Tensor:
        qwen, glyph = self._qwen(caption), self._glyph(caption)
        rows = torch.zeros(self.image_len + self.glyph_len + self.qwen_len, qwen.shape[1])
        rows[self.image_len:self.image_len + self.glyph_len, :glyph.shape[1]] = glyph
        rows[self.image_len + self.glyph_len:] = qwen
        return rows


def caption_encoder(path: str | Path, max_len: int, expected_dim: int | None = None, device="cpu",
                    cache_size: int = 4096, key: str = "data.text_encoder", model=None):
    """The family's encoder (TextEncoderFormat.encoder)."""
    return QwenByT5TextEncoder(path, max_len, expected_dim, device, cache_size, key, model)


caption_encoder.check_folder = check_folder
