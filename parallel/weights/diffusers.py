"""Released CogVideoX transformer weights in the diffusers layout: check, load into any layout, export.

A diffusers folder (`CogVideoXTransformer3DModel.save_pretrained`, or the `transformer/` folder of a
released pipeline) holds `config.json` and `diffusion_pytorch_model.safetensors`, or several shards
listed in `diffusion_pytorch_model.safetensors.index.json`. Toolkit names map to diffusers names:

    embed.patch_proj            patch_embed.proj (Conv2d [H, C, p, p] = our Linear [H, (C p q)], reshaped)
    embed.text_proj             patch_embed.text_proj
    embed.time_linear_{1,2}     time_embedding.linear_{1,2}
    blocks.i.norm{1,2}.*        transformer_blocks.i.norm{1,2}.*
    blocks.i.attn.to_qkv        transformer_blocks.i.attn1.to_{q,k,v} (fused: rows [q; k; v])
    blocks.i.attn.norm_{q,k}_{weight,bias}  transformer_blocks.i.attn1.norm_{q,k}.{weight,bias}
    blocks.i.attn.to_out        transformer_blocks.i.attn1.to_out.0
    blocks.i.ff_in / ff_out     transformer_blocks.i.ff.net.0.proj / ff.net.2
    final.norm_final            norm_final
    final.norm_out_linear       norm_out.linear
    final.norm_out              norm_out.norm
    final.proj_out              proj_out

`check_released` reads only config.json and the safetensors headers, so train.py refuses a mismatched
folder before any process group exists. `load_released` fills a built (not yet DeepSpeed-initialised)
model: each rank reads only the tensors of its pipeline stage, and of tensor-parallel ones only its
slice (`safe_open(...).get_slice(name)[rows]`). parallel/weights/diffusers_export.py writes any layout's weights (or
EMA) back in this layout.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import nn

from parallel.config import ModelConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"
CLASS_NAME = "CogVideoXTransformer3DModel"

_EMBED = {"patch_proj": "patch_embed.proj", "text_proj": "patch_embed.text_proj",
          "time_linear_1": "time_embedding.linear_1", "time_linear_2": "time_embedding.linear_2"}
_BLOCK = {"norm1.linear": "norm1.linear", "norm1.norm": "norm1.norm", "norm2.linear": "norm2.linear",
          "norm2.norm": "norm2.norm", "attn.to_out": "attn1.to_out.0", "ff_in": "ff.net.0.proj", "ff_out": "ff.net.2"}
_BLOCK_LEAF = {"attn.norm_q_weight": "attn1.norm_q.weight", "attn.norm_q_bias": "attn1.norm_q.bias",
               "attn.norm_k_weight": "attn1.norm_k.weight", "attn.norm_k_bias": "attn1.norm_k.bias"}
_FINAL = {"norm_final": "norm_final", "norm_out_linear": "norm_out.linear", "norm_out": "norm_out.norm",
          "proj_out": "proj_out"}
PATCH_WEIGHT = "embed.patch_proj.weight"


def diffusers_names(name: str) -> list[str]:
    """Diffusers tensor(s) of a canonical toolkit name; the fused QKV has three, in row order."""
    section, _, rest = name.partition(".")
    if section == "blocks":
        index, _, rest = rest.partition(".")
        prefix = f"transformer_blocks.{index}."
        if rest in _BLOCK_LEAF:
            return [prefix + _BLOCK_LEAF[rest]]
        module, _, leaf = rest.rpartition(".")
        if module == "attn.to_qkv":
            return [f"{prefix}attn1.to_{x}.{leaf}" for x in "qkv"]
        table = _BLOCK
    else:
        table, prefix = {"embed": _EMBED, "final": _FINAL}.get(section, {}), ""
        module, _, leaf = rest.rpartition(".")
    if module not in table:
        raise KeyError(f"{name} has no counterpart in diffusers' {CLASS_NAME}")
    return [f"{prefix}{table[module]}.{leaf}"]


# diffusers' CogVideoXTransformer3DModel arguments: (config.json key, its default, our key or None, ours).
def _config_pairs(m: ModelConfig) -> list[tuple[str, object, Optional[str], object]]:
    return [
        ("num_attention_heads", 30, "model.num_heads", m.num_heads),
        ("attention_head_dim", 64, "model.head_dim", m.head_dim),
        ("num_layers", 30, "model.num_layers", m.num_layers),
        ("in_channels", 16, "model.in_channels", m.in_channels),
        ("out_channels", 16, "model.in_channels", m.in_channels),
        ("time_embed_dim", 512, "model.time_embed_dim", m.time_embed_dim),
        ("text_embed_dim", 4096, "model.text_embed_dim", m.text_embed_dim),
        ("max_text_seq_length", 226, "model.max_text_len", m.max_text_len),
        ("patch_size", 2, "model.patch_size", m.patch_size),
        ("temporal_compression_ratio", 4, "model.vae_scale_temporal", m.vae_scale_temporal),
        ("flip_sin_to_cos", True, "model.flip_sin_to_cos", m.flip_sin_to_cos),
        ("freq_shift", 0, "model.freq_shift", m.freq_shift),
        ("spatial_interpolation_scale", 1.875, "model.spatial_interpolation_scale", m.spatial_interpolation_scale),
        ("temporal_interpolation_scale", 1.0, "model.temporal_interpolation_scale", m.temporal_interpolation_scale),
        ("sample_height", 60, "model.sample_height", m.sample_height),
        ("sample_width", 90, "model.sample_width", m.sample_width),
        ("use_rotary_positional_embeddings", False, "model.pos_embed", m.pos_embed == "rope3d"),
        # What the toolkit's model always is: these have no model.* key.
        ("patch_size_t", None, None, None),
        ("ofs_embed_dim", None, None, None),
        ("use_learned_positional_embeddings", False, None, False),
        ("patch_bias", True, None, True),
        ("attention_bias", True, None, True),
        ("activation_fn", "gelu-approximate", None, "gelu-approximate"),
        ("timestep_activation_fn", "silu", None, "silu"),
        ("norm_elementwise_affine", True, None, True),
        ("norm_eps", 1e-5, None, 1e-5),
        ("dropout", 0.0, None, 0.0),
    ]


def _show(value) -> str:
    return json.dumps(value)


def check_config(m: ModelConfig, folder: Path) -> list[str]:
    """config.json against the model section: one problem per differing key, naming both."""
    path = folder / CONFIG_NAME
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        return [f"{path}: cannot read ({e.strerror}); model.init_from must be a diffusers folder with "
                f"config.json and *.safetensors (a pipeline's transformer/ folder)"]
    except json.JSONDecodeError as e:
        return [f"{path}:{e.lineno}:{e.colno}: malformed JSON: {e.msg}"]
    problems = []
    kind = config.get("_class_name", CLASS_NAME)
    if kind != CLASS_NAME:
        problems.append(f"{path}: _class_name {kind} is not {CLASS_NAME}")
    for key, default, ours, value in _config_pairs(m):
        theirs = config.get(key, default)
        if key == "use_rotary_positional_embeddings":
            if bool(theirs) != value:
                problems.append(f"{path}: {key} {_show(theirs)} != model.pos_embed {m.pos_embed}; set "
                                f"--set model.pos_embed={'rope3d' if theirs else 'sincos'}")
        elif ours is None:
            if theirs != value:
                problems.append(f"{path}: {key} {_show(theirs)} is not supported (the toolkit's CogVideoX model "
                                f"has {_show(value)}; CogVideoX 1.0 text-to-video transformers, 2B and 5B, qualify)")
        elif theirs != value:
            problems.append(f"{path}: {key} {_show(theirs)} != {ours} {_show(value)}; set --set {ours}={_show(theirs)} "
                            f"or use the matching preset")
    if m.ffn_hidden_size not in (None, 4 * m.hidden_size):
        problems.append(f"{path}: the released FFN is 4 x hidden = {4 * m.hidden_size} wide, model.ffn_hidden_size "
                        f"is {m.ffn_hidden_size}; remove it")
    if m.patch_size_t != 1:
        problems.append(f"{path}: model.patch_size_t={m.patch_size_t}; CogVideoX 1.0 weights have no temporal "
                        f"patches (patch_size_t 1)")
    return problems


def tensor_files(folder: Path) -> dict[str, Path]:
    """Diffusers tensor name -> the safetensors file holding it (from the index when sharded)."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index (needs a weight_map of tensor -> file): {e}") from None
        files = {name: folder / file for name, file in weight_map.items()}
        missing = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if missing:
            raise ValueError(f"{index} lists shards that are not in {folder}: {', '.join(missing)}")
        return files
    candidates = [folder / WEIGHTS_NAME] if (folder / WEIGHTS_NAME).is_file() else sorted(folder.glob("*.safetensors"))
    if len(candidates) != 1:
        found = ", ".join(sorted(p.name for p in folder.iterdir())) if folder.is_dir() else "no such folder"
        hint = f"; the transformer of a pipeline is in {folder / 'transformer'}" \
            if (folder / "transformer" / CONFIG_NAME).is_file() else ""
        raise ValueError(f"{folder}: expected {WEIGHTS_NAME}, or shards with {INDEX_NAME} (found: {found}){hint}")
    from safetensors import safe_open
    with safe_open(str(candidates[0]), framework="pt") as f:
        return {name: candidates[0] for name in f.keys()}


def _shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open
    shapes = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if files.get(name) == path:
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def model_tensors(module: nn.Module, num_blocks: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) of every parameter and persistent buffer this rank holds."""
    from parallel.build import canonical_name
    yield from ((canonical_name(n, num_blocks), p) for n, p in module.named_parameters())
    yield from ((canonical_name(n, num_blocks), b) for n, b in module.named_buffers())


def diffusers_shapes(name: str, full: torch.Tensor, m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the diffusers tensors behind one full (tp = 1) toolkit tensor."""
    sources = diffusers_names(name)
    if name == PATCH_WEIGHT:
        return {sources[0]: (m.hidden_size, m.in_channels, m.patch_size, m.patch_size)}
    rows = full.shape[0] // len(sources)
    return {s: (rows, *full.shape[1:]) for s in sources}


def expected_tensors(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every diffusers tensor name of this model with its shape (the model built on the meta device)."""
    from parallel.config import ExperimentConfig
    from parallel.build import SequentialDiT, layer_specs
    from parallel.dist.topology import ParallelContext
    with torch.device("meta"):
        model = SequentialDiT(layer_specs(ExperimentConfig(model=m), ParallelContext.single()))
    out = {}
    for name, t in model_tensors(model, m.num_layers):
        out.update(diffusers_shapes(name, t, m))
    return out


def _listing(names: list[str], limit: int = 20) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_released(m: ModelConfig, folder: str | Path) -> list[str]:
    """Every problem with a diffusers folder for this model: config keys, missing, unexpected and
    mis-shaped tensors (reads config.json and the safetensors headers only)."""
    folder = Path(folder)
    problems = check_config(m, folder)
    if problems:
        return problems
    try:
        files = tensor_files(folder)
    except ValueError as e:
        return [str(e)]
    have, want = _shapes(files), expected_tensors(m)
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    if missing:
        problems.append(f"{folder}: {len(missing)} tensors of {CLASS_NAME} are missing: {_listing(missing)}")
    if unexpected:
        problems.append(f"{folder}: {len(unexpected)} tensors have no place in the toolkit's model: "
                        f"{_listing(unexpected)}")
    wrong = [f"{n} {list(have[n])} (expected {list(want[n])})" for n in sorted(set(have) & set(want))
             if have[n] != want[n]]
    if wrong:
        problems.append(f"{folder}: {len(wrong)} tensors have other shapes than the config implies: {_listing(wrong)}")
    return problems


def _rank_slices(name: str, p: torch.Tensor, ctx) -> list[tuple[str, tuple]]:
    """(diffusers name, index) pairs whose reads, concatenated along the partition dim, give this rank's p."""
    sources, r = diffusers_names(name), ctx.tp_rank
    if name == PATCH_WEIGHT or not getattr(p, "tensor_model_parallel", False):
        return [(s, (slice(None),)) for s in sources]
    if p.partition_dim == 1:                              # row-parallel: columns of the one source
        n = p.shape[1]
        return [(sources[0], (slice(None), slice(r * n, (r + 1) * n)))]
    local = getattr(p, "tp_parts", None) or [p.shape[0]]  # column-parallel: rows of each fused part
    return [(s, (slice(r * n, (r + 1) * n),)) for s, n in zip(sources, local)]


@torch.no_grad()
def load_released(module: nn.Module, ctx, m: ModelConfig, folder: str | Path) -> int:
    """Copy released weights into this rank's part of a built model (before deepspeed.initialize);
    returns the number of elements read. Raises ValueError listing every problem, before reading any."""
    from safetensors import safe_open
    folder = Path(folder)
    problems = check_released(m, folder)
    if problems:
        raise ValueError("\n".join(problems))
    files = tensor_files(folder)
    handles, read = {}, 0
    for name, target in model_tensors(module, m.num_layers):
        pieces = []
        for source, index in _rank_slices(name, target, ctx):
            path = files[source]
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt", device="cpu")
            pieces.append(handles[path].get_slice(source)[index])
        dim = 0 if name == PATCH_WEIGHT else getattr(target, "partition_dim", 0)
        value = torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]
        target.copy_(value.reshape(target.shape).to(target.dtype))
        read += value.numel()
    return read


def diffusers_config(m: ModelConfig, sample_frames: int = 49) -> dict:
    """The config.json of a CogVideoXTransformer3DModel equal to this model.

    sample_frames (diffusers: (latent frames - 1) x temporal compression + 1) only sizes a cache there.
    """
    try:
        from importlib.metadata import version
        diffusers_version = version("diffusers")
    except Exception:                                     # the optional extra is not installed
        diffusers_version = "0.30.0"
    config = {"_class_name": CLASS_NAME, "_diffusers_version": diffusers_version}
    for key, _, ours, value in _config_pairs(m):
        config[key] = value
    config["sample_frames"] = sample_frames
    return config
