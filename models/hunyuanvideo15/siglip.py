"""HunyuanVideo 1.5 image-to-video's SigLIP rows: the picture's states as HunyuanVideo15ImageToVideoPipeline
computes them (diffusers 0.42, `_get_image_embeds`), and where they go in the family's text input.

    pixels = SiglipImageProcessor.preprocess(picture, do_resize=True, do_convert_rgb=True)    [N, 3, S, S]
    states = SiglipVisionModel(pixels).last_hidden_state         (post-layernorm, no pooling head)  [N, I, image_dim]
    rows   = text with rows[:, :I, :image_dim] = states, the rest of those rows zero             [N, L, D]

I = (image_size / patch_size)^2: 729 for the release's SigLIP (384 px, patch 14: 27^2), no class token. The
pipeline computes the states once and feeds them to the conditional and the unconditional call alike (they are not
among its guider inputs): the toolkit puts them in the image rows of both (`text_rows`), after caption dropout.
The picture is the clip's first frame as training reads it (data.height x data.width, what the pipeline's
`resize(..., resize_mode="crop")` gives at that resolution), or `parallel.sample --image`.

The encoder folder is the release's pipeline folder (image_encoder/ SiglipVisionModel, feature_extractor/
SiglipImageProcessor) or one folder holding both (SiglipVisionModel.save_pretrained with preprocessor_config.json
beside it). Nothing is downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

WHAT = ("expected a HunyuanVideo 1.5 pipeline folder (image_encoder/ SiglipVisionModel, feature_extractor/ "
        "SiglipImageProcessor) or a folder written by SiglipVisionModel.save_pretrained with "
        "preprocessor_config.json beside it")


def folders(path) -> tuple[Path, Path]:
    """(encoder folder, image processor folder) of `path`: a pipeline folder's subfolders, else `path` itself."""
    path = Path(path)
    if (path / "image_encoder").is_dir():
        return path / "image_encoder", path / "feature_extractor"
    return path, path


def image_encoder_problems(path, model, key: str = "--image-encoder") -> list[str]:
    """What is wrong with `path` as the SigLIP encoder of `model` (config files only)."""
    encoder, processor = folders(path)
    try:
        config = json.loads((encoder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        return [f"{key}={path}: cannot read {encoder / 'config.json'} ({e}); {WHAT}"]
    config = config.get("vision_config", config)
    problems = []
    if config.get("hidden_size") != model.image_dim:
        problems.append(f"{key}={path}: SigLIP hidden_size {config.get('hidden_size')} != model.image_dim "
                        f"{model.image_dim}")
    tokens = (config.get("image_size", 224) // config.get("patch_size", 16)) ** 2
    if tokens != model.image_len:
        problems.append(f"{key}={path}: (image_size / patch_size)^2 = {tokens} SigLIP states != model.image_len "
                        f"{model.image_len} (the image rows of the text input)")
    if not (processor / "preprocessor_config.json").is_file():
        problems.append(f"{key}={path}: no {processor / 'preprocessor_config.json'}; {WHAT}")
    return problems


def load_image_encoder(path, device="cpu", dtype: torch.dtype = torch.float32):
    """(SiglipVisionModel, SiglipImageProcessor) from `path` (`folders`), eval mode, nothing downloaded."""
    from transformers import SiglipImageProcessor, SiglipVisionModel
    encoder, processor = folders(path)
    model = SiglipVisionModel.from_pretrained(str(encoder), torch_dtype=dtype, local_files_only=True)
    return model.to(device).eval().requires_grad_(False), SiglipImageProcessor.from_pretrained(str(processor))


@torch.no_grad()
def encode_image_states(encoder, processor, pictures: list) -> torch.Tensor:
    """Pictures (PIL images or uint8 [H, W, 3] arrays) -> SigLIP states [N, I, image_dim] fp32, as the pipeline's
    _get_image_embeds: the processor (resize to its size, rescale, normalise), the model's last_hidden_state."""
    param = next(encoder.parameters())
    pixels = processor.preprocess(images=pictures, do_resize=True, return_tensors="pt", do_convert_rgb=True)
    pixels = pixels.to(device=param.device, dtype=param.dtype)
    return encoder(**pixels).last_hidden_state.float().cpu()


def text_rows(text: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """text [B, L, D] with its first I rows = the SigLIP states [B, I, image_dim] on their first channels, the
    rest of those rows zero (models/hunyuanvideo15/config.py's layout); a new tensor."""
    out = text.clone()
    out[:, :states.shape[1]] = 0
    out[:, :states.shape[1], :states.shape[2]] = states.to(text.dtype)
    return out
