"""Caption -> HunyuanVideo's text rows, as HunyuanVideoPipeline.encode_prompt builds them (diffusers 0.42):

    llama  = LlamaModel(tokens(template.format(caption)), mask).hidden_states[-3][crop_start:]   [L, 4096]
             (tokenised to L + crop_start with padding and truncation; the template's first crop_start tokens
             dropped; rows past the caption's real tokens set to zero: the family reads that as the text mask)
    pooled = CLIPTextModel(tokens(caption), 77 padded).pooler_output                            [768]
    rows   = [llama; pooled on every row]                                                       [L, 4096 + 768]

`path` is a HunyuanVideo pipeline folder (or one with the same four subfolders): text_encoder/ (LlamaModel),
tokenizer/, text_encoder_2/ (CLIPTextModel), tokenizer_2/. Nothing is downloaded.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

# HunyuanVideoPipeline's DEFAULT_PROMPT_TEMPLATE and its constants
TEMPLATE = ("<|start_header_id|>system<|end_header_id|>\n\nDescribe the video by detailing the following aspects: "
            "1. The main content and theme of the video."
            "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects."
            "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects."
            "4. background environment, light, style and atmosphere."
            "5. camera angles, movements, and transitions used in the video:<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>")
CROP_START = 95                 # the template's tokens before the caption
SKIP_LAYERS = 2                 # num_hidden_layers_to_skip: hidden_states[-3]
CLIP_LEN = 77
FOLDERS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")


def _check_folder(path: str | Path, key: str) -> list[str]:
    """What the folder lacks (before anything is loaded)."""
    path = Path(path)
    missing = [f for f in FOLDERS if not (path / f).is_dir()]
    if missing:
        return [f"{key}={path}: HunyuanVideo's captions need its pipeline folder with {', '.join(FOLDERS)}/ "
                f"(LlamaModel, its tokenizer, CLIPTextModel, its tokenizer); missing: {', '.join(missing)}"]
    return []


class LlamaClipTextEncoder:
    """`encode(caption) -> [max_len, llama_dim + pooled_dim]` fp32 on the CPU (models/text_encoder.py's interface)."""

    def __init__(self, path: str | Path, max_len: int, expected_dim: int | None = None, device="cpu",
                 cache_size: int = 4096, key: str = "data.text_encoder", template: str = TEMPLATE,
                 crop_start: int = CROP_START):
        import transformers

        problems = _check_folder(path, key)
        if problems:
            raise FileNotFoundError(problems[0])
        path = Path(path)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path / "tokenizer"))
        self.llama = transformers.LlamaModel.from_pretrained(str(path / "text_encoder")).to(device).eval()
        self.tokenizer_2 = transformers.AutoTokenizer.from_pretrained(str(path / "tokenizer_2"))
        self.clip = transformers.CLIPTextModel.from_pretrained(str(path / "text_encoder_2")).to(device).eval()
        dim = self.llama.config.hidden_size + self.clip.config.hidden_size
        if expected_dim is not None and dim != expected_dim:
            raise ValueError(f"{key}={path}: LLaMA hidden_size {self.llama.config.hidden_size} + CLIP hidden_size "
                             f"{self.clip.config.hidden_size} = {dim} != model.text_embed_dim {expected_dim}")
        self.max_len, self.device, self.template, self.crop_start = max_len, device, template, crop_start
        self.encode = lru_cache(maxsize=cache_size)(self._encode)

    check_folder = staticmethod(_check_folder)

    @torch.no_grad()
    def _encode(self, caption: str) -> torch.Tensor:
        tokens = self.tokenizer(self.template.format(caption), max_length=self.max_len + self.crop_start,
                                padding="max_length", truncation=True, return_attention_mask=True,
                                return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        hidden = self.llama(input_ids=tokens.input_ids.to(self.device), attention_mask=mask,
                            output_hidden_states=True).hidden_states[-(SKIP_LAYERS + 1)]
        llama = hidden[0, self.crop_start:].float().cpu()                                # (L, d_llama)
        llama[~mask[0, self.crop_start:].bool().cpu()] = 0.0                             # padding rows: zero
        ids = self.tokenizer_2(caption, padding="max_length", max_length=CLIP_LEN, truncation=True,
                               return_tensors="pt").input_ids
        pooled = self.clip(ids.to(self.device), output_hidden_states=False).pooler_output[0].float().cpu()
        return torch.cat([llama, pooled.expand(llama.shape[0], -1)], dim=-1)              # (L, d_llama + d_clip)
