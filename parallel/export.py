"""Export the weights and the EMA of a checkpoint, from any layout, as full tensors in safetensors files.

Launch with the layout that wrote the checkpoint (the same flags as train.py):

    deepspeed --num_gpus 4 --module parallel.export --config configs/debug.yaml \
        --deepspeed-config ds_configs/zero1_bf16.json --set parallel.tp_size=2 --set parallel.pp_size=2 \
        --out runs/debug/export            # -> model.safetensors, ema.safetensors (if the optimizer keeps one)

Tensors are fp32, named canonically (`embed.*`, `blocks.{i}.*`, `final.*`), gathered over tp, pp and dp.
`--checkpoint N` (or stepN) reads ckpt.dir's stepN, default `latest` the newest usable one; which one it read is
printed (`weights: DIR/stepN (step N)`). The checkpoint is found, or refused with the steps there are, before
any process group exists; so is an --out folder that already holds files (`--overwrite` writes over them).

`--format diffusers` writes the weights (`--ema`: the EMA) as a folder of the family's diffusers class
(CogVideoXTransformer3DModel, WanTransformer3DModel, LTX2VideoTransformer3DModel, ...) instead: config.json plus
diffusion_pytorch_model.safetensors, or shards of at most `--max-shard-size` (default 5GB) with
diffusion_pytorch_model.safetensors.index.json, in `--dtype` (fp32 default; bf16, fp16), loadable with that
class's `from_pretrained(OUT)` and by
`--set model.init_from=OUT` (parallel/weights/diffusers.py). A LoRA run (model.lora) writes its base
there, or with `--merge-lora` the base with the adapters folded in; `--format diffusers-lora` writes the
adapters as OUT/pytorch_lora_weights.safetensors (`pipe.load_lora_weights(OUT)`, or
`--set model.lora.init_from=OUT` to continue). `--format opensora` writes OUT/Open_Sora_v2.safetensors, Open-Sora
2.0's checkpoint (configs/opensora2.0.yaml; `--ema`, `--dtype` as for diffusers; parallel/weights/opensora.py).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from parallel.check import load_and_check
from parallel.experiment.cli import LATEST, Parser, add_checkpoint, add_experiment_args, refused, run, size_arg
from parallel.experiment.config import ConfigError
from parallel.distributed.topology import read_launch_env
from parallel.experiment.units import DTYPES

OPENSORA_NAME = "Open_Sora_v2.safetensors"        # --format opensora: the name Open-Sora's configs load


def checkpoint_problems(cfg, layout, step: int | None, quiet: bool = False, fmt: str = "toolkit") -> list[str]:
    """The checkpoint export reads (ckpt.dir's step{step}, or with None the newest usable one), found by its
    marker and file sizes before any process group exists: the problems, or [] when there is one. quiet: no
    report of a damaged one skipped (export() makes it)."""
    from parallel.checkpoints import checkpoint
    from parallel.train.run import checkpoint_layout

    try:
        tag = checkpoint.find_resume(Path(cfg.ckpt_dir), checkpoint_layout(layout),
                                     model=checkpoint.model_signature(cfg.model), step=step, quiet=quiet,
                                     release=_release(cfg, fmt))
    except ValueError as e:
        return [str(e)]
    return [] if tag else [
        f"no complete checkpoint in {cfg.ckpt_dir} (ckpt.dir, default <train.output_dir>/checkpoints): export reads "
        f"what train.py wrote with the same --config, --deepspeed-config and --set; train first, or point it at the "
        f"run's checkpoints: --set ckpt.dir=DIR"]


def out_problems(out: Path, overwrite: bool) -> list[str]:
    """An --out folder that already holds files is written over only with --overwrite."""
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if out.exists() and not out.is_dir():
        return [f"--out {out} is a file; give a folder"]
    if held and not overwrite:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        return [f"--out {out} already holds {shown}: add --overwrite to write over it (files of other names are "
                f"left), or give another --out"]
    return []


def export(cfg, ds, layout, env, out: Path, step: int | None = None, fmt: str = "toolkit", ema: bool = False,
           max_shard_bytes: int = 5 * 10**9, dtype: str = "fp32", merge_lora: bool = False) -> list[Path]:
    """Export ckpt.dir's step{step} (None: the newest usable checkpoint) to `out`; the paths written (rank 0)."""
    from parallel.checkpoints import checkpoint, lora_base
    from parallel.distributed.seed import seed_all
    from parallel.train.engine import build_trainer
    from parallel.train.run import checkpoint_layout, layout_groups

    found = checkpoint_problems(cfg, layout, step, fmt=fmt)
    if found:             # before any process group: the refusal is all the command prints
        raise ConfigError("\n".join(found))
    with layout_groups(cfg, layout, env) as ctx:
        # every file's CRC-32, read by the ranks together, before any weight is loaded: a damaged newest checkpoint
        # is named and the previous one read; a damaged --checkpoint N is refused
        release = _release(cfg, fmt)
        try:
            tag = checkpoint.verified_resume(Path(cfg.ckpt_dir), checkpoint_layout(layout),
                                             checkpoint.model_signature(cfg.model), step=step, release=release)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        seed_all(cfg.train.seed)
        base = lora_base.source(Path(cfg.ckpt_dir) / tag, cfg.model.init_from) if release is not False else None
        trainer = build_trainer(cfg, ds, ctx, init_from=False, base=base)
        return _export_checkpoint(cfg, layout, ctx, trainer, out, tag, fmt, ema, max_shard_bytes, dtype, merge_lora)


def _release(cfg, fmt: str):
    """find_resume's `release` for an export: model.init_from (the train command's), or False for the adapters
    alone (--format diffusers-lora), which a checkpoint without its LoRA base exports without reading the base."""
    return False if fmt == "diffusers-lora" else cfg.model.init_from


def _export_checkpoint(cfg, layout, ctx, trainer, out: Path, tag: str, fmt, ema, max_shard_bytes, dtype,
                       merge_lora) -> list[Path]:
    import deepspeed
    import torch.distributed as dist
    from safetensors.torch import save_file

    from parallel.weights.ema import full_ema, has_ema
    from parallel.weights.gather import exporting, full_tensors

    step = trainer.load(cfg.ckpt_dir, tag)
    if dist.get_rank() == 0:
        print(f"weights: {cfg.ckpt_dir}/{tag} (step {step}){', EMA' if ema else ''}", flush=True)
    module, n = trainer.engine.module, cfg.model.num_layers
    if ema and not has_ema(trainer.optimizer):
        raise ValueError(f"--ema: the checkpoint {cfg.ckpt_dir}/{tag} has no EMA (its optimizer is "
                         f"{type(trainer.optimizer).__name__}; FusedEmaAdam/EmaAdamW keep one)")
    value = full_ema(trainer.optimizer, trainer.engine.optimizer) if ema else None
    if fmt == "opensora":
        from parallel.weights.opensora import export_opensora
        return export_opensora(module, ctx, cfg, out / OPENSORA_NAME, value, zero3=layout.zero_stage == 3,
                               dtype=DTYPES[dtype], metadata={"step": str(step), "weights": "ema" if ema else "model"})
    if fmt in ("diffusers", "diffusers-lora"):
        from parallel.weights.diffusers_export import export_diffusers
        from parallel.weights.lora_export import export_lora
        metadata = {"step": str(step), "checkpoint": f"{cfg.ckpt_dir}/{tag}", "weights": "ema" if ema else "model"}
        if fmt == "diffusers-lora":
            return export_lora(module, ctx, cfg, out, value, zero3=layout.zero_stage == 3, metadata=metadata)
        return export_diffusers(module, ctx, cfg, out, value, zero3=layout.zero_stage == 3,
                                max_shard_bytes=max_shard_bytes, dtype=DTYPES[dtype], metadata=metadata,
                                merge_lora=merge_lora)
    show = dist.get_rank() == 0
    if layout.zero_stage == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            weights = dict(exporting(full_tensors(module, ctx, n), module, show))
    else:
        weights = dict(exporting(full_tensors(module, ctx, n), module, show))
    files = {"model": weights}
    if has_ema(trainer.optimizer):
        ema_of = full_ema(trainer.optimizer, trainer.engine.optimizer)
        files["ema"] = dict(exporting(full_tensors(module, ctx, n, ema_of), module, show))
    written = []
    for name, local in files.items():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local if ctx.stage_writer else {})   # one replica's stages suffice
        if dist.get_rank() == 0:
            merged = {k: v for part in parts for k, v in part.items()}
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"{name}.safetensors"
            save_file(merged, str(path), metadata={"step": str(step), "checkpoint": f"{cfg.ckpt_dir}/{tag}"})
            written.append(path)
    dist.barrier()
    return written

def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="python -m parallel.export", description=__doc__.splitlines()[0])
    add_experiment_args(ap)
    add_checkpoint(ap, help="the checkpoint to export: latest (default; also auto) the newest usable one in "
                   "ckpt.dir; N or stepN: ckpt.dir's stepN. Old spelling: --tag")
    ap.add_argument("--out", required=True, help="folder for model.safetensors and ema.safetensors, or the "
                    "diffusers folder")
    ap.add_argument("--overwrite", action="store_true", help="write over the files of an --out folder that already "
                    "holds some (refused without it)")
    ap.add_argument("--format", choices=["toolkit", "diffusers", "diffusers-lora", "opensora"], default="toolkit",
                    help="toolkit: canonical names, weights and EMA; diffusers: a folder of the family's diffusers "
                    "class (CogVideoXTransformer3DModel, WanTransformer3DModel, LTX2VideoTransformer3DModel, ...); "
                    "diffusers-lora: the adapters of a model.lora run as pytorch_lora_weights.safetensors; opensora: "
                    f"OUT/{OPENSORA_NAME}, Open-Sora 2.0's checkpoint (HunyuanVideo family with its switches)")
    ap.add_argument("--merge-lora", action="store_true",
                    help="--format diffusers with model.lora: fold the adapters into the weights (W + alpha/r B A)")
    ap.add_argument("--ema", action="store_true", help="--format diffusers / opensora: export the EMA instead of "
                    "the weights")
    ap.add_argument("--max-shard-size", type=size_arg, default="5GB",
                    help="--format diffusers: largest shard file (5GB, 500MiB, bytes)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="--format diffusers / opensora: "
                    "tensor dtype")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    env = read_launch_env()
    prog = parser().prog
    try:
        cfg, ds, layout = load_and_check(args.config, args.overrides, args.deepspeed_config, env.world_size,
                                         purpose="export")
    except ConfigError as e:
        return refused(prog, str(e))
    problems = []
    if args.merge_lora and (args.format != "diffusers" or cfg.model.lora is None):
        problems.append("--merge-lora needs --format diffusers and a LoRA run (model.lora); --format diffusers-lora "
                        "writes the adapters alone")
    if args.format == "diffusers-lora" and cfg.model.lora is None:
        problems.append("--format diffusers-lora needs a LoRA run (model.lora: set model.lora.rank as the run did)")
    if cfg.model.lora is not None and cfg.model.lora.base_dtype and args.format != "diffusers-lora":
        problems.append(f"--format {args.format}{' --merge-lora' if args.merge_lora else ''} writes the base, which "
                        f"model.lora.base_dtype={cfg.model.lora.base_dtype} keeps in fp8 (a dequantised export is not "
                        "built); --format diffusers-lora writes the adapters, to load onto the released base")
    if args.format == "opensora":
        from parallel.weights.opensora import export_problems
        problems += export_problems(cfg.model)
    if args.ema and args.format == "toolkit":
        problems.append("--ema selects the weights of --format diffusers; the toolkit format writes ema.safetensors "
                        "next to model.safetensors anyway")
    step = None if args.checkpoint == LATEST else args.checkpoint
    problems += out_problems(Path(args.out), args.overwrite)
    problems += checkpoint_problems(cfg, layout, step, quiet=True, fmt=args.format)
    if problems:
        return refused(prog, problems)
    try:
        written = export(cfg, ds, layout, env, Path(args.out), step, args.format, args.ema,
                         args.max_shard_size, args.dtype, args.merge_lora)
    except ConfigError as e:
        return refused(prog, str(e))
    for path in written:
        print(f"wrote {path}")
    return 0


def cli(argv=None) -> None:
    """The console script (and `python -m`): parallel.experiment.cli.run."""
    run(lambda: main(argv))


if __name__ == "__main__":
    cli()
