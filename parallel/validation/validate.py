"""Validation whose numbers do not depend on the layout: loss over the whole validation set, and videos.

The validation loss of sample i at timestep t uses noise drawn from (seed, i) only, and sample i is
always evaluated in the same forward batches (its timesteps, `val.micro_batch_size` at a time), so
its loss is the same bits on any (tp = 1, pp, dp) layout. Data-parallel replicas take contiguous
slices of the samples (no padding: a replica may get none, and still joins the collectives); the
per-sample losses are gathered and summed in sample order on every rank, in float64.

Forward passes run stage by stage without DeepSpeed's pipeline schedule (its eval_batch averages
over micro-batches and data-parallel ranks, which loses the per-sample values): each stage runs its
own layers and sends the activations to the next with point-to-point messages; the last stage's
prediction is broadcast to the whole pipeline, so every rank can compute losses and sampler steps.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from models.diffusion import Objective
from models.registry import family
from parallel.experiment.config import ExperimentConfig
from parallel.distributed.deepspeed.pipeline import stage_layers
from parallel.distributed.deepspeed.zero3 import is_partitioned
from parallel.distributed.seed import derive_seed
from models.spec import image_rows

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]
_HEADER = 64                     # int64 slots: count, then (dtype, ndim, *shape) per tensor


def _send(tensors: tuple[torch.Tensor, ...], dst: int) -> None:
    header = [len(tensors)]
    for t in tensors:
        header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    dist.send(torch.tensor(header + [0] * (_HEADER - len(header)), device=tensors[0].device), dst)
    for t in tensors:
        dist.send(t.contiguous(), dst)


def _recv(src: int, device) -> tuple[torch.Tensor, ...]:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src)
    h, tensors, i = header.tolist(), [], 1
    for _ in range(h[0]):
        dtype, ndim = _DTYPES[h[i]], h[i + 1]
        t = torch.empty(h[i + 2:i + 2 + ndim], dtype=dtype, device=device)
        dist.recv(t, src)
        tensors.append(t)
        i += 2 + ndim
    return tuple(tensors)


class StageForward:
    """`predict(inputs)` through the whole model, forward only: the prediction on every rank of the pipeline.

    pp = 1: the module's embed, blocks and final stage in order (no activation checkpointing: nothing is
    kept for backward). pp > 1: this stage's layers of DeepSpeed's PipelineModule; stage s receives its
    input from stage s - 1 of the same (dp, tp) coordinates and sends its output to stage s + 1.
    """

    def __init__(self, engine, ctx):
        self.module, self.ctx, self.device = engine.module, ctx, engine.device
        g, c = ctx.dims, ctx.coord
        self.prev = g.rank(pp=c.pp - 1, dp=c.dp, tp=c.tp, sp=c.sp) if c.pp > 0 else None
        self.next = g.rank(pp=c.pp + 1, dp=c.dp, tp=c.tp, sp=c.sp) if c.pp < ctx.pp_size - 1 else None
        self.last = g.rank(pp=ctx.pp_size - 1, dp=c.dp, tp=c.tp, sp=c.sp)
        # ZeRO-3: every forward gathers parameters from all data-parallel ranks.
        self.lockstep = any(is_partitioned(p) for p in self.module.parameters())

    def _layers(self):
        m = self.module
        return [m.embed, *m.blocks, m.final] if hasattr(m, "blocks") else stage_layers(m)

    @torch.no_grad()
    def predict(self, inputs: tuple[torch.Tensor, ...], like):
        """The prediction, fp32, on every rank: a tensor, or a tuple for a model of several (LTX-2: video, audio).
        `like`: a tensor of the prediction's shape (the latents), or a tuple of them, one per prediction, for
        receiving the broadcast."""
        several = isinstance(like, tuple)
        grid = getattr(self.module, "step_grid", None)
        if grid is not None:                    # every stage: the sample's own shape (buckets)
            grid.set_latent((like[0] if several else like).shape[2:])
        h = tuple(x.to(self.device) for x in inputs) if self.prev is None else _recv(self.prev, self.device)
        layers = self._layers()
        for layer in layers:
            h = layer(h)
        if self.next is None:
            h = layers[-1].assemble(h)          # sequence parallel: every sp rank's tokens
        else:
            _send(h, self.next)
        if self.next is None:
            # contiguous: a patch-1 unpatchify is a permuted view, which a broadcast would send in storage order
            out = tuple(t.float().contiguous() for t in (h if several else (h,)))
        else:
            out = tuple(torch.empty(t.shape, dtype=torch.float32, device=self.device)
                        for t in (like if several else (like,)))
        if self.ctx.pp_size > 1:
            for t in out:
                dist.broadcast(t, self.last, group=self.ctx.pp_group)
        return out if several else out[0]

def validation_noise(seed: int, index: int, timesteps: list[int], shape) -> torch.Tensor:
    """Noise of validation sample `index` at each timestep: from (seed, index) only."""
    g = torch.Generator().manual_seed(derive_seed(seed, "validation", index))
    return torch.randn((len(timesteps), *shape), generator=g)


def replica_slice(n: int, dp_rank: int, dp_size: int) -> range:
    """Contiguous, as even as possible, no padding: replica d takes [d n / dp, (d + 1) n / dp)."""
    return range(dp_rank * n // dp_size, (dp_rank + 1) * n // dp_size)


def replica_items(n: int, forward: StageForward, ctx) -> Iterator[tuple[int, bool]]:
    """(item, counts) for this replica's slice of n items. ZeRO-3 gathers parameters across the replicas
    in every forward, so there all take the same number of forwards: a replica with fewer items runs
    (and discards: counts is False) extra ones of item 0."""
    share = replica_slice(n, ctx.dp_rank, ctx.dp_size)
    rounds = -(-n // ctx.dp_size) if forward.lockstep else len(share)
    for k in range(rounds):
        yield (share[k], True) if k < len(share) else (0, False)


def _replica_head(ctx) -> bool:
    """One rank per data-parallel replica reports its rows (every rank of a replica has the prediction)."""
    return ctx.tp_rank == 0 and ctx.pp_rank == 0 and ctx.sp_rank == 0


def _gather_rows(mine: dict[int, list[float]], ctx, contributes: bool) -> dict[int, list[float]]:
    """Every rank's {sample: values}, from one rank per data-parallel replica, on every rank."""
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine if contributes else {})
    else:
        everyone = [mine]
    rows: dict[int, list[float]] = {}
    for part in everyone:
        for i, values in part.items():
            if i in rows:
                raise RuntimeError(f"validation sample {i} was evaluated by two replicas")
            rows[i] = values
    return rows


def validation_loss(forward: StageForward, dataset, objective: Objective, cfg: ExperimentConfig, ctx) -> dict:
    """Mean loss over every sample x timestep, and the mean per timestep: {"val_loss", "val_loss_t<t>"}."""
    ts = cfg.val.timesteps
    chunk = cfg.val.micro_batch_size or len(ts)
    condition = family(cfg.model).training_condition(cfg.model, cfg.data)    # I2V: the sample's first frame
    skip = getattr(condition, "loss_skip_frames", 0)       # latent frames that are inputs (parallel.model.build.SequenceLoss)
    mine: dict[int, list[float]] = {}
    for i, counts in replica_items(len(dataset), forward, ctx):
        x0, text, *stored = dataset[i]                        # stored: I2V first-frame latents (, CLIP states)
        noise = validation_noise(cfg.train.seed, i, ts, x0.shape)
        losses = []
        for a in range(0, len(ts), chunk):
            t = torch.tensor(ts[a:a + chunk])
            x0s = x0.expand(len(t), *x0.shape)
            x_t, target = objective.noised(x0s, noise[a:a + chunk], t)
            more = ()            # the condition's inputs after the text (Wan 2.1 I2V: the CLIP states)
            if condition is not None:
                x_t = condition(x_t, x0s, torch.ones(len(t), dtype=torch.bool),
                                *(z.expand(len(t), *z.shape) for z in stored))
                x_t, *more = x_t if isinstance(x_t, tuple) else (x_t,)
            texts = text.expand(len(t), *text.shape)
            if condition is not None:      # image states as text rows (HunyuanVideo 1.5's SigLIP)
                texts = image_rows(condition, texts, [z.expand(len(t), *z.shape) for z in stored])
            prediction = forward.predict((x_t, objective.model_timesteps(t), texts, *more), target)
            err = (prediction.cpu() - target.float())[:, :, skip:] ** 2      # skip: clean frames (TI2V's first)
            losses += err.flatten(1).mean(1).tolist()
        if counts:
            mine[i] = losses
    rows = _gather_rows(mine, ctx, _replica_head(ctx))
    missing = sorted(set(range(len(dataset))) - set(rows))
    if missing:
        raise RuntimeError(f"validation samples {missing} were not evaluated")
    order = [rows[i] for i in range(len(dataset))]
    result = {"val_loss": sum(v for row in order for v in row) / (len(order) * len(ts))}
    for j, t in enumerate(ts):
        result[f"val_loss_t{t}"] = sum(row[j] for row in order) / len(order)
    return result


def row_predictor(forward: StageForward, text, uncond, first=None, condition=None, extra=(), stream=None):
    """predict(x, t, conditional) for models.sampling.sample on rows of a batch (validation and
    parallel.sample): text and uncond [B, L, D] (uncond None without guidance); image-to-video: first
    [B, C, 1, H, W] the first frame's latents (Wan: [B, C, T, H, W]), put on channels by
    `condition.sampling_input` for both calls, and `extra` the inputs after the text (Wan 2.1 I2V: the CLIP
    states [B, I, image_dim]), the same in both calls (as WanImageToVideoPipeline); a condition whose image states
    travel as text rows (`condition.text_rows`: HunyuanVideo 1.5's SigLIP states) puts `extra` in text and uncond.
    A family of two streams (`stream`, FamilySpec.second_stream: LTX-2's audio): x, text and uncond are (video,
    audio) pairs (the condition's sampling_input takes and gives the pair), arranged as the model takes them by
    `stream.sampling_inputs`; the prediction a pair too."""
    rows = getattr(condition, "text_rows", None)
    if rows is not None and extra:         # both calls see the picture's states, as the pipeline's image_embeds
        text, uncond, extra = rows(text, *extra), None if uncond is None else rows(uncond, *extra), ()

    def predict(x, t, conditional):
        inp = x if first is None else condition.sampling_input(x, first)
        if stream is not None:
            inputs = stream.sampling_inputs(inp, t, text if conditional else uncond)
            return tuple(p.cpu() for p in forward.predict(inputs, x))
        return forward.predict((inp, t, text if conditional else uncond, *extra), x).cpu()
    return predict


def finish_sample(condition, x: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """The sampler's latents as the pipeline returns them: a condition with a `sampled` step (Wan 2.2 TI2V: the
    picture latent put back in frame 0) applies it; the others return x."""
    sampled = getattr(condition, "sampled", None)
    return x if sampled is None else sampled(x, first)


def sample_latents(forward: StageForward, dataset, objective: Objective, cfg: ExperimentConfig, ctx) -> dict:
    """Sampled latents of the first `val.num_prompts` validation prompts, {prompt: [C, T, H, W]}, on every
    rank. Prompt i starts from noise drawn from (seed, i) alone (the dpm sampler's step noise continues that
    generator); the unconditional input of guidance is the dataset's unconditional embedding (T5 of "");
    replicas split the prompts like samples."""
    from models.sampling import check_sampler, family_guidance, sample

    sampler = check_sampler(cfg.model.objective, cfg.val.sampler, family(cfg.model).sampling.samplers)
    n = min(cfg.val.num_prompts, len(dataset))
    condition = family(cfg.model).training_condition(cfg.model, cfg.data)    # I2V: the prompt's first frame
    guidance = family_guidance(family(cfg.model), cfg.model, cfg.val.guidance_scale, cfg.val.guidance_scale_2)
    guided = cfg.val.guidance_scale != 1 or cfg.val.guidance_scale_2 not in (None, 1)
    uncond = dataset.unconditional()[None] if guided and n else None
    mine = {}
    for i, counts in replica_items(n, forward, ctx):
        x0, text, *stored = dataset[i]
        g = torch.Generator().manual_seed(derive_seed(cfg.train.seed, "sample", i))
        noise = torch.randn((1, *x0.shape), generator=g)
        # I2V: the stored first-frame latents (and CLIP states), else stand-ins from the sample (the condition's)
        first, extra = condition.sampling_parts(x0, stored) if condition is not None else (None, ())
        predict = row_predictor(forward, text[None], uncond.to(text.dtype) if uncond is not None else None,
                                first, condition, extra)
        latent = sample(predict, noise, objective, cfg.val.sample_steps, sampler, guidance,
                        use_dynamic_cfg=cfg.val.use_dynamic_cfg, generator=g)
        latent = latent if first is None else finish_sample(condition, latent, first)
        if counts:
            mine[i] = [latent[0]]
    return {i: v[0] for i, v in _gather_rows(mine, ctx, _replica_head(ctx)).items()}


def write_samples(latents: dict, dataset, cfg: ExperimentConfig, out_dir: Path, step: int) -> dict:
    """Decode and write each prompt's video under out_dir/samples/step<N>/; {prompt: frames}."""
    from models.geometry import video_latent
    from parallel.validation.media import load_decoder, write_gif, write_mp4

    decode, frames = load_decoder(cfg.val.decoder), {}
    folder = out_dir / "samples" / f"step{step}"
    folder.mkdir(parents=True, exist_ok=True)
    for i, latent in sorted(latents.items()):
        frames[i] = decode(video_latent(latent, cfg.model, cfg.data))
        for fmt in cfg.val.formats:
            (write_gif if fmt == "gif" else write_mp4)(frames[i], folder / f"prompt{i}.{fmt}", fps=cfg.val.fps)
        label = dataset.label(i) if hasattr(dataset, "label") else f"validation sample {i}"
        (folder / f"prompt{i}.txt").write_text(label + "\n")
    return frames


def publish(out_dir: Path, title: str) -> Path:
    """Loss plots from metrics.jsonl and index.html over every step's samples found under out_dir/samples."""
    from parallel.validation.media import Sample, plot_losses, write_index

    metrics = out_dir / "metrics.jsonl"
    plots = plot_losses(metrics, out_dir) if metrics.is_file() else []
    entries = []
    for folder in (out_dir / "samples").glob("step*"):
        if not folder.name[4:].isdigit():
            continue
        for label in sorted(folder.glob("prompt*.txt")):
            files = sorted(str(f.relative_to(out_dir)) for f in folder.glob(label.stem + ".*") if f.suffix != ".txt")
            entries.append(Sample(int(folder.name[4:]), int(label.stem[6:]), label.read_text().strip(), files))
    return write_index(out_dir, title, entries, plots)


@contextlib.contextmanager
def ema_weights(trainer) -> Iterator[None]:
    """The module's parameters replaced by the EMA shadow for the body, restored exactly after.

    Collective over the data-parallel group (the shadow is gathered from the ranks that own it);
    under ZeRO-3 each parameter is gathered in turn to be swapped. Keeps a host copy of this rank's
    parameters (ZeRO-3: gathered) for the restore.
    """
    from parallel.weights.ema import full_ema, has_ema
    if not has_ema(trainer.optimizer):
        raise RuntimeError("val.use_ema=true, but the optimizer keeps no EMA: use \"type\": \"FusedEmaAdam\" "
                           "(or EmaAdamW) in the DeepSpeed JSON, and validate after the first step")
    value = full_ema(trainer.optimizer, trainer.engine.optimizer)
    params = list(trainer.engine.module.parameters())
    saved = []
    for p in params:
        shadow = value(p)
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            saved.append(p.data.to("cpu", copy=True))
            p.data.copy_(shadow.to(p.dtype))
    try:
        yield
    finally:
        for p, old in zip(params, saved):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                p.data.copy_(old)


class Validator:
    """Validation for train.py: due every `val.every` steps and after the last; EMA weights if asked."""

    def __init__(self, cfg: ExperimentConfig, trainer, ctx, dataset, out_dir=None):
        self.cfg, self.trainer, self.ctx, self.dataset = cfg, trainer, ctx, dataset
        self.out_dir = out_dir                    # the logging rank's output directory, None elsewhere
        self.forward = StageForward(trainer.engine, ctx)
        self.objective = Objective.of(cfg.model)
        self.frames: dict = {}                   # the last videos written, {prompt: uint8 [T, H, W, 3]}

    def due(self, step: int) -> bool:
        every = self.cfg.val.every
        return bool(every) and (step % every == 0 or step == self.cfg.train.max_steps)

    def run(self, step: int) -> dict:
        """Validation loss (and sample videos, written by the logging rank) at `step`; collective."""
        module = self.trainer.engine.module
        module.eval()
        try:
            with ema_weights(self.trainer) if self.cfg.val.use_ema else contextlib.nullcontext():
                result = validation_loss(self.forward, self.dataset, self.objective, self.cfg, self.ctx)
                latents = sample_latents(self.forward, self.dataset, self.objective, self.cfg, self.ctx) \
                    if self.cfg.val.num_prompts else {}
        finally:
            module.train()
        if latents and self.out_dir is not None:
            try:                # the logging rank alone: a failure here must not stop (or hang) training
                self.frames = write_samples(latents, self.dataset, self.cfg, self.out_dir, step)
            except Exception as e:
                print(f"step {step}: sample videos not written: {e!r}", file=sys.stderr)
        return result

    def publish(self) -> None:
        """Refresh the loss plots and index.html (logging rank, after the step's metrics are written)."""
        if self.out_dir is not None:
            try:
                publish(self.out_dir, f"{self.cfg.model.name}: {self.out_dir.name}")
            except Exception as e:
                print(f"index.html and loss plots not updated: {e!r}", file=sys.stderr)
