"""Training data: a synthetic moving-shapes latent set, a directory of prepared latents, and the batches.

Which samples a step uses, their noise and their timesteps depend only on (seed, step, position in the
global batch), never on the layout: position j of global step s is sample position s*G + j (G = global
batch), and data-parallel rank d takes positions [(a*dp + d)*mb, (a*dp + d + 1)*mb) at micro-step a.
So every (tp, pp, dp) layout sees the same global batch, and resuming at step s needs nothing but s.
A directory dataset of several shapes (buckets) draws each step's bucket from (seed, step) and walks each
bucket on its own (parallel/train/buckets.py); noise, timesteps and dropout still key on s*G + j. A sample's
timesteps are its family's draw (FamilySpec.timesteps: one per sample, or one per token) from its noise generator.
Caption dropout (data.caption_dropout = p) is decided the same way: position j of step s trains on the
dataset's unconditional text embedding (T5 of the empty prompt) when rand(seed, step, s*G + j) < p; with a second
stream (LTX-2's audio) that one draw gives both streams their captions of the empty prompt (one caption makes both
states, as the pipeline's negative prompt does).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from models.diffusion import PER_SAMPLE, Objective
from models.spec import image_rows
from parallel.experiment.config import UNCOND_FILE
from parallel.experiment.manifest import STREAM_KEYS, read_manifest
from parallel.experiment.shapes import bucket_data, format_shape
from parallel.train.buckets import BucketSchedule
from parallel.distributed.seed import derive_seed


def _generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(*key))


class SyntheticLatents:
    """Squares moving across latent frames, one channel per class; the caption embedding names the class.

    Sample i: class k = i mod (channels x 4 directions), a square of side h/4 starting at a position drawn
    from (seed, i) and moving one latent pixel a frame in one of four directions; its text embedding is a
    fixed random table for class k. Values are in [-1, 1]. A family with a second stream (LTX-2's audio) gets,
    after the caption, that stream's latents (random, from (seed, i)) and caption (a table for class k).
    """

    def __init__(self, num_samples: int, channels: int, shape: tuple[int, int, int], text_len: int,
                 text_dim: int, seed: int, stream_shapes: tuple = ()):
        self.num_samples, self.channels, self.shape = num_samples, channels, shape
        self.text_len, self.text_dim, self.seed = text_len, text_dim, seed
        # a second stream's (FamilySpec.second_stream: LTX-2's audio latents, then its caption), after the caption
        self.stream_shapes = tuple(stream_shapes)
        self.num_classes = channels * 4

    def __len__(self) -> int:
        return self.num_samples

    def label(self, i: int) -> str:
        k = i % self.num_classes
        return f"class {k}: a square in channel {k // 4} moving {('right', 'down', 'left', 'up')[k % 4]}"

    def text(self, k: int) -> torch.Tensor:
        return torch.randn(self.text_len, self.text_dim, generator=_generator(self.seed, "caption", k))

    def unconditional(self) -> torch.Tensor:
        """The empty prompt's embedding [S_txt, D]: a table of its own, from the seed."""
        return torch.randn(self.text_len, self.text_dim, generator=_generator(self.seed, "unconditional"))

    def stream_unconditional(self) -> torch.Tensor:
        """The empty prompt's second-stream caption (LTX-2's audio caption): a table of its own, from the seed."""
        return torch.randn(self.stream_shapes[1], generator=_generator(self.seed, "stream unconditional"))

    def latent_shape(self, i: int) -> tuple[int, int, int]:
        return tuple(self.shape)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        t, h, w = self.shape
        k = i % self.num_classes
        channel, (dy, dx) = k // 4, ((0, 1), (1, 0), (0, -1), (-1, 0))[k % 4]
        side = max(1, h // 4)
        g = _generator(self.seed, "sample", i)
        y0, x0 = (int(torch.randint(0, n, (1,), generator=g)) for n in (h, w))
        video = torch.full((self.channels, t, h, w), -0.5)
        for f in range(t):
            y, x = (y0 + dy * f) % h, (x0 + dx * f) % w
            rows, cols = [(y + r) % h for r in range(side)], [(x + c) % w for c in range(side)]
            video[channel, f][torch.tensor(rows)[:, None], torch.tensor(cols)[None]] = 1.0
        if not self.stream_shapes:
            return video, self.text(k)
        (latent, caption), g = self.stream_shapes, _generator(self.seed, "stream", i)
        return (video, self.text(k), torch.randn(latent, generator=g).clamp(-1, 1),
                torch.randn(caption, generator=_generator(self.seed, "stream caption", k)))


class IndexRange:
    """Samples [start, start + n) of `base`: the synthetic validation set continues the training set's
    sample sequence (same captions, positions the training set never reaches)."""

    def __init__(self, base, start: int, n: int):
        self.base, self.start, self.n = base, start, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.base[self.start + i]

    def label(self, i: int) -> str:
        return self.base.label(self.start + i)

    def latent_shape(self, i: int) -> tuple[int, int, int]:
        return self.base.latent_shape(self.start + i)

    def unconditional(self) -> torch.Tensor:
        return self.base.unconditional()


def _load_tensor(path: Path, key: str) -> torch.Tensor:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        tensors = load_file(str(path))
        if key in STORED_CONDITION:       # optional: None when the file has no image latents
            return tensors.get(key)
        return tensors[key] if key in tensors else next(iter(tensors.values()))
    return torch.load(path, map_location="cpu", weights_only=True)


def stored_shape(path: Path, key: str) -> list[int]:
    """The shape of the tensor `_load_tensor(path, key)` returns, without reading its data: a safetensors
    header, or a `.pt` file memory-mapped (tensor storage is touched lazily); ValueError if it holds no tensor."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        with safe_open(str(path), "pt") as f:
            names = list(f.keys())
            if not names:
                raise ValueError("holds no tensor")
            return list(f.get_slice(key if key in names else names[0]).get_shape())
    try:
        value = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:              # the legacy (pre-zipfile) format cannot be memory-mapped
        value = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"holds a {type(value).__name__}, not a tensor")
    return list(value.shape)


MAX_SHAPE_PROBLEMS = 10
# Image-to-video tensors prepare_data stores beside a latent, in the order the condition hook takes them: the
# first frame's latents, the first frame's CLIP states (an image cross-attention: Wan 2.1 I2V).
STORED_CONDITION = ("image", "image_embeds")
_LATENT_WORDS = ("VAE latent", "latent of the sample's")       # the stored image latent, in the checks' messages


def _holds(path: Path, key: str) -> bool:
    """Whether the safetensors file has a tensor named `key` (header only)."""
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        return key in f.keys()


def check_shapes(root: str | Path, model, data, key: str = "data.path", captions: bool = False) -> list[str]:
    """Every latent and text file of `root`'s manifest (and uncond.safetensors, if there) against the shapes
    the model takes: latent [model.in_channels, *latent_shape(model, data)], text [model.max_text_len,
    model.text_embed_dim]; a line with a "shape" is checked against that bucket's latent. Image-to-video models:
    a latent file's "image" tensor (prepare_data's first-frame latent) is [model.in_channels, 1, H, W] of that
    latent (Wan: [model.in_channels, T, H, W], and "image_embeds" [model.image_len, model.image_dim]: the
    condition's stored_shapes). Headers only. The first MAX_SHAPE_PROBLEMS mismatches, then a count of the rest."""
    from models.geometry import latent_shape
    from models.registry import family

    root = Path(root)
    try:
        items, _, lines, shapes = read_manifest(root, captions, key)
    except (FileNotFoundError, ValueError) as e:
        return [str(e)]

    def expect_latent(shape):
        d = bucket_data(data, shape)
        t, h, w = latent_shape(model, d)
        source = (f"data.num_frames={d.num_frames}, data.height={d.height}, data.width={d.width}" if shape is None
                  else f"its shape {format_shape(shape)}")
        return ([model.in_channels, t, h, w],
                f"model.in_channels={model.in_channels}; {source} / model.vae_scale_temporal="
                f"{model.vae_scale_temporal}, model.vae_scale_spatial={model.vae_scale_spatial} -> {t} x {h} x {w} latent")
    text = ([model.max_text_len, model.text_embed_dim],
            f"model.max_text_len={model.max_text_len}, model.text_embed_dim={model.text_embed_dim}")
    condition = family(model).training_condition(model, data)
    stored = list(condition.stored_shapes([1, 1, 1, 1])) if condition is not None else []     # the tensors' names
    files = [(f, what, f"manifest.jsonl:{n}", shape) for (latent, txt), n, shape in zip(items, lines, shapes)
             for f, what in ((latent, "latent"), (txt, "text"), *((latent, name) for name in stored))
             if isinstance(f, Path)]
    if (root / UNCOND_FILE).is_file():
        files.append((root / UNCOND_FILE, "text", "the unconditional embedding", None))
    problems = []
    for f, what, where, shape in files:
        want, why = expect_latent(shape) if what != "text" else text
        if what in stored:       # the first frame's latent(s) or CLIP states, for the sample's latent
            words = _LATENT_WORDS if what == "image" else (condition.states_name,) * 2      # image_embeds: its states
            want, why = condition.stored_shapes(want)[what], f"the first frame's {words[1]}; {why}"
        try:
            if what in stored and (f.suffix != ".safetensors" or not _holds(f, what)):
                # the latent's first frame is no stand-in: its scale is the training latents' (scaling_factor
                # x z), the image latents' is the pipeline's (z / scaling_factor for CogVideoX 1.5's VAE)
                problems.append(f"{f}: no \"{what}\" tensor ({where}): an image-to-video model trains on the "
                                f"first frame's {words[0]} stored beside the video's; prepare the "
                                f"videos with this image-to-video config (python -m parallel.prepare_data "
                                f"--config ...), which writes it")
                continue
            shape = stored_shape(f, what)
        except Exception as e:    # a damaged header: name the file, whatever the reader raised
            problems.append(f"{f}: cannot read the {what} tensor's shape ({where}): {e}")
            continue
        if shape != want:
            problems.append(f"{f}: {what} shape {shape} != expected {want} ({where}; {why})")
    # LTX-2's audio beside the video, and its caption of the empty prompt beside uncond.safetensors' "text"
    uncond = [((None, root / UNCOND_FILE), "the empty prompt's, which python -m parallel.prepare_data --t5 writes "
               "for both streams", None)] if (root / UNCOND_FILE).is_file() else []
    problems += stream_problems([*zip(items, (f"manifest.jsonl:{n}" for n in lines), shapes), *uncond], model, data)
    if len(problems) > MAX_SHAPE_PROBLEMS:
        rest = len(problems) - MAX_SHAPE_PROBLEMS
        problems = problems[:MAX_SHAPE_PROBLEMS] + [f"{key}={root}: {rest} more file{'s' if rest > 1 else ''} "
                                                    f"with the wrong shape ({len(problems)} of {len(files)})"]
    return problems


def _no_stream_tensor(path: Path, key: str) -> str:
    return (f"{path}: no \"{key}\" tensor: a model with a second stream (LTX-2's audio) trains on samples whose "
            f"latent .safetensors also holds \"audio\" [audio tokens, model.audio_in_channels] and whose text "
            f".safetensors also holds \"audio_text\" [model.max_text_len, its caption width]")


def stream_tensor(path: Path, key: str) -> torch.Tensor:
    """A second stream's tensor `key` of a sample's safetensors file (STREAM_KEYS), named when absent."""
    from safetensors import safe_open
    if path.suffix == ".safetensors":
        with safe_open(str(path), "pt") as f:
            if key in f.keys():
                return f.get_tensor(key)
    raise ValueError(_no_stream_tensor(path, key))


def stream_problems(rows, model, data) -> list[str]:
    """A second stream's tensors (STREAM_KEYS) of every row ((latent, text) files, where they are listed, the clip's
    shape or None: manifest lines, and uncond.safetensors as a text file): there, and of the shapes the family's hook
    gives for the row's clip (headers only); [] for a family of one stream."""
    from models.registry import family

    problems = []
    for (latent, text), where, shape in rows:
        stream = family(model).training_stream(model, bucket_data(data, shape))
        for (_, key), f, want in zip(STREAM_KEYS, (latent, text), stream.shapes() if stream else ()):
            if not isinstance(f, Path):
                continue
            if f.suffix != ".safetensors" or not _holds(f, key):
                problems.append(f"{_no_stream_tensor(f, key)} ({where})")
            elif stored_shape(f, key) != list(want):
                problems.append(f"{f}: {key} shape {stored_shape(f, key)} != expected {list(want)} ({where}; "
                                f"model.audio_in_channels, the clip's audio tokens, model.max_text_len)")
    return problems


class DirectoryLatents:
    """`manifest.jsonl` lines {"latent": file, "text": file}; files are safetensors or `.pt` tensors.

    Latents are [C, T, H, W] (VAE-scaled), text embeddings [S_txt, text_dim]. With a `text_encoder`
    (models.text_encoder.T5TextEncoder) a line may give {"latent": file, "caption": "..."} instead and
    the caption is encoded when the sample is read. Every listed file is checked to exist when the
    dataset is opened, so a missing one is named before training starts (and `check_shapes`, run by
    parallel.check before any process group, reads every file's shape). The unconditional embedding
    (caption dropout, guidance) is uncond.safetensors beside the manifest, or the encoder's T5("").
    """

    def __init__(self, root: str | Path, text_encoder=None, stream: bool = False):
        self.root, self.text_encoder, self.stream = Path(root), text_encoder, stream      # stream: STREAM_KEYS too
        self.items, self.captions, self.lines, self.shapes = read_manifest(self.root,
                                                                           captions=text_encoder is not None)

    def __len__(self) -> int:
        return len(self.items)

    def label(self, i: int) -> str:
        """The sample's caption when the manifest has one (parallel.prepare_data.prepare writes it), else its file."""
        return self.captions[i] or self.items[i][0].name

    def latent_shape(self, i: int) -> tuple[int, int, int]:
        """Sample i's latent (frames, height, width), from its file's header."""
        return tuple(stored_shape(self.items[i][0], "latent")[1:])

    def unconditional(self) -> torch.Tensor:
        path = self.root / UNCOND_FILE
        if path.is_file():
            return _load_tensor(path, "text").float()
        if self.text_encoder is not None:
            return self.text_encoder.encode("").float()
        raise FileNotFoundError(f"{path} does not exist: the unconditional text embedding (T5 of the empty prompt) "
                                f"that caption dropout and guidance use; python -m parallel.prepare_data --t5 writes "
                                f"it, or set data.text_encoder to encode it")

    def stream_unconditional(self) -> torch.Tensor:
        """uncond.safetensors' second-stream caption (STREAM_KEYS: LTX-2's "audio_text"), named when absent."""
        return stream_tensor(self.root / UNCOND_FILE, STREAM_KEYS[1][1]).float()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        latent, text = self.items[i]
        embedding = self.text_encoder.encode(text) if isinstance(text, str) else _load_tensor(text, "text")
        # image-to-video: prepare_data's first-frame latents (and CLIP states) beside the latent
        stored = [_load_tensor(latent, key) for key in STORED_CONDITION] if latent.suffix == ".safetensors" else []
        if self.stream:        # a second stream's latents and caption (LTX-2's audio), from the line's files
            files = {"latent": latent, "text": text}
            stored = [stream_tensor(files[where], key) for where, key in STREAM_KEYS]
        return (_load_tensor(latent, "latent").float(), embedding.float(),
                *(z.float() for z in stored if z is not None))


class DiffusionBatches:
    """Infinite iterator of this rank's micro-batches: ((x_t, t, text, *more), target), grad_accum per step; with a
    second stream (LTX-2's audio) more is its (a_t, caption, timesteps) and target the pair (video's, its); with a
    condition drawn per sample whose frames are inputs (LTX-2's model.image_dropout > 0) the target ends with the
    samples kept [B] bool, the loss's mask."""

    def __init__(self, dataset, objective: Objective, *, seed: int, micro_batch: int, grad_accum: int,
                 dp_rank: int, dp_size: int, start_step: int = 0, caption_dropout: float = 0.0, condition=None,
                 timesteps=PER_SAMPLE, model=None, stream=None):
        self.dataset, self.objective, self.seed = dataset, objective, seed
        self.stream = stream              # FamilySpec.training_stream: a second noised stream (LTX-2's audio), or None
        self.condition = condition        # FamilySpec.training_condition: image latents onto x_t, or None
        self.timesteps, self.model = timesteps, model     # FamilySpec.timesteps: per sample or per token
        self.caption_dropout = caption_dropout
        # Loaded once, at start-up: a missing file is named before the first step.
        self.uncond = dataset.unconditional() if caption_dropout > 0 else None
        # a second stream's caption of the empty prompt (LTX-2's audio caption): a dropped sample gets both
        self.stream_uncond = dataset.stream_unconditional() if caption_dropout > 0 and stream is not None else None
        self.mb, self.accum, self.dp_rank, self.dp_size = micro_batch, grad_accum, dp_rank, dp_size
        self.global_batch = micro_batch * grad_accum * dp_size
        self.step, self.micro = start_step, 0
        self.buckets = BucketSchedule(getattr(dataset, "shapes", None), len(dataset), seed, self.global_batch)
        self._latent_shapes: dict[int, tuple] = {}

    def sample_index(self, position: int) -> int:
        """Dataset index of global sample position s*G + j (step s, place j in its global batch)."""
        return self.buckets.sample(position // self.global_batch, position % self.global_batch)

    def step_latent_shape(self, step: Optional[int] = None) -> Optional[tuple[int, int, int]]:
        """Latent (frames, height, width) of `step`'s bucket (default: the next step's), the same on every
        rank; the trainer sets the model's token grid from it. None when the dataset cannot say."""
        b = self.buckets.bucket(self.step if step is None else step)
        if b not in self._latent_shapes:
            if not hasattr(self.dataset, "latent_shape"):
                return None
            self._latent_shapes[b] = self.dataset.latent_shape(self.buckets.members[b][0])
        return self._latent_shapes[b]

    def dropped(self, step: int, position: int) -> bool:
        """Whether global sample `position` of `step` trains on the unconditional embedding."""
        if self.caption_dropout <= 0:
            return False
        return float(torch.rand(1, generator=_generator(self.seed, "caption_dropout", step, position))) \
            < self.caption_dropout

    def micro_batch(self, step: int, micro: int):
        first = step * self.global_batch + (micro * self.dp_size + self.dp_rank) * self.mb
        x0s, texts, noises, ts, keep, stored, stream_noises = [], [], [], [], [], [], []
        for pos in range(first, first + self.mb):
            x0, text, *extra = self.dataset[self.sample_index(pos)]       # extra: I2V image latents (, CLIP states)
            if self.dropped(step, pos):
                text = self.uncond.to(text.dtype)
                if self.stream is not None:   # the same draw drops the second stream's caption (extra: its latents, caption)
                    extra[1] = self.stream_uncond.to(extra[1].dtype)
            stored.append(extra)
            g = _generator(self.seed, "noise", pos)
            noises.append(torch.randn(x0.shape, generator=g))
            ts.append(self.timesteps.draw(g, tuple(x0.shape), self.model))        # [1] or [1, T, H, W]
            if self.stream is not None:       # its noise after the video's noise and timestep
                stream_noises.append(self.stream.noise(g, extra))
            if self.condition is not None:    # the condition's dropout, drawn like the caption's
                keep.append(float(torch.rand(1, generator=_generator(self.seed, "condition_dropout", step, pos)))
                            >= self.condition.dropout)
            x0s.append(x0)
            texts.append(text)
        t, keep = torch.cat(ts), torch.tensor(keep, dtype=torch.bool)
        if hasattr(self.condition, "timesteps"):      # LTX-2 I2V: the kept samples' frame 0 at timestep 0
            t = self.condition.timesteps(t, keep)
        x_t, target = self.objective.noised(torch.stack(x0s), torch.stack(noises), t)
        more, texts = (), torch.stack(texts)     # more: the condition's inputs after the text (Wan 2.1 I2V: CLIP)
        if self.stream is not None:              # (a_t, its caption, its timesteps); the target (video, audio)
            more, second = self.stream.batch(self.objective, t, stored, stream_noises)
            target = (target, second)
        if self.condition is not None:
            stored = [torch.stack(z) for z in zip(*stored)] if all(stored) else []
            x_t = self.condition(x_t, torch.stack(x0s), keep, *stored)
            x_t, *inputs = x_t if isinstance(x_t, tuple) else (x_t,)
            more = (*inputs, *more)            # the condition's inputs, then a second stream's (LTX-2 I2V: none)
            texts = image_rows(self.condition, texts, stored)
            if getattr(self.condition, "loss_skip_frames", 0) and self.condition.dropout > 0:
                # the samples whose first frames are inputs, last in the target: the loss's mask (SequenceLoss)
                target = (*(target if isinstance(target, tuple) else (target,)), keep)
        return (x_t, self.objective.model_timesteps(t), texts, *more), target

    def __iter__(self):
        return self

    def __next__(self):
        batch = self.micro_batch(self.step, self.micro)
        self.micro += 1
        if self.micro == self.accum:
            self.micro, self.step = 0, self.step + 1
        return batch
