"""Export the weights and the EMA of a checkpoint, from any layout, as full tensors in safetensors files.

Launch with the layout that wrote the checkpoint (the same flags as train.py):

    deepspeed --num_gpus 4 --module parallel.export --config configs/debug.yaml \
        --deepspeed_config ds_configs/zero1_bf16.json --set parallel.tp_size=2 --set parallel.pp_size=2 \
        --out runs/debug/export            # -> model.safetensors, ema.safetensors (if the optimizer keeps one)

Tensors are fp32, named canonically (`embed.*`, `blocks.{i}.*`, `final.*`), gathered over tp, pp and dp.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from parallel.check import load_and_check
from parallel.config import ConfigError
from parallel.topology import read_launch_env


def export(cfg, ds, layout, env, out: Path, tag: str | None) -> list[Path]:
    import deepspeed
    import torch.distributed as dist
    from safetensors.torch import save_file

    from parallel import checkpoint
    from parallel.ema import full_ema, has_ema
    from parallel.model import full_state
    from parallel.run import checkpoint_layout, start_engine

    ctx, trainer = start_engine(cfg, ds, layout, env)
    tag = tag or checkpoint.find_resume(Path(cfg.ckpt_dir), checkpoint_layout(layout))
    if tag is None:
        raise FileNotFoundError(f"no complete checkpoint in {cfg.ckpt_dir} (ckpt.dir)")
    step = trainer.load(cfg.ckpt_dir, tag)
    module, n = trainer.engine.module, cfg.model.num_layers
    if layout.zero_stage == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            weights = full_state(module, ctx, n)
    else:
        weights = full_state(module, ctx, n)
    files = {"model": weights}
    if has_ema(trainer.optimizer):
        files["ema"] = full_state(module, ctx, n, full_ema(trainer.optimizer, trainer.engine.optimizer))
    written = []
    for name, local in files.items():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local if ctx.dp_rank == 0 else {})   # one replica's stages suffice
        if dist.get_rank() == 0:
            merged = {k: v for part in parts for k, v in part.items()}
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"{name}.safetensors"
            save_file(merged, str(path), metadata={"step": str(step), "checkpoint": f"{cfg.ckpt_dir}/{tag}"})
            written.append(path)
    dist.barrier()
    dist.destroy_process_group()
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parallel.export", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--deepspeed_config", "--deepspeed-config", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--tag", default=None, help="checkpoint tag (step{N}); default: the newest complete one")
    ap.add_argument("--out", required=True, help="folder for model.safetensors and ema.safetensors")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    env = read_launch_env()
    try:
        cfg, ds, layout = load_and_check(args.config, args.overrides, args.deepspeed_config, env.world_size)
    except ConfigError as e:
        print("refusing to export:\n  - " + str(e).replace("\n", "\n  - "), file=sys.stderr)
        return 1
    for path in export(cfg, ds, layout, env, Path(args.out), args.tag):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
