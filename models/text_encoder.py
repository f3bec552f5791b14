"""Caption -> text embeddings with a T5 encoder from a local folder (`transformers`), as CogVideoX does.

Captions are tokenised to exactly `max_len` tokens (padded, truncated) and the encoder's last hidden
state [max_len, d_model] is the text input of the DiT, padding positions included (CogVideoX pads to
226 tokens and attends to all of them). Nothing is downloaded: `path` is a folder written by
`save_pretrained` holding the encoder and its tokenizer.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


class T5TextEncoder:
    def __init__(self, path: str | Path, max_len: int, expected_dim: int | None = None, device="cpu",
                 cache_size: int = 4096):
        from transformers import AutoTokenizer, T5EncoderModel

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"data.text_encoder={path}: no config.json there (a folder saved with "
                                    "T5EncoderModel.save_pretrained and its tokenizer)")
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = T5EncoderModel.from_pretrained(str(path)).to(device).eval()
        dim = self.model.config.d_model
        if expected_dim is not None and dim != expected_dim:
            raise ValueError(f"data.text_encoder={path}: d_model {dim} != model.text_embed_dim {expected_dim}")
        self.max_len, self.device = max_len, device
        self.encode = lru_cache(maxsize=cache_size)(self._encode)

    @torch.no_grad()
    def _encode(self, caption: str) -> torch.Tensor:
        tokens = self.tokenizer(caption, padding="max_length", max_length=self.max_len, truncation=True,
                                return_tensors="pt")
        hidden = self.model(input_ids=tokens.input_ids.to(self.device)).last_hidden_state   # (1, max_len, d)
        return hidden[0].float().cpu()
