"""Typed experiment configuration: YAML file + `--set dotted.key=value` overrides -> `ExperimentConfig`.

Every section is a pydantic model with `extra="forbid"`, so a misspelt key, a wrong type or an
impossible value is refused with the file, the dotted key and what would work, before anything
expensive starts. Functions elsewhere take the section they need (`cfg.model`, `cfg.parallel`).
"""
from __future__ import annotations

import difflib
import functools
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args

import yaml
from pydantic import BaseModel, Field, PositiveInt, ValidationError, field_validator, model_validator

from models.config import Section, set_flag
from models.registry import FAMILIES, import_families

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


class ConfigError(ValueError):
    """A configuration problem a user can fix; the message names the file and the key."""


UNCOND_FILE = "uncond.safetensors"       # beside manifest.jsonl: T5 of the empty prompt, {"text": [S_txt, D]}


class DataConfig(Section):
    """Where samples come from and their pixel-space size (latents are derived via the VAE scales)."""

    kind: Literal["synthetic", "directory"] = "synthetic"
    path: Optional[str] = Field(None, description="directory with manifest.jsonl (kind=directory)")
    num_frames: int = Field(49, ge=1)
    height: int = Field(480, ge=1)
    width: int = Field(720, ge=1)
    num_samples: int = Field(64, ge=1, description="synthetic dataset size")
    text_encoder: Optional[str] = Field(None, description="local T5 encoder folder; manifest lines may then "
                                        "give a caption string instead of a text-embedding file")
    caption_dropout: float = Field(0.0, ge=0, lt=1, description="probability that a training sample's text "
                                   "embedding is the unconditional one (T5 of \"\": uncond.safetensors beside the "
                                   "manifest), drawn from (train.seed, step, sample position); CogVideoX: 0.1")
    buckets: Optional[list[tuple[PositiveInt, PositiveInt, PositiveInt]]] = Field(
        None, description="the preset's clip shapes, [frames, height, width] in pixels: what `prepare_data --buckets "
        "preset` prepares and `parallel.plan --buckets preset` sizes (training reads each sample's shape from the "
        "manifest)")

    @model_validator(mode="after")
    def _directory_needs_path(self) -> "DataConfig":
        if self.kind == "directory" and not self.path:
            raise ValueError("data.kind=directory needs data.path (a folder with manifest.jsonl)")
        if self.kind == "synthetic" and self.path:      # else the folder would be ignored, silently
            raise ValueError(f"data.path={self.path} is set but data.kind=synthetic reads no files; set "
                             f"--set data.kind=directory to train on it (or remove data.path for synthetic samples)")
        if self.buckets is not None and len(set(self.buckets)) != len(self.buckets):
            raise ValueError(f"data.buckets={[list(b) for b in self.buckets]} lists a shape twice")
        return self


class ParallelConfig(Section):
    """Parallel sizes. world = tp_size x sp_size x pp_size x dp_size; dp_size=null takes what the world size
    leaves."""

    tp_size: int = Field(1, ge=1)
    sp_size: int = Field(1, ge=1, description="sequence parallel: tokens split outside attention; inside it "
                         "Ulysses splits heads and ring attention passes key/value chunks (sp = ulysses x ring)")
    ring_size: Optional[int] = Field(None, ge=1, description="ring attention's share of sp_size (ulysses = sp_size / "
                                     "ring_size); null: all Ulysses where it divides the heads of a tp rank, ring "
                                     "for the rest (python -m parallel.check lists the pairs that work)")
    pp_size: int = Field(1, ge=1)
    dp_size: Optional[int] = Field(None, ge=1)
    pp_partition: Optional[list[int]] = Field(None, description="blocks per pipeline stage; default uniform")


class RecomputeConfig(Section):
    """Selective activation checkpointing (parallel/model/recompute.py): which part of a block is recomputed in
    backward instead of kept, in every `every`-th block (blocks 0, k, 2k, ...). An alternative to the
    DeepSpeed JSON's activation_checkpointing section, not a companion: the checker refuses both at once."""

    granularity: Literal["block", "attention", "mlp"] = Field(
        "block", description="block: the whole block keeps only its input; attention: the attention core "
        "(scores, softmax, rotary; CogVideoX's and STDiT's q/k norms); mlp: the feed-forward network")
    every: int = Field(1, ge=1, description="checkpoint one block in `every` (1 = all blocks)")


class CompressionConfig(Section):
    """Activation compression (parallel/model/recompute.py): a block's tensors saved for backward are stored at
    lower precision and cast back when backward needs them. Lossy: gradients change."""

    dtype: Literal["bf16", "fp8"] = Field("bf16", description="bf16: fp32 tensors stored as bf16; fp8: fp32 "
                                          "and bf16 tensors stored as float8 e4m3 with one fp32 scale per tensor")


class AnomalyConfig(Section):
    """The anomaly guard (parallel/train/anomaly.py): a step with a non-finite loss or gradient norm, a loss
    above spike_factor x the running median, or an unreadable sample, is skipped (no optimizer update, on
    every rank) or stops the run."""

    action: Literal["skip", "rollback", "stop"] = Field(
        "skip", description="skip: the step's update is not applied (the run continues as one that never saw its "
        "batch); rollback: also load the newest verified checkpoint before it and replay from there, skipping "
        "that batch when reached (needs ckpt.every); stop: end the run")
    spike_factor: Optional[float] = Field(None, gt=1, description="a loss above this x the median of the last "
                                          "`window` applied steps is an anomaly; null = non-finite values only")
    window: int = Field(50, ge=1, description="steps in the running median")
    min_history: int = Field(10, ge=1, description="spike checks start once the median has this many steps")
    max_skips: int = Field(5, ge=0, description="more skipped steps than this in a row stop the run")
    bad_samples: Literal["skip", "stop"] = Field("skip", description="a latent file that cannot be read: its "
                                                 "step skipped and counted, or the run stopped")


class TrainConfig(Section):
    seed: int = 1234
    max_steps: int = Field(100, ge=0)
    micro_batch_size: int = Field(1, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    lr: float = Field(1e-4, gt=0)
    min_lr: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    decay_steps: Optional[int] = Field(None, ge=1, description="cosine decay horizon; default train.max_steps")
    output_dir: str = "runs/default"
    log_every: int = Field(1, ge=1)
    check_replicas_every: int = Field(0, ge=0, description="0 = never")
    collective_timeout_s: int = Field(600, ge=1, description="a collective waiting longer (a dead or stuck rank) "
                                      "fails the run instead of hanging it")
    memory_check: bool = Field(True, description="measure the second step's memory against the plan")
    device_memory: Optional[str] = Field(None, description="the memory of one device the run's memory plan must fit "
                                         "(80GiB: less than the device has, when others share it); null: the "
                                         "device's own (host memory on CPU)")
    allow_oversubscribe: bool = Field(False, description="start a run whose memory plan does not fit "
                                      "train.device_memory (the plan's margin is an estimate); false: refused before "
                                      "DeepSpeed starts")
    compile: bool = Field(False, description="torch.compile each block (regional: one graph per block class, "
                          "parallel/distributed/compile.py); docs/performance.md gives compile time and speed-up here")
    compile_backend: Literal["inductor", "aot_eager"] = Field("inductor", description="torch.compile's backend "
                                                               "with train.compile")
    recompute: Optional[RecomputeConfig] = Field(None, description="selective activation checkpointing; "
                                                 "null = the JSON's activation_checkpointing section decides")
    activation_compression: Optional[CompressionConfig] = Field(None, description="store saved activations "
                                                                "at lower precision; null = off")
    offload_activations: bool = Field(False, description="keep what each checkpoint keeps (a block's input; "
                                      "the attention core's q, k, v; the MLP's input) in pinned host memory, copied "
                                      "on a side stream and back ahead of the backward; needs train.recompute or "
                                      "the JSON's activation_checkpointing")
    block_swap: int = Field(0, ge=0, description="keep the frozen base (tensor-parallel linear weights) of the last N "
                            "blocks of each pipeline stage in pinned host memory, copied to the device for each use, "
                            "the next block's ahead on a side stream; needs model.lora; 0 = off")
    anomaly: Optional[AnomalyConfig] = Field(None, description="skip or stop on a non-finite or spiking loss "
                                             "or gradient norm, or an unreadable sample; null = off")
    float8: Optional[Literal["tensorwise"]] = Field(
        None, description="the blocks' tensor-parallel linear layers (local in and out features multiples of 16) "
        "multiply in float8: torchao's tensorwise recipe (e4m3 inputs and weights, e5m2 gradients, one scale per "
        "tensor over the full, unsharded tensor, so every tp/sp layout quantises alike; parallel/distributed/"
        "float8.py); needs torchao (pip install torchao==0.18.0) and a device with float8 tensor cores (CUDA "
        "compute capability 8.9+: H100, H200, L40S, RTX 4090); embed and final layers stay in the run's precision; "
        "null = off")
    float8_emulate: bool = Field(False, description="with train.float8: torchao's emulate mode, the same casts with "
                                 "the matmuls dequantised to fp32 (any device, CPU included; slow): a numerical "
                                 "check, not a speed-up")

    @field_validator("device_memory")
    @classmethod
    def _a_size(cls, text: Optional[str]) -> Optional[str]:
        if text is not None:
            from parallel.experiment.units import parse_size
            parse_size(text, unit_required=True)       # its ValueError names the unit to give
        return text

    @model_validator(mode="after")
    def _min_lr_below_lr(self) -> "TrainConfig":
        if self.min_lr > self.lr:       # the cosine would climb from lr to min_lr
            raise ValueError(f"train.min_lr={self.min_lr} is above train.lr={self.lr} (the schedule decays from "
                             f"train.lr to train.min_lr); set --set train.min_lr={self.lr / 10:g} (a tenth of "
                             f"train.lr) or any value up to train.lr, or raise train.lr")
        if self.float8_emulate and self.float8 is None:
            raise ValueError("train.float8_emulate=true with train.float8=null emulates nothing; set --set "
                             "train.float8=tensorwise (or drop train.float8_emulate)")
        return self


class CkptConfig(Section):
    """Checkpoints: every `every` steps (0 = only at the end), on SIGTERM/SIGUSR1, keeping the newest `keep`."""

    every: int = Field(0, ge=0)
    dir: Optional[str] = Field(None, description="default <train.output_dir>/checkpoints")
    keep: int = Field(3, ge=1, description="the newest undamaged checkpoints kept; older ones are deleted once "
                      "a newer one is published with every file's checksum")
    layout_free: bool = Field(True, description="also write the layout-free copy (about doubles the checkpoint) "
                              "that a run at another tp/sp/pp/dp/ZeRO layout resumes from; false: only a run at "
                              "the saved layout can resume")
    lora_base: Literal["release", "copy"] = Field(
        "release", description="a LoRA run's frozen base in its checkpoints, with model.init_from: release (not "
        "written; a resume, export or sample reads it from model.init_from again, whose files' sizes and CRC-32s "
        "the checkpoint records and checks) or copy (written into every checkpoint, as without model.init_from)")


class ValConfig(Section):
    """Validation every `every` steps (and after the last): loss over the whole validation set at fixed
    timesteps, equal whatever the layout, and optionally sample videos of the first `num_prompts` prompts."""

    every: int = Field(0, ge=0, description="0 = no validation")
    path: Optional[str] = Field(None, description="directory with manifest.jsonl; default: synthetic samples")
    num_samples: int = Field(8, ge=1, description="synthetic validation set size")
    timesteps: list[int] = Field([100, 300, 500, 700, 900], min_length=1,
                                 description="every sample is evaluated at each (the loss buckets)")
    micro_batch_size: Optional[int] = Field(None, ge=1, description="default: all timesteps of a sample at once")
    use_ema: bool = Field(False, description="validate and sample with the EMA weights (FusedEmaAdam/EmaAdamW)")
    num_prompts: int = Field(0, ge=0, description="prompts to sample videos for; 0 = no videos")
    sample_steps: int = Field(20, ge=1)
    sampler: Optional[Literal["ddim", "dpm", "euler", "flow_euler", "flow_linear", "opensora", "unipc"]] = Field(
        None, description="default: the first the model's family offers for its objective (FamilySpec.sampling; "
        "the built-in families: ddim for v_prediction, euler for flow_matching); dpm: v_prediction, "
        "CogVideoXDPMScheduler's DPM-Solver++(2M) SDE step; flow_euler: flow_matching, FlowMatchEulerDiscreteScheduler "
        "with shift model.schedule.shift; flow_linear: the same step on HunyuanVideoPipeline's sigmas (linspace(1, 0, "
        "steps + 1), shifted); opensora: Open-Sora 2.0's, linspace(1, 0, steps + 1) shifted by the sample's "
        "resolution, oscillating text guidance (HunyuanVideo family); unipc: flow_matching, UniPCMultistepScheduler with flow sigmas and that shift "
        "(Wan 2.1's)")
    guidance_scale: float = Field(1.0, ge=0, description="classifier-free guidance; 1 = off. The unconditional "
                                  "input is the data's unconditional embedding (T5 of the empty prompt)")
    guidance_scale_2: Optional[float] = Field(None, ge=0, description="a model of two experts (Wan 2.2 A14B): the "
                                              "low-noise expert's guidance (WanPipeline's guidance_scale_2); "
                                              "guidance_scale is the high-noise one's; LTX-2: the audio stream's "
                                              "(LTX2Pipeline's audio_guidance_scale); null: guidance_scale for both")
    use_dynamic_cfg: bool = Field(False, description="the guidance scale of CogVideoXPipeline's use_dynamic_cfg: "
                                  "1 + g (1 - cos(pi ((N - t) / N) ** 5)) / 2 at timestep t of N steps")
    formats: list[Literal["gif", "mp4"]] = Field(["gif"], min_length=1)
    fps: int = Field(8, ge=1)
    decoder: Optional[str] = Field(None, description="the model family's VAE folder (diffusers) or "
                                   "'package.module:function' mapping a latent [C,T,H,W] to frames; default: a "
                                   "latent-to-RGB preview")

    @field_validator("timesteps")
    @classmethod
    def _timesteps_in_range(cls, timesteps: list[int]) -> list[int]:
        if any(not 0 <= t < 1000 for t in timesteps) or len(set(timesteps)) != len(timesteps):
            raise ValueError("give distinct integers in [0, 1000)")
        return timesteps


def family_union(configs: tuple) -> Any:
    """The `model:` section's type: the config class of its family (models/registry.py), picked by `model.family`."""
    return Annotated[Union[configs], Field(discriminator="family")]


FamilyConfig = family_union(tuple(spec.config for spec in FAMILIES.values()))
DEFAULT_FAMILY = "cogvideox"


class ExperimentConfig(Section):
    families: list[str] = Field([], description="modules to import before the model section is read, each "
                                "registering a model family kept outside models/ (models.registry.register); "
                                "the built-in families need none")
    model: FamilyConfig
    data: DataConfig = DataConfig()
    parallel: ParallelConfig = ParallelConfig()
    train: TrainConfig = TrainConfig()
    ckpt: CkptConfig = CkptConfig()
    val: ValConfig = ValConfig()

    @model_validator(mode="before")
    @classmethod
    def _default_family(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("model"), dict) and "family" not in data["model"]:
            data = {**data, "model": {**data["model"], "family": DEFAULT_FAMILY}}
        return data

    @property
    def ckpt_dir(self) -> str:
        return self.ckpt.dir or f"{self.train.output_dir}/checkpoints"

    def global_batch_size(self, dp_size: int) -> int:
        return self.train.micro_batch_size * self.train.grad_accum_steps * dp_size


@functools.lru_cache(maxsize=None)
def _experiment_class(configs: tuple) -> type[ExperimentConfig]:
    """ExperimentConfig whose model section also takes the families registered since import."""
    return type("ExperimentConfig", (ExperimentConfig,), {"__annotations__": {"model": family_union(configs)},
                                                           "__module__": __name__})


def experiment_class() -> type[ExperimentConfig]:
    """The experiment config class for the families registered now (ExperimentConfig itself for the built-ins)."""
    configs = tuple(spec.config for spec in FAMILIES.values())
    if configs == get_args(get_args(FamilyConfig)[0]):
        return ExperimentConfig
    return _experiment_class(configs)


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A file path, or a shipped preset by name or path (`cogvideox-2b`, `configs/cogvideox-2b.yaml`), found
    through the package wherever the command runs from."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    # a bare name, or the path as docs spell it (configs/NAME.yaml); another folder is the user's own file
    if str(path.parent) in (".", "configs"):
        for preset in (CONFIG_DIR / f"{path.name}.yaml", CONFIG_DIR / path.name):
            if preset.is_file() and preset.suffix == ".yaml":
                return preset
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(f"{name_or_path}: no such config file or preset; presets: {', '.join(names)}")


def read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{where}: malformed YAML: {problem}") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (['a', 'b'], value); the value is parsed as YAML (`4` -> int, `[1, 2]` -> list)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected dotted.key=value, e.g. --set parallel.tp_size=2")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def _apply_override(tree: dict, keys: list[str], value: Any, text: str) -> None:
    node = tree
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {text}: {'.'.join(keys[:depth + 1])} is a value, not a section")
        node = child
    node[keys[-1]] = value


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        ann = field.annotation
        for section in get_args(ann) or (ann,):          # a family union: every family's keys
            if isinstance(section, type) and issubclass(section, BaseModel):
                keys += [k for k in _known_keys(section, dotted + ".") if k not in keys]
    return keys


# Names other trainers use for a key (what "did you mean" by spelling alone gets wrong: learning_rate is
# closer to min_lr than to lr), by the key's last part.
SYNONYMS = {"learning_rate": "lr", "lr_max": "lr", "max_lr": "lr", "min_learning_rate": "min_lr", "lr_min": "min_lr",
            "batch_size": "micro_batch_size", "train_batch_size": "micro_batch_size",
            "micro_batch_size_per_gpu": "micro_batch_size", "train_micro_batch_size_per_gpu": "micro_batch_size",
            "gradient_accumulation_steps": "grad_accum_steps", "grad_accum": "grad_accum_steps",
            "steps": "max_steps", "train_steps": "max_steps", "num_steps": "max_steps", "total_steps": "max_steps",
            "warmup": "warmup_steps", "num_warmup_steps": "warmup_steps", "tp": "tp_size", "pp": "pp_size",
            "dp": "dp_size", "sp": "sp_size", "tensor_parallel_size": "tp_size", "pipeline_parallel_size": "pp_size",
            "sequence_parallel_size": "sp_size", "data_parallel_size": "dp_size", "frames": "num_frames",
            "num_layers": "num_layers", "depth": "num_layers", "heads": "num_heads", "num_attention_heads": "num_heads",
            "attention_head_dim": "head_dim", "keep_last": "keep"}


def _suggest(dotted: str, known: list[str]) -> Optional[str]:
    """The known key a misspelt or foreign one means: a synonym in the same section, else the closest spelling."""
    section, _, leaf = dotted.rpartition(".")
    alias = f"{section}.{SYNONYMS[leaf]}" if leaf in SYNONYMS else None
    if alias in known:
        return alias
    close = difflib.get_close_matches(dotted, known, n=1, cutoff=0.6)
    return close[0] if close else None


def _describe(error: dict, source: str, overridden: set[str]) -> str:
    loc, family = error["loc"], None
    if loc[:1] == ("model",) and len(loc) > 1 and loc[1] in FAMILIES:   # the family union's tag
        loc, family = loc[:1] + loc[2:], loc[1]
    dotted = ".".join(str(p) for p in loc)
    if error["type"] == "union_tag_invalid":
        return (f"{source if 'model.family' not in overridden else '--set'}: model.family="
                f"{error['ctx']['tag']!r} is not a model family; families: {', '.join(FAMILIES)} (a family kept "
                f"outside models/ is registered by a module the experiment names under families:, "
                f"docs/architecture.md)")
    origin = "--set" if dotted in overridden else source
    if error["type"] == "extra_forbidden":
        if family is not None:                        # a key of the model section: this family's keys
            known = _known_keys(FAMILIES[family].config, "model.")
            others = [name for name, spec in FAMILIES.items() if dotted[len("model."):] in spec.config.model_fields]
            if others:
                return (f"{origin}: {dotted} is a key of model.family={' or '.join(others)}, not of "
                        f"model.family={family}; remove it")
        else:
            known = _known_keys(ExperimentConfig)
        close = _suggest(dotted, known)
        value = error.get("input")
        fix = f"; set {set_flag(close, value)} instead" if close and origin == "--set" and not isinstance(value, dict) \
            else ""
        hint = f" (did you mean {close}?)" if close else ""
        return f"{origin}: unknown key {dotted}{hint}{fix}"
    if error["type"] == "missing":
        return f"{origin}: missing required key {dotted}"
    got = error.get("input")
    if error["type"] == "list_type" and isinstance(got, str) and "," in got:   # --set k=a,b is a string in YAML
        items = [parse_override(f"item={part.strip()}")[1] for part in got.split(",")]
        return (f"{origin}: {dotted}: a list is written in brackets (got {got!r}); set {set_flag(dotted, items)} "
                f"(quoted for the shell)")
    msg = error["msg"].removeprefix("Value error, ")      # a validator's own sentence, without pydantic's label
    got_text = "" if isinstance(got, dict) or got is None else f" (got {got!r})"
    where = f"{dotted}: " if dotted else ""
    return f"{origin}: {where}{msg}{got_text}"


def load_config(name_or_path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Load a YAML experiment (file or preset name) and apply `dotted.key=value` overrides."""
    path = resolve_config_path(name_or_path)
    tree = read_yaml(path)
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (model, data, parallel, train), "
                          f"got {type(tree).__name__}")
    overridden = set()
    for text in overrides:
        keys, value = parse_override(text)
        _apply_override(tree, keys, value, text)
        overridden.add(".".join(keys))
    families = tree.get("families") or []
    if not isinstance(families, list) or not all(isinstance(f, str) for f in families):
        raise ConfigError(f"{path}: families: a list of module names (families: [my_package.my_family]), "
                          f"got {families!r}")
    try:
        import_families(families, f"{path}: families")
    except ImportError as e:
        raise ConfigError(str(e)) from None
    try:
        return experiment_class().model_validate(tree)
    except ValidationError as e:
        problems = [_describe(err, str(path), overridden) for err in e.errors()]
        raise ConfigError("\n".join(problems)) from None
