"""Caption -> LTX-2's two caption states, as LTX2Pipeline builds them (diffusers 0.42 `_get_gemma_prompt_embeds`,
then its `connectors`):

    ids, mask  tokenizer(caption.strip()), left-padded (pad = eos where it has none) to L = model.max_text_len
    h          Gemma3ForConditionalGeneration(ids, mask).hidden_states: the embeddings and every layer's output,
               stacked on the last axis and flattened                                       [1, L, D x (layers + 1)]
    text, audio_text = LTX2TextConnectors(h, mask, padding_side="left")[:2]                  [L, D_video], [L, D_audio]

`path` is an LTX-2 diffusers release folder (or one with the same subfolders): text_encoder/, tokenizer/,
connectors/. The toolkit's transformer attends to every caption row (no mask), which the release's connector makes
true: it moves the padding out and fills it with its learned registers, unmasking every row; a connector without
registers (which would need the mask downstream) is refused. Nothing is downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from models.spec import missing_subfolders

FOLDERS = ("text_encoder", "tokenizer", "connectors")


def _check_folder(path: str | Path, key: str) -> list[str]:
    """What the folder lacks (before anything is loaded)."""
    return missing_subfolders(path, key, FOLDERS, "LTX-2 captions need a release folder with the subfolders {} "
                              "(Gemma3ForConditionalGeneration, its tokenizer, LTX2TextConnectors)")


def json_config(path: Path, key: str) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{key}={path}: cannot read config.json ({e})") from None


def config_problems(path: Path, key: str, max_len: int, dims: tuple[int, int]) -> list[str]:
    """text_encoder/ and connectors/ (config.json only) against each other and the model section: Gemma's width and
    hidden states as the connector's input, the registers, and the connector's widths as the caption states'."""
    gemma, connectors = json_config(path / "text_encoder", key), json_config(path / "connectors", key)
    text = gemma.get("text_config", {})
    problems = [] if gemma.get("model_type") == "gemma3" else [
        f"{key}={path}: text_encoder/config.json has model_type {gemma.get('model_type')!r}; LTX-2 reads "
        f"Gemma3ForConditionalGeneration states (model_type gemma3)"]
    width, layers = text.get("hidden_size"), text.get("num_hidden_layers")
    wants = connectors.get("caption_channels", 3840), connectors.get("text_proj_in_factor", 49)
    if (width, layers + 1 if layers else None) != wants:
        problems.append(f"{key}={path}: Gemma's hidden_size {width} and {layers} layers (+ embeddings) != the "
                        f"connector's caption_channels {wants[0]} x text_proj_in_factor {wants[1]}")
    for stream, want, name in zip(("video", "audio"), dims, ("text_embed_dim", "audio_caption_dim")):
        heads = connectors.get(f"{stream}_connector_num_attention_heads", 30)
        width = heads * connectors.get(f"{stream}_connector_attention_head_dim", 128)
        if width != want:
            problems.append(f"{key}={path}: the {stream} connector gives {width}-wide caption states, the model takes "
                            f"{want} (model.{name}; use the release the transformer was made for)")
        registers = connectors.get(f"{stream}_connector_num_learnable_registers", 128)
        if not registers or max_len % registers:
            problems.append(f"{key}={path}: the {stream} connector's {registers} learnable registers: the toolkit "
                            f"needs registers dividing model.max_text_len={max_len} (it trains without caption masks)")
    return problems


class LTX2CaptionEncoder:
    """`encode(caption) -> {"text": [L, D_video], "audio_text": [L, D_audio]}` fp32 on the CPU (a prepared sample's
    text file; models/text_encoder.py's interface with one tensor a stream)."""

    def __init__(self, path: str | Path, max_len: int, expected_dim: int | None = None, device="cpu",
                 cache_size: int = 0, key: str = "--t5", model=None):
        import transformers
        from diffusers.pipelines.ltx2 import LTX2TextConnectors

        path = Path(path)
        problems = _check_folder(path, key)
        dims = (model.text_embed_dim, model.audio_caption_dim) if model is not None else None
        problems = problems or (config_problems(path, key, max_len, dims) if dims else [])
        if problems:
            raise ValueError("\n".join(problems))
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path / "tokenizer"))
        self.tokenizer.padding_side = "left"                       # the pipeline's: Gemma pads on the left
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.gemma = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(path / "text_encoder"))
        self.gemma = self.gemma.to(device).eval()
        self.connectors = LTX2TextConnectors.from_pretrained(str(path / "connectors")).to(device).eval()
        self.max_len, self.device = max_len, device

    @torch.no_grad()
    def encode(self, caption: str) -> dict[str, torch.Tensor]:
        tokens = self.tokenizer([caption.strip()], padding="max_length", max_length=self.max_len, truncation=True,
                                add_special_tokens=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        hidden = self.gemma(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        states = torch.stack(hidden, dim=-1).flatten(2, 3).to(self.connectors.dtype)     # (1, L, D x (layers + 1))
        video, audio, _ = self.connectors(states, mask, padding_side="left")
        return {"text": video[0].float().cpu(), "audio_text": audio[0].float().cpu()}


def caption_encoder(path: str | Path, max_len: int, expected_dim: int | None = None, device="cpu",
                    cache_size: int = 0, key: str = "--t5", model=None) -> LTX2CaptionEncoder:
    """The family's encoder (TextEncoderFormat.encoder)."""
    return LTX2CaptionEncoder(path, max_len, expected_dim, device, cache_size, key, model)


caption_encoder.check_folder = _check_folder
