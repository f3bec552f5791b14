"""The VAE (a diffusers folder of a class some registered family trains on): frames -> training latents and back.

Each class normalises latents as its release trains on them: the family's FamilySpec.formats.vae (a LatentFormat,
in the family's folder or models/shared/pipeline.py, e.g. CogVideoX's), found by the folder's `_class_name`; the
experiment's family names the class it takes, and a folder of another class is refused.
The latent is a draw from the VAE's posterior for the clip in [-1, 1] (as CogVideoX and finetrainers' Wan
train) or its mode. diffusers is an optional dependency (`pip install .[data]`), imported only when a VAE
is loaded. Compression, from the config: T frames -> (T - 1) / temporal + 1 latent frames, H -> H / spatial.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import torch



def _formats() -> dict:
    from models.registry import vae_formats
    return vae_formats()


def _what() -> str:
    return "a folder written by " + " or ".join(f"{name}.save_pretrained ({f.release})"
                                                for name, f in _formats().items())


def read_vae_config(path: str | Path, key: str = "--vae") -> dict:
    """config.json of a VAE folder written by `save_pretrained` (the `vae/` folder of a release)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{key}={path}: no such folder; expected {_what()}")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise FileNotFoundError(f"{key}={path}: cannot read config.json ({e}); expected {_what()}") from None
    if config.get("_class_name") not in _formats():
        raise ValueError(f"{key}={path}: config.json is a {config.get('_class_name')!r}; expected {_what()}")
    return config


def compression(config: dict) -> tuple[int, int]:
    """(temporal, spatial) downsampling factors of the encoder described by `config`."""
    return _formats()[config["_class_name"]].compression(config)


def check_vae(config: dict, model, data, key: str = "--vae") -> list[str]:
    """Disagreements between the VAE and the experiment's model (VAE class, latent channels, VAE scales) and clip
    size."""
    from models.registry import family

    name, wanted = config["_class_name"], family(model).formats.vae
    if name != wanted.class_name:
        problem = (f"{key}: an {name} folder, but model.family={model.family} trains on {wanted.class_name} latents "
                   f"(use {wanted.release}, or a config of a family that takes {name})")
        return [problem]
    temporal, spatial = compression(config)
    channels = wanted.channels(config)
    problems = []
    if channels != model.in_channels:
        problems.append(f"{key}: latent channels {channels} != model.in_channels={model.in_channels} (use the VAE the "
                        f"model was made for)")
    for what, factor, name in (("H and W", spatial, "vae_scale_spatial"), ("time", temporal, "vae_scale_temporal")):
        if factor != getattr(model, name):
            problems.append(f"{key}: the VAE downsamples {what} by {factor}, model.{name}={getattr(model, name)} "
                            f"(use the VAE the model was made for, or --set model.{name}={factor})")
    for name, size in (("height", data.height), ("width", data.width)):
        if size % spatial:
            problems.append(f"data.{name}={size} is not a multiple of the VAE's spatial factor {spatial}")
    if (data.num_frames - 1) % temporal:
        good = ", ".join(str(k * temporal + 1) for k in range(max(0, (data.num_frames - 1) // temporal - 1),
                                                              (data.num_frames - 1) // temporal + 2))
        problems.append(f"data.num_frames={data.num_frames}: the VAE takes 1 + k x {temporal} frames ({good})")
    return problems


def load_vae(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32):
    """The VAE in eval mode without gradients; nothing is downloaded."""
    name = read_vae_config(path)["_class_name"]
    try:
        import diffusers
    except ImportError as e:
        raise ImportError(f"the VAE needs diffusers ({e}): pip install '.[data]'") from None
    vae = getattr(diffusers, name).from_pretrained(str(path), torch_dtype=dtype, local_files_only=True)
    return vae.to(device).eval().requires_grad_(False)


def _format(vae):
    return _formats()[type(vae).__name__]


def statistics(vae) -> dict:
    """What the VAE's LatentFormat normalises with: its config, and the buffers the format names (`buffers`: LTX-2's
    latents_mean / latents_std, which config.json does not hold); the config itself for a format that names none."""
    names = getattr(_format(vae), "buffers", ())
    return {**vae.config, **{name: getattr(vae, name) for name in names}} if names else vae.config


@torch.no_grad()
def encode(vae, frames: np.ndarray, generator: torch.Generator | None = None, augment=None) -> torch.Tensor:
    """uint8 frames [T, H, W, 3] -> normalised latent [C, T', H', W'] fp32 on the CPU.

    With a generator the latent is a posterior draw (as CogVideoX trains); without, the posterior mode.
    `augment`: applied to the pixels (1, 3, T, H, W) in [-1, 1] (fp32, CPU) before encoding.
    """
    param = next(vae.parameters())
    x = torch.from_numpy(frames).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0   # (1, 3, T, H, W)
    x = (augment(x) if augment is not None else x).to(param.device, param.dtype)
    dist = vae.encode(x).latent_dist
    z = dist.sample(generator) if generator is not None else dist.mode()      # (1, C, T', H', W')
    return _format(vae).normalise(z.float(), statistics(vae))[0].cpu()


@torch.no_grad()
def decode(vae, latent: torch.Tensor) -> torch.Tensor:
    """Normalised latent [C, T', H', W'] -> frames [T, H, W, 3], floats in [0, 1] on the CPU."""
    param = next(vae.parameters())
    z = _format(vae).denormalise(latent[None].to(param.device, torch.float32), statistics(vae))
    x = vae.decode(z.to(param.dtype)).sample[0].float()                        # (3, T, H, W) in [-1, 1]
    return ((x.permute(1, 2, 3, 0) + 1.0) / 2.0).clamp(0.0, 1.0).cpu()


def default_dtype() -> torch.dtype:
    """bf16 on an accelerator that has it, else fp32 (CPUs run bf16 convolutions far slower)."""
    from parallel.distributed import accelerator
    return torch.bfloat16 if accelerator.name() != "cpu" and accelerator.is_bf16_supported() else torch.float32


@functools.lru_cache(maxsize=1)
def _decoding_vae(path: str):
    from parallel.distributed import accelerator
    vae = load_vae(path, accelerator.device(int(os.environ.get("LOCAL_RANK", 0))), default_dtype())
    vae.enable_tiling()
    return vae


def vae_decoder(path: str | Path):
    """A validation decoder (latent [C, T, H, W] -> frames) backed by the VAE folder at `path`.

    The folder is checked now; the VAE is loaded at the first call (on the logging rank, which decodes)
    and kept for later validations, on this process's device, with tiling so a full-size video fits
    beside training.
    """
    read_vae_config(path, key="val.decoder")
    if importlib.util.find_spec("diffusers") is None:
        raise ImportError(f"val.decoder={path}: decoding with the VAE needs diffusers: pip install '.[data]'")
    return lambda latent: decode(_decoding_vae(str(Path(path).resolve())), latent)
