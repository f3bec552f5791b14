"""Parity of released weights: the toolkit's forward in a layout against the released library's own model.

    python -m parallel.verify --config cogvideox1.5-5b --set model.init_from=CogVideoX1.5-5B/transformer
    deepspeed --num_gpus 4 --module parallel.verify --config cogvideox1.5-5b \\
        --set model.init_from=CogVideoX1.5-5B/transformer --set parallel.tp_size=2 --set parallel.pp_size=2

Every rank loads its part of model.init_from into the layout (as sampling does) and predicts one
deterministic random batch (--seed, --batch; the shapes of data.num_frames/height/width) at fp32; rank 0
runs the class named in config.json (diffusers' CogVideoXTransformer3DModel, with the pipeline's rotary
tables) on the same batch and prints `max relative difference X` = max |ours - theirs| / max |theirs|. A model of
several predictions (LTX-2: video and audio, each its own scale) prints one per prediction, by name, and names
those apart. Exit 0 below --tolerance (1e-4), 2 above it (any prediction), 1 (refused, the reasons printed) when
the input is unusable.

`--checkpoint latest|N|stepN`: the toolkit's side reads that checkpoint of ckpt.dir (the layout and DeepSpeed
JSON that wrote it) instead of model.init_from, which then names the reference only: the diffusers folder that
`python -m parallel.export --format diffusers --checkpoint N` wrote from it (does the export predict as the
checkpoint does?).
"""
from __future__ import annotations

import argparse
from typing import Optional

from parallel.experiment.cli import LATEST, REFUSED, Parser, add_checkpoint, add_experiment_args, refused, run
from parallel.experiment.config import ConfigError
from parallel.distributed.topology import read_launch_env

NOT_EQUAL = 2       # the exit status of a comparison that ran and found the outputs apart (refused: REFUSED, 1)


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="python -m parallel.verify", description=__doc__.splitlines()[0])
    add_experiment_args(ap, deepspeed_required=False)
    add_checkpoint(ap, default=None, help="compare this checkpoint of ckpt.dir (latest, N or stepN) with the "
                   "diffusers folder model.init_from (its export) instead of model.init_from's own weights")
    ap.add_argument("--batch", type=int, default=1, help="samples in the random batch")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random batch")
    ap.add_argument("--tolerance", type=float, default=1e-4, help="largest relative difference that passes")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    return parser().parse_args(argv)


def checkpoint_problems(cfg, layout, step) -> list[str]:
    """ckpt.dir's step{step} (None: the newest usable one), found before any process group, or why not."""
    from pathlib import Path

    from parallel.checkpoints.checkpoint import find_resume, model_signature
    from parallel.train.run import checkpoint_layout
    try:
        tag = find_resume(Path(cfg.ckpt_dir), checkpoint_layout(layout), quiet=True, model=model_signature(cfg.model),
                          step=step, release=None)
    except ValueError as e:
        return [str(e)]
    return [] if tag else [f"--checkpoint latest: {cfg.ckpt_dir} (ckpt.dir) has no complete checkpoint"]


def relative_difference(ours, theirs) -> tuple[float, float]:
    """(max |ours - theirs|, that over max |theirs|)."""
    diff = float((ours.float() - theirs.float()).abs().max())
    return diff, diff / max(float(theirs.abs().max()), 1e-30)


def reference_place(local_rank: int):
    """Where rank 0 computes the released model's prediction: on its device where the device's free memory holds
    the model (fp32, loaded on the host) beside the toolkit's, with a quarter more and 4 GiB for the forward's
    activations; else on the host (minutes at release size, but no out-of-memory)."""
    import torch

    from parallel.distributed import accelerator

    def place(model):
        need = sum(p.numel() * p.element_size() for p in model.parameters()) * 5 // 4 + 4 * 2**30
        free = accelerator.free_memory(local_rank)
        if free is not None and free >= need:
            return accelerator.device(local_rank)
        if free is not None:
            print(f"the released model's prediction on the host: it needs about {need / 2**30:.1f} GiB on the "
                  f"device, {free / 2**30:.1f} GiB is free", flush=True)
        return torch.device("cpu")

    return place


def verify(args, cfg, ds, layout, env) -> list[tuple[float, float]]:
    """(max abs, max relative difference) of each prediction (the format's `predictions`: LTX-2's video and
    audio), the same on every rank."""
    import torch
    import torch.distributed as dist

    from parallel.train.sampling import sampling_model
    from parallel.weights.diffusers import released_format

    fmt = released_format(cfg.model)
    inputs = fmt.example_inputs(cfg.model, cfg.data, args.batch, torch.Generator().manual_seed(args.seed))
    several = len(fmt.predictions) > 1
    with sampling_model(cfg, ds, layout, env, checkpoint=args.checkpoint) as (forward, ctx):
        ours = forward.predict(inputs, fmt.prediction_like(cfg.model, inputs))
        result = torch.zeros(len(fmt.predictions), 2, dtype=torch.float64)
        if ctx.rank == 0:
            theirs = fmt.reference(cfg.model.init_from, inputs, reference_place(env.local_rank))
            pairs = zip(ours, theirs) if several else [(ours, theirs)]
            result[:] = torch.tensor([relative_difference(o.cpu(), t) for o, t in pairs])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(result, 0)
    return [(float(diff), float(rel)) for diff, rel in result]


def report(names: tuple[str, ...], found: list[tuple[float, float]], tolerance: float) -> tuple[bool, str]:
    """(all within tolerance, the line after the layout): each prediction's difference, named when there are
    several, and the verdict naming those apart."""
    several = len(names) > 1
    parts = [f"{name + ' ' if several else ''}max relative difference {rel:.3e} (max abs {diff:.3e})"
             for name, (diff, rel) in zip(names, found)]
    apart = [name for name, (_, rel) in zip(names, found) if not rel < tolerance]
    verdict = f"{'NOT equal' if apart else 'equal'} at --tolerance {tolerance:g}"
    return not apart, "; ".join(parts) + f"; {verdict}" + (f" ({', '.join(apart)})" if apart and several else "")

def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    env = read_launch_env()
    problems = []
    try:
        from parallel.check import load_and_check
        cfg, ds, layout = load_and_check(args.config, args.overrides, args.deepspeed_config, env.world_size,
                                         purpose="verify")
    except ConfigError as e:
        problems = str(e).splitlines()
    else:
        if not cfg.model.init_from:
            problems.append("model.init_from is not set: give --set model.init_from=<released transformer folder>"
                            + ("" if args.checkpoint is None else " (with --checkpoint: the diffusers folder "
                               "python -m parallel.export --format diffusers wrote from that checkpoint)"))
        elif cfg.model.init_from.endswith(".safetensors"):
            problems.append(f"model.init_from={cfg.model.init_from}: verify compares with the diffusers model of a "
                            f"released folder; an Open-Sora 2.0 checkpoint file has no such reference (its forward is "
                            f"held to Open-Sora's in tests/unit/test_opensora2.py)")
        if args.checkpoint is not None:
            problems += checkpoint_problems(cfg, layout, None if args.checkpoint == LATEST else args.checkpoint)
    if problems:
        return refused(parser().prog, problems) if env.rank == 0 else REFUSED
    ds = {k: v for k, v in ds.items() if k not in ("bf16", "fp16")}     # compare at fp32
    from parallel.weights.diffusers import released_format
    found = verify(args, cfg, ds, layout, env)
    passed, line = report(released_format(cfg.model).predictions, found, args.tolerance)
    if env.rank == 0:
        print(f"{cfg.model.init_from} in tp {layout.tp_size} x pp {layout.pp_size} x sp {layout.sp_size}: {line}",
              flush=True)
    return 0 if passed else NOT_EQUAL


def cli(argv=None) -> None:
    """The console script (and `python -m`): parallel.experiment.cli.run."""
    run(lambda: main(argv))


if __name__ == "__main__":
    cli()
