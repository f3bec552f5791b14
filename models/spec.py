"""What a model family is, in one place: the `FamilySpec` every family folder exports.

The checker, the planner and its tracer, `python -m models`, the model builder, the released-weights
reader and writer, data preparation (VAE latents, text embeddings), the training batches (objective inputs,
timesteps, conditioning) and the samplers ask a family's spec; none of them tests a family's name. Every
field of a family's formats, timesteps and sampler is required: no family inherits another's VAE, text encoder,
timesteps or sampler by default. Adding
a family is one folder under models/ that defines a spec, and one line in models/registry.py (or, for a
family kept elsewhere, `models.registry.register` called by a module the experiment names under `families:`).

A family's network is a list of stages, embed -> layer_0 .. layer_{L-1} -> final, each taking and
returning a tuple (the stage tuple: the hidden states x [B, S, H] first (LTX-2: x and its audio stream, `streams`),
then tensors every layer reads and passes on unchanged), so the same list runs in one module or as DeepSpeed
pipeline stages.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch
from torch import nn

from models.config import ModelConfig, set_flag
from models.geometry import latent_shape, token_grid


class ReleasedFormat(Protocol):
    """How another library publishes this family's transformer (diffusers' `save_pretrained` folder):
    the config translation and the tensor-name map; parallel/weights/ does the reading and writing. The
    reference_* methods run the released library's own model on the toolkit's inputs (parallel/verify.py,
    bench/peer.py)."""

    class_name: str                    # the `_class_name` in config.json
    # the model's predictions, in order: ("prediction",) for one tensor, ("video", "audio") for LTX-2's pair
    predictions: tuple[str, ...]

    def check_config(self, model: ModelConfig, config: dict, path: str) -> list[str]:
        """Every key of a released config.json that disagrees with the model section, named."""

    def config(self, model: ModelConfig, data) -> dict:
        """The config.json of a released model equal to this one."""

    def names(self, name: str) -> list[str]:
        """The released tensors behind one canonical toolkit name (`blocks.3.attn.to_qkv.weight`), in
        row order when several are fused into one toolkit tensor."""

    def shapes(self, name: str, shape: tuple[int, ...], model: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Shapes of the released tensors behind one full (tp = 1) toolkit tensor of `shape`."""

    def example_inputs(self, model: ModelConfig, data, batch: int, generator) -> tuple:
        """A random batch the transformer takes: (latents [B, C_in, T, H, W], timesteps [B], text [B, L, D])."""

    def prediction_like(self, model: ModelConfig, inputs: tuple):
        """Tensors of the prediction's shape for `inputs` (parallel.validation.validate.StageForward.predict's
        `like`): one, or a tuple of one per `predictions` when there are several."""

    def reference_model(self, folder: str) -> nn.Module:
        """The released library's model read from a `save_pretrained` folder, at fp32, in eval mode."""

    def reference_kwargs(self, model: nn.Module, inputs: tuple) -> dict:
        """The keyword arguments the released pipeline adds to the transformer's call for inputs of these shapes
        (rotary tables, ofs), on the latents' device: computed once per shape, as the pipeline does before
        its denoising loop."""

    def reference_call(self, model: nn.Module, inputs: tuple, kwargs: dict):
        """The released model's prediction [B, C, T, H, W] on the toolkit's `inputs` (its own layout and call
        convention inside); grad-able: no no_grad, no dtype change (the bench trains through it)."""

    def reference(self, folder: str, inputs: tuple, place: Optional[Callable[[nn.Module], torch.device]] = None):
        """The released prediction [B, C, T, H, W] (a tuple where there are several `predictions`) at fp32 under
        no_grad, on the host: reference_model, then reference_call with reference_kwargs (parallel/verify.py's
        oracle); `place(model)` is the device it computes on (default the host's), given the loaded model."""


class DiffusersFormat:
    """What the ReleasedFormat of every diffusers-published family shares: the example batch, one prediction of
    the latents' shape, the model read from a folder by its class name, no extra call arguments, and `reference`
    built from the three. A family subclasses it and gives class_name, the config translation, the name map and
    `reference_call`."""

    class_name: str
    predictions: tuple[str, ...] = ("prediction",)

    def example_inputs(self, model: ModelConfig, data, batch: int, generator) -> tuple:
        """(latents [B, C_in, T, H, W], integer timesteps [B] in [0, 1000), text [B, max_text_len, text_embed_dim],
        then any conditioning input the model takes (ModelConfig.extra_input_shapes), each [B, *shape])."""
        latents = torch.randn(batch, model.transformer_in_channels, *latent_shape(model, data), generator=generator)
        timesteps = torch.randint(0, 1000, (batch,), generator=generator)
        text = torch.randn(batch, model.max_text_len, model.text_embed_dim, generator=generator)
        return (latents, timesteps, text,
                *(torch.randn(batch, *shape, generator=generator) for shape in model.extra_input_shapes()))

    def prediction_like(self, model: ModelConfig, inputs: tuple) -> torch.Tensor:
        """[B, C, T, H, W] of the latents' grid (C = model.in_channels: an image condition's channels are input
        only)."""
        return torch.empty(len(inputs[0]), model.in_channels, *inputs[0].shape[2:])

    def reference_model(self, folder: str) -> nn.Module:
        import diffusers
        return getattr(diffusers, self.class_name).from_pretrained(folder, torch_dtype=torch.float32).eval()

    def reference_kwargs(self, model: nn.Module, inputs: tuple) -> dict:
        return {}

    def reference(self, folder: str, inputs: tuple, place=None) -> torch.Tensor:
        model, inputs = placed(self.reference_model(folder), inputs, place)
        with torch.no_grad():
            return self.reference_call(model, inputs, self.reference_kwargs(model, inputs)).float().cpu()


def placed(model: nn.Module, inputs: tuple, place) -> tuple[nn.Module, tuple]:
    """The model and the tensors of `inputs` on `place(model)`'s device (FamilyFormat.reference), or as they are."""
    if place is None:
        return model, inputs
    device = place(model)
    return model.to(device), tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)


class LatentFormat(Protocol):
    """A VAE folder class (diffusers' `_class_name`) and how its release normalises latents for training
    (models/vae.py reads and writes through it; models/shared/pipeline.py, models/wan/pipeline.py). A format whose
    statistics are the VAE module's buffers, not config.json's keys, names them in an optional `buffers` tuple
    (LTX-2's latents_mean / latents_std): models/vae.py hands them over in `config` beside its keys."""

    class_name: str                    # `_class_name` of the VAE folder's config.json
    release: str                       # where a user finds such a folder, for messages

    def channels(self, config: dict) -> Optional[int]:
        """Latent channels of the VAE described by `config`."""

    def compression(self, config: dict) -> tuple[int, int]:
        """(temporal, spatial) downsampling factors."""

    def normalise(self, z: torch.Tensor, config) -> torch.Tensor:
        """Posterior latent (1, C, T, H, W) fp32 -> training latent."""

    def denormalise(self, z: torch.Tensor, config) -> torch.Tensor:
        """Training latent (1, C, T, H, W) fp32 -> what vae.decode takes."""


@dataclass(frozen=True)
class TextEncoderFormat:
    """A text encoder class (transformers) and how the release's pipeline turns a caption into the
    transformer's text input with it (models/text_encoder.py)."""

    class_name: str       # transformers class ("T5EncoderModel"); also the `architectures` entry of its config.json
    model_type: str       # config.json `model_type` ("t5"): a whole checkpoint of that type loads as this encoder
    masked: bool          # encode with the attention mask and zero the padding rows; else keep them (no mask)
    clean: bool           # WanPipeline's prompt_clean (ftfy, HTML unescape, whitespace) before tokenising
    prepared: bool = True  # False: models/text_encoder.py's T5 path does not encode this release's captions
    # The family's own encoder class where the T5 path does not fit (HunyuanVideo: LLaMA + CLIP), built by
    # models/text_encoder.build_text_encoder as (path, max_len, expected_dim, device, cache_size, key, model); its
    # `check_folder(path, key)` lists what a folder lacks. None with prepared False: refused by name.
    encoder: Optional[Callable] = None


def missing_subfolders(path, key: str, folders: tuple[str, ...], needs: str) -> list[str]:
    """A family encoder's `check_folder` (TextEncoderFormat.encoder), before anything loads: `key=path: <needs>;
    missing: <each of `folders` not in path>`, or [] ("{}" in `needs` stands for the folders' list)."""
    path = Path(path)
    missing = [f for f in folders if not (path / f).is_dir()]
    return [f"{key}={path}: {needs.format(', '.join(folders))}; missing: {', '.join(missing)}"] if missing else []


@dataclass(frozen=True)
class CheckpointFormat:
    """A checkpoint of the family's besides its diffusers release: one .safetensors file under its own code's tensor
    names (Open-Sora 2.0's for HunyuanVideo). model.init_from=<the file> reads it and `python -m parallel.export
    --format opensora` writes it (parallel/weights/opensora.py, for any layout); the family gives the name map and
    its exact rewrites, between full (tp = 1) tensors."""

    title: str                # how messages name it ("Open-Sora 2.0")
    file_name: str            # the file its own code loads ("Open_Sora_v2.safetensors")
    problems: Callable[[ModelConfig], list[str]]           # what keeps a model section from it, each with its key
    names: Callable[[str, ModelConfig], list[str]]         # toolkit name -> its tensors', in from_checkpoint's order
    shapes: Callable[[str, tuple, ModelConfig], dict]      # (toolkit name, full shape) -> {its name: shape}
    from_checkpoint: Callable[[str, list, ModelConfig], torch.Tensor]   # (toolkit name, its tensors) -> full tensor
    to_checkpoint: Callable[[str, torch.Tensor, ModelConfig], dict]     # (toolkit name, full tensor) -> {its name: t}


class SchedulerFormat(Protocol):
    """The release's `scheduler/scheduler_config.json` against the model section (parallel/weights/scheduler.py
    reads the file; the family says what its keys mean)."""

    def check(self, model: ModelConfig, config: dict, path: str) -> list[str]:
        """Every key that disagrees with model.objective / model.schedule, named with the --set that fixes it."""


@dataclass(frozen=True)
class Sampling:
    """How the family samples (models/sampling.py) and reads its release's schedule."""

    # objective -> the samplers (models/sampling.py names, or one of the family's own whose second stream samples:
    # LTX-2's "ltx2") that fit it, the first used when val.sampler is unset
    samplers: dict[str, tuple[str, ...]]
    scheduler: Optional[SchedulerFormat]      # the release's scheduler_config.json; None: no released pipeline
    # (model, guidance_scale, guidance_scale_2) -> the sampler's guidance, a float or a function of the timestep
    # (models/sampling.py `family_guidance`); None: the family takes no guidance_scale_2.
    guidance: Optional[Callable] = None


class TimestepSampling(Protocol):
    """The training timesteps of one sample (parallel/train/data.py), drawn from the sample's generator after
    its noise: per sample, a [1] integer tensor in [0, 1000); per token, [1, T, H, W] on the latent grid
    (constant within a patch). models/diffusion.py broadcasts either over the latent; the family's embed stage
    takes what `model_timesteps` makes of it ([B] or [B, T, H, W])."""

    per_token: bool | Callable[[ModelConfig], bool]     # or a function of the model, where its config decides

    def draw(self, generator: torch.Generator, latent_shape: tuple[int, ...], model: ModelConfig) -> torch.Tensor:
        """latent_shape: the sample's [C, T, H, W]."""


@dataclass(frozen=True)
class Expert:
    """One of the transformers a family switches between by timestep (Wan 2.2 A14B: high noise, then low).
    An expert serves the timesteps t with boundary <= t < the previous expert's boundary (experts ordered from
    the highest noise down, the last boundary 0)."""

    name: str
    boundary: int


@dataclass(frozen=True)
class Network:
    """A family's stages (embed -> layer x L -> final) and what selective recomputation wraps in a layer."""

    embed: type[nn.Module]                    # (latents, timesteps, text, *extra inputs) -> stage tuple
    layer: type[nn.Module]                    # stage tuple -> stage tuple; the unit pipelines split and recompute
    final: type[nn.Module]                    # stage tuple -> prediction [B, C, T, H, W]; .assemble() under sp
    # Selective recomputation (parallel/model/recompute.py): per granularity ("attention", "mlp"), the dotted paths,
    # relative to one layer, of the modules or methods a checkpoint wraps (`attn.core`, `mlp`).
    recompute_parts: dict[str, tuple[str, ...]]
    # The stage tuple's first `streams` tensors are hidden states every layer updates (LTX-2: video x and audio
    # a); the rest are side tensors the layers read and pass on unchanged. The planner counts the streams as what
    # a layer takes and a checkpoint keeps (parallel/plan/trace.py).
    streams: int = 1


@dataclass(frozen=True)
class Costs:
    """What the planner (parallel/plan/) counts per layer, written by hand and checked against the network's own
    collectives (tests/distributed/test_family_comm_counts.py)."""

    text_in_sequence: bool                    # text tokens join x (CogVideoX) or enter by cross-attention (STDiT)
    # b x S x H all-reduces in one layer's forward under tp: a count, or (model) -> the mean over the layers where
    # layers differ (HunyuanVideo: dual-stream blocks 2, single-stream 1); see FamilySpec.row_parallel
    row_parallel_per_layer: "int | Callable[[ModelConfig], float]"
    attention_pairs: Callable[[ModelConfig, tuple[int, int, int]], int]   # (query, key) pairs a layer scores
    attentions_per_layer: int = 1             # self-attentions per layer: Ulysses all-to-all sets


@dataclass(frozen=True)
class Wording:
    """How `python -m models` and the planner's messages name the layers."""

    describe_layers: Callable[[ModelConfig], str]                         # "30 blocks", "28 layers (...)"
    layer_noun: str = "block"


@dataclass(frozen=True)
class Formats:
    """The files the family reads and writes: the data it trains on, as its release's pipeline feeds them (the VAE
    whose normalised latents it takes, models/vae.py; the text encoder whose embeddings it reads,
    models/text_encoder.py), and its published weights."""

    vae: LatentFormat
    text_encoder: TextEncoderFormat
    released: Optional[ReleasedFormat]        # None: no published format (no init_from, toolkit-format export)
    checkpoint: Optional[CheckpointFormat] = None   # a single-file checkpoint of its own code's (Open-Sora 2.0's)


@dataclass(frozen=True)
class FamilySpec:
    """A model family: its config, its network, the planner's costs, its wording, its file formats, and how it
    trains and samples. A family fills at most 10 required fields (tests/unit/test_family_registry.py)."""

    name: str
    config: type[ModelConfig]                 # the `model:` section of this family (fields, defaults, checks)
    network: Network
    costs: Costs
    wording: Wording
    formats: Formats
    timesteps: TimestepSampling               # per sample or per token (models/diffusion.py)
    sampling: Sampling                        # its samplers and its release's scheduler
    # (model, data) -> None, or a training-input hook: (x_t, x0, keep [B] bool) -> the first stage's latents
    # (image-to-video: x_t with the image latents on channels), its `.dropout` the probability of keep False; an
    # optional `timesteps(t, keep)` sets the drawn timesteps before the batch is noised (LTX-2: frame 0 at 0 where
    # kept), and with `loss_skip_frames` and `.dropout` > 0 the batch's target ends with keep (the loss's mask).
    # None: text-to-video.
    condition: Optional[Callable] = None
    # Transformers chosen by timestep, highest noise first (empty: one transformer); see `expert`.
    experts: tuple[Expert, ...] = field(default=())
    # (model, data) -> None, or the hook of a second noised stream in the training batch (LTX-2's audio,
    # models/ltx2/training.py AudioStream): what a sample stores of it (`shapes`), its noise, its inputs after the
    # text and its target (the batch's target a tuple), and the loss over both streams; for sampling
    # (parallel/train/sampling.py) its noise after the video's, the model's inputs at both streams, the sampler that
    # steps both (`sample`, which the family's own sampler name in Sampling.samplers stands for) and its `min_steps`.
    second_stream: Optional[Callable] = None

    def __post_init__(self):
        bounds = [e.boundary for e in self.experts]
        falling = bounds == sorted(set(bounds), reverse=True)
        if self.experts and (not falling or bounds[-1] != 0):
            raise ValueError(f"family {self.name}: expert boundaries {bounds} must fall strictly, ending at 0")

    def expert(self, t: torch.Tensor) -> torch.Tensor:
        """The index of the expert serving each timestep of t (any shape, integer or fractional): the first,
        from the highest noise down, whose boundary <= t."""
        if not self.experts:
            return torch.zeros_like(t, dtype=torch.long)
        bounds = torch.tensor([e.boundary for e in self.experts], dtype=torch.float64, device=t.device)
        return (t.double().unsqueeze(-1) < bounds).sum(-1)

    def row_parallel(self, model: ModelConfig) -> float:
        """b x S x H all-reduces per layer's forward under tp, the mean over the model's layers."""
        n = self.costs.row_parallel_per_layer
        return n(model) if callable(n) else n

    def training_condition(self, model: ModelConfig, data):
        return self.condition(model, data) if self.condition else None

    def training_stream(self, model: ModelConfig, data):
        return self.second_stream(model, data) if self.second_stream else None

    def sequence_tokens(self, model: ModelConfig, data) -> int:
        """Length of the sequence x the layers see (and sequence parallelism splits)."""
        t, h, w = token_grid(model, data)
        return (model.max_text_len if self.costs.text_in_sequence else 0) + t * h * w

    def describe_tokens(self, model: ModelConfig, data) -> str:
        t, h, w = token_grid(model, data)
        video = t * h * w
        if self.costs.text_in_sequence:
            return f"{video} video tokens + {model.max_text_len} text tokens = {video + model.max_text_len}"
        return f"{video} video tokens, cross-attending to {model.max_text_len} text tokens"


def show(value) -> str:
    """A config.json value as config.json writes it (true, null, [1, 2, 2])."""
    return json.dumps(value)


def config_problems(pairs, config: dict, path: str, qualify: str,
                    special: Optional[dict[str, Callable]] = None) -> list[str]:
    """A ReleasedFormat's config check: each (diffusers key, its default, the toolkit key or None, the toolkit's
    value) of `pairs` against `config` (config.json at `path`). Equal: nothing. A key with a family message of
    its own goes to `special[key](theirs, value)` (a problem or None); a key the toolkit cannot set is
    unsupported (`qualify`: "the toolkit's X model has V; <qualify>"); any other names the --set that fixes it.
    Heads or head_dim that multiply to another width name model.hidden_size's --set too (diffusers has no such
    key: inner_dim = num_attention_heads x attention_head_dim)."""
    problems = []
    for key, default, ours, value in pairs:
        theirs = config.get(key, default)
        theirs = list(theirs) if isinstance(theirs, tuple) else theirs
        if special and key in special:
            problem = special[key](theirs, value)
            problems += [f"{path}: {problem}"] if problem else []
        elif theirs == value:
            continue
        elif ours is None:
            problems.append(f"{path}: {key} {show(theirs)} is not supported ({qualify.format(show(value))})")
        else:
            problems.append(f"{path}: {key} {show(theirs)} != {ours} {show(value)}; set {set_flag(ours, theirs)} "
                            f"or use the matching preset")
    return problems + hidden_size_problems(pairs, config, path)


def release_hidden_size(pairs, config: dict) -> Optional[int]:
    """The release's width, num_attention_heads x attention_head_dim of its config.json (None when `pairs`,
    a ReleasedFormat's config pairs, has neither key)."""
    found = {key: config.get(key, default) for key, default, _, _ in pairs
             if key in ("num_attention_heads", "attention_head_dim")}
    return found["num_attention_heads"] * found["attention_head_dim"] if len(found) == 2 else None


def hidden_size_problems(pairs, config: dict, path: str) -> list[str]:
    """model.hidden_size's --set when the release's heads x head_dim is another width than the section's."""
    ours = {key: value for key, _, _, value in pairs if key in ("num_attention_heads", "attention_head_dim")}
    theirs = release_hidden_size(pairs, config)
    if theirs is None or theirs == ours["num_attention_heads"] * ours["attention_head_dim"]:
        return []
    heads, dim = (config.get(key, default) for key, default, _, _ in pairs
                  if key in ("num_attention_heads", "attention_head_dim"))
    return [f"{path}: num_attention_heads x attention_head_dim = {heads} x {dim} = {theirs} != model.hidden_size "
            f"{ours['num_attention_heads'] * ours['attention_head_dim']}; set {set_flag('model.hidden_size', theirs)}"]


def image_rows(condition, text: torch.Tensor, stored) -> torch.Tensor:
    """text [B, L, D] with the stored image states (the second of parallel/train/data.py's STORED_CONDITION) as
    rows, for a condition whose image states travel in the text (`condition.text_rows`: HunyuanVideo 1.5's
    SigLIP rows); else text unchanged. Training batches and validation both call it."""
    rows = getattr(condition, "text_rows", None)
    return text if rows is None or len(stored) < 2 else rows(text, stored[1])
