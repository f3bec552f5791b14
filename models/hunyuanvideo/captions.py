"""Caption -> HunyuanVideo's text rows, as HunyuanVideoPipeline.encode_prompt builds them (diffusers 0.42):

    llama  = LlamaModel(tokens(template.format(caption)), mask).hidden_states[-3][crop_start:]   [L, 4096]
             (tokenised to L + crop_start with padding and truncation; the template's first crop_start tokens
             dropped; rows past the caption's real tokens set to zero: the family reads that as the text mask)
    pooled = CLIPTextModel(tokens(caption), 77 padded).pooler_output                            [768]
    rows   = [llama; pooled on every row]                                                       [L, 4096 + 768]

`path` is a HunyuanVideo pipeline folder (or one with the same four subfolders): text_encoder/ (LlamaModel),
tokenizer/, text_encoder_2/ (CLIPTextModel), tokenizer_2/. Nothing is downloaded.

`model.text_encoder: t5_clip` (configs/opensora2.0.yaml) encodes as Open-Sora 2.0's HFEmbedder
(opensora/models/text/conditioner.py) instead, from the same four subfolders with text_encoder/ a T5EncoderModel:

    t5     = T5EncoderModel(tokens(caption) padded to L, attention_mask=None).last_hidden_state   [L, 4096]
    rows   = [t5; CLIP pooled on every row]          (padding rows kept: Open-Sora attends to them)
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from models.spec import missing_subfolders

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
    return missing_subfolders(path, key, FOLDERS, "HunyuanVideo-family captions need a pipeline folder with {}/ "
                              "(LlamaModel, or T5EncoderModel with model.text_encoder=t5_clip; its tokenizer; "
                              "CLIPTextModel; its tokenizer)")


class _Clip:
    """What both recipes share: the folder checked before anything loads, the caption's tokenizer (tokenizer/), and
    the CLIP pooled vector of a caption, as both pipelines take it (77 tokens, padded)."""

    def __init__(self, path: str | Path, max_len: int, device, cache_size: int, key: str):
        import transformers
        problems = _check_folder(path, key)
        if problems:
            raise FileNotFoundError(problems[0])
        path = Path(path)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path / "tokenizer"))
        self.tokenizer_2 = transformers.AutoTokenizer.from_pretrained(str(path / "tokenizer_2"))
        self.clip = transformers.CLIPTextModel.from_pretrained(str(path / "text_encoder_2")).to(device).eval()
        self.max_len, self.device = max_len, device
        self.encode = lru_cache(maxsize=cache_size)(self._encode)

    def pooled(self, caption: str) -> torch.Tensor:
        ids = self.tokenizer_2(caption, padding="max_length", max_length=CLIP_LEN, truncation=True,
                               return_tensors="pt").input_ids
        return self.clip(ids.to(self.clip.device), output_hidden_states=False).pooler_output[0].float().cpu()


class T5ClipTextEncoder(_Clip):
    """Open-Sora 2.0's rows: `encode(caption) -> [max_len, d_t5 + d_clip]` fp32 on the CPU."""

    def __init__(self, path: str | Path, max_len: int, expected_dim: int | None = None, device="cpu",
                 cache_size: int = 4096, key: str = "data.text_encoder"):
        import transformers

        super().__init__(path, max_len, device, cache_size, key)
        path = Path(path)
        self.t5 = transformers.T5EncoderModel.from_pretrained(str(path / "text_encoder")).to(device).eval()
        dim = self.t5.config.d_model + self.clip.config.hidden_size
        if expected_dim is not None and dim != expected_dim:
            raise ValueError(f"{key}={path}: T5 d_model {self.t5.config.d_model} + CLIP hidden_size "
                             f"{self.clip.config.hidden_size} = {dim} != model.text_embed_dim {expected_dim}")

    @torch.no_grad()
    def _encode(self, caption: str) -> torch.Tensor:
        ids = self.tokenizer(caption, truncation=True, max_length=self.max_len, padding="max_length",
                             return_tensors="pt").input_ids
        t5 = self.t5(input_ids=ids.to(self.device), attention_mask=None).last_hidden_state[0].float().cpu()
        return torch.cat([t5, self.pooled(caption).expand(t5.shape[0], -1)], dim=-1)       # (L, d_t5 + d_clip)


def caption_encoder(path: str | Path, max_len: int, expected_dim: int | None = None, device="cpu",
                    cache_size: int = 4096, key: str = "data.text_encoder", model=None):
    """The family's encoder (TextEncoderFormat.encoder): model.text_encoder's recipe."""
    kind = T5ClipTextEncoder if getattr(model, "text_encoder", "llama_clip") == "t5_clip" else LlamaClipTextEncoder
    return kind(path, max_len, expected_dim, device, cache_size, key)


caption_encoder.check_folder = _check_folder


class LlamaClipTextEncoder(_Clip):
    """`encode(caption) -> [max_len, llama_dim + pooled_dim]` fp32 on the CPU (models/text_encoder.py's interface)."""

    def __init__(self, path: str | Path, max_len: int, expected_dim: int | None = None, device="cpu",
                 cache_size: int = 4096, key: str = "data.text_encoder", template: str = TEMPLATE,
                 crop_start: int = CROP_START):
        import transformers

        super().__init__(path, max_len, device, cache_size, key)
        path = Path(path)
        self.llama = transformers.LlamaModel.from_pretrained(str(path / "text_encoder")).to(device).eval()
        dim = self.llama.config.hidden_size + self.clip.config.hidden_size
        if expected_dim is not None and dim != expected_dim:
            raise ValueError(f"{key}={path}: LLaMA hidden_size {self.llama.config.hidden_size} + CLIP hidden_size "
                             f"{self.clip.config.hidden_size} = {dim} != model.text_embed_dim {expected_dim}")
        self.template, self.crop_start = template, crop_start

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
        return torch.cat([llama, self.pooled(caption).expand(llama.shape[0], -1)], dim=-1)  # (L, d_llama + d_clip)
