"""Sampling a batch in any layout: the model with released weights or a checkpoint, and the batch's latents.

`sampling_model` builds this rank's part of the layout (without the random init that the weights read overwrite:
skip_init) and reads `model.init_from` (every rank its slices, fp32, no DeepSpeed engine: ZeRO and precision
settings do not apply) or, without it, the newest checkpoint through the trainer (the layout and engine that wrote
it, built without the init the load overwrites; the EMA swapped in as validation does with val.use_ema).
`sample_batch` runs the sampler through `StageForward` (pipeline stages exchange activations; tp and sp as in
validation) with data-parallel replicas on contiguous rows, and gathers the rows on every rank. Used by
`python -m parallel.sample`.
"""
from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Optional, Union

import torch
import torch.distributed as dist
from tqdm import tqdm

from models.diffusion import Objective
from models.sampling import sample
from parallel.model.build import build_model
from parallel.distributed import accelerator
from parallel.distributed.layers import skip_init
from parallel.distributed.seed import derive_seed, seed_all
from parallel.distributed.topology import ParallelContext
from parallel.checkpoints import checkpoint as ckpt
from parallel.checkpoints import lora_base
from parallel.train.engine import build_trainer
from parallel.train.run import checkpoint_layout, layout_groups
from parallel.validation.validate import StageForward, ema_weights, finish_sample, replica_items, replica_slice, \
    row_predictor
from parallel.weights.diffusers import load_released


@contextlib.contextmanager
def sampling_model(cfg, ds: dict, layout, env, ema: bool = False,
                   checkpoint: Optional[Union[int, str]] = None) -> Iterator[tuple[StageForward, object]]:
    """(StageForward, ctx) over this rank's part of the layout: model.init_from's weights, else the newest
    checkpoint of ckpt.dir (ema: its EMA); `checkpoint` a step (int) or "latest" (parallel.experiment.cli.LATEST): that
    checkpoint of ckpt.dir even with model.init_from set. The body runs in the layout's process groups, created
    here unless torch.distributed is already up (a test's ranks); one process with init_from needs none."""
    from_checkpoint = checkpoint is not None or not cfg.model.init_from
    groups = layout_groups(cfg, layout, env) if layout.world_size > 1 or from_checkpoint else \
        contextlib.nullcontext(ParallelContext.single())
    with groups as ctx:
        if not from_checkpoint:
            with skip_init():             # every tensor-parallel weight is read next (build_trainer says why)
                model = build_model(cfg, ds, ctx)
            load_released(model, ctx, cfg.model, cfg.model.init_from)
            device = accelerator.device(env.local_rank)
            model.to(device).eval()
            yield StageForward(types.SimpleNamespace(module=model, device=device), ctx), ctx
        else:
            # every file's CRC-32, read by the ranks together, before any weight is loaded: a damaged newest
            # checkpoint is named and the previous one sampled
            tag = ckpt.verified_resume(Path(cfg.ckpt_dir), checkpoint_layout(layout),
                                       step=checkpoint if isinstance(checkpoint, int) else None, release=None)
            seed_all(cfg.train.seed)
            # a LoRA checkpoint without its base: the release the run read (model.init_from names other weights here)
            base = lora_base.source(Path(cfg.ckpt_dir) / tag, None)
            trainer = build_trainer(cfg, ds, ctx, init_from=False, base=base)
            step = trainer.load(cfg.ckpt_dir, tag)
            if ctx.rank == 0:
                print(f"weights: {cfg.ckpt_dir}/{tag} (step {step}){', EMA' if ema else ''}", flush=True)
            trainer.engine.module.eval()
            with ema_weights(trainer) if ema else contextlib.nullcontext():
                yield StageForward(trainer.engine, ctx), ctx

def rows_of(z, r: range):
    """Rows r of a tensor [B, ...], or of each of a tuple's (a family of two streams: LTX-2's video and audio); None
    stays None."""
    if z is None:
        return None
    return tuple(e[r.start:r.stop] for e in z) if isinstance(z, tuple) else z[r.start:r.stop]


def sample_batch(forward: StageForward, ctx, objective: Objective, text, uncond, noise, shape: tuple[int, ...],
                 seed: int, steps: int, sampler: Optional[str], guidance: float, dynamic: bool,
                 first: Optional[torch.Tensor] = None, condition=None, extra: tuple = (), progress: bool = False,
                 stream=None, guidance_rescale: float = 0.0):
    """Latents [B, C, T, H, W] of the batch on every rank, from text and uncond [B, L, D] (uncond: None when
    guidance is 1); data-parallel replicas sample contiguous rows. Image-to-video: first [B, C, 1, H, W], the
    first frames' latents, and `condition` (the family's training_condition) that puts them on channels; `extra`
    the inputs after the text, each [B, ...] (Wan 2.1 I2V: the CLIP states).

    noise [B, C, T, H, W]: one generator (seed) for the whole batch, as the pipeline's; None: row i starts
    from noise drawn from (seed, i) of `shape` [C, T, H, W] and continues that generator (validation's rule).
    `progress`: rank 0 shows a bar of its denoising steps (one conditional prediction each) on stderr.

    A family of two streams (`stream`, its training_stream: LTX-2's audio): text, uncond and noise are (video,
    audio) pairs, so is the result (video latents, audio latents [B, A, Ca]); row i's audio noise is drawn after
    its video noise, and `stream.sample` steps both (the family's own sampler, which `sampler` names) with
    `guidance_rescale` (LTX-2's) and `first` (LTX-2's image-to-video: the video's frame 0 throughout).
    """
    n, mine = len(text[0] if isinstance(text, tuple) else text), {}
    share = replica_slice(n, ctx.dp_rank, ctx.dp_size)
    items = [] if noise is not None else list(replica_items(n, forward, ctx))
    runs = (1 if len(share) or forward.lockstep else 0) if noise is not None else len(items)
    bar = tqdm(total=steps * runs, desc="sampling", unit="step", file=sys.stderr, dynamic_ncols=True,
               disable=not (progress and ctx.rank == 0))

    def run(r: range, x, g, rows=None):
        predict = row_predictor(forward, rows_of(text, r), rows_of(uncond, r), rows_of(first, r), condition,
                                tuple(rows_of(e, r) for e in extra), stream)

        def counted(x_, t, cond):
            bar.update(int(cond))            # a step's conditional prediction comes once, its unconditional after
            return predict(x_, t, cond)
        if stream is not None:
            out = stream.sample(counted, x, steps, guidance, guidance_rescale, rows_of(first, r))
        else:
            out = sample(counted, x, objective, steps, sampler, guidance, use_dynamic_cfg=dynamic, generator=g,
                         rows=rows)
        return out if first is None else finish_sample(condition, out, first[r.start:r.stop])

    if noise is not None:
        if len(share) or forward.lockstep:        # ZeRO-3: an idle replica joins every forward with row 0
            r = share if len(share) else range(1)
            out = run(r, rows_of(noise, r), torch.Generator().manual_seed(seed), (r, n))
            mine = {i: rows_of(out, range(k, k + 1)) for k, i in enumerate(share)}
    else:
        for i, counts in items:
            g = torch.Generator().manual_seed(derive_seed(seed, "sample", i))
            x = torch.randn((1, *shape), generator=g)
            out = run(range(i, i + 1), x if stream is None else (x, stream.sampling_noise(g)), g)
            if counts:
                mine[i] = out
    if dist.is_initialized() and ctx.dims.world_size > 1:
        everyone = [None] * dist.get_world_size()
        head = ctx.tp_rank == 0 and ctx.pp_rank == 0 and ctx.sp_rank == 0
        dist.all_gather_object(everyone, mine if head else {})
        mine = {i: v for part in everyone for i, v in part.items()}
    bar.close()
    if stream is not None:
        return tuple(torch.cat(z) for z in zip(*(mine[i] for i in range(n))))
    return torch.cat([mine[i] for i in range(n)])
