"""Train a video DiT with tensor, pipeline and ZeRO data parallelism.

    deepspeed --num_gpus 4 train.py --config configs/debug.yaml \
        --deepspeed-config ds_configs/zero1_bf16.json --set parallel.tp_size=2 --set parallel.pp_size=2

config -> checks (the checkpoint to resume included) -> Trainer (parallel/train/trainer.py): topology ->
model -> deepspeed.initialize -> loop.
"""
from __future__ import annotations

import argparse
import sys

from parallel.check import check_resume, load_and_check
from parallel.experiment.cli import LATEST, NONE, REFUSED, Parser, add_checkpoint, add_experiment_args, refused, run
from parallel.experiment.config import ConfigError
from parallel.elastic import check_elastic, elastic_worlds
from parallel.distributed.topology import read_launch_env


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="train.py", description=__doc__.splitlines()[0])
    add_experiment_args(ap)
    add_checkpoint(ap, training=True, help="the checkpoint to continue from: latest (default; also auto) the newest "
                   "usable one in ckpt.dir, if there is one; N or stepN: ckpt.dir's stepN and no other; none (also "
                   "never): start from step 0 (a complete checkpoint a save would write over is moved aside). "
                   "Old spelling: --resume")
    ap.add_argument("--check-only", action="store_true",
                    help="check the configuration for WORLD_SIZE ranks (not the device), print the summary and "
                         "exit: launch.sh --dry-run runs it")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    return parser().parse_args(argv)


def run_plan(*args, **kwargs):
    """The memory planner (parallel/plan/memory.py run_plan), imported when first asked: the checks plan the
    node's host memory where the run offloads, the Trainer the run's memory."""
    from parallel.plan.memory import run_plan as plan
    return plan(*args, **kwargs)


def main(argv=None) -> int:
    args = parse_args(argv)
    env = read_launch_env()
    try:      # every rank checks before any process group, parameter or file exists
        device_check = not args.check_only
        planner = run_plan if device_check else None
        cfg, ds, layout = load_and_check(args.config, args.overrides, args.deepspeed_config, env.world_size,
                                         device_check, run_dirs=True, planner=planner)
        elastic = elastic_worlds()
        if elastic:     # launch.sh --nnodes MIN:MAX: every world a restart may land on keeps the global batch
            lines, problems = check_elastic(args.config, args.overrides, args.deepspeed_config, cfg, layout, elastic)
            if problems:
                raise ConfigError("\n".join(problems))
            if env.rank == 0 and env.world_size == max(elastic):
                print("\n".join(lines), file=sys.stderr)
        if args.checkpoint != NONE:    # on fewer or more nodes: the checkpoint's global batch, by accumulation
            from parallel.checkpoints.checkpoint import resume_accumulation
            kept = resume_accumulation(cfg.ckpt_dir, layout.global_batch, cfg.train.micro_batch_size * layout.dp_size,
                                       layout.dp_size)
            if kept is not None:
                if kept[0] != cfg.train.grad_accum_steps:
                    overrides = [*args.overrides, f"train.grad_accum_steps={kept[0]}"]
                    cfg, ds, layout = load_and_check(args.config, overrides, args.deepspeed_config, env.world_size,
                                                     device_check, run_dirs=True, planner=planner)
                if env.local_rank == 0:
                    print(f"resuming at dp {layout.dp_size}: train.grad_accum_steps={kept[0]} keeps the "
                          f"checkpoint's global batch {kept[1]}", file=sys.stderr)
            check_resume(cfg, layout, None if args.checkpoint == LATEST else args.checkpoint)   # one it cannot continue
    except ConfigError as e:
        # once per node, so every node's log says why its ranks stopped
        return refused("train.py", str(e)) if env.local_rank == 0 else REFUSED
    if args.check_only:
        from parallel.check import summary
        print(summary(cfg, layout, args.deepspeed_config))
        return 0

    from parallel.train.trainer import Trainer     # heavy imports (deepspeed, torch) only after the checks
    resume = {LATEST: True, NONE: False}.get(args.checkpoint, args.checkpoint)
    return Trainer(cfg, ds, layout, env, resume=resume, planner=run_plan).fit()


if __name__ == "__main__":
    run(main)       # a launched rank leaves without the interpreter's teardown (parallel/experiment/cli.py says why)
