"""The helpers and fixtures of tests/distributed/test_validation.py that other test modules use too: `_check_reads`,
`_sample_rank`, `_validate_rank` (a test module imports no other test module)."""
from __future__ import annotations



from tests.train_utils import fp32_config


VAL = ["val.every=1", "val.num_samples=7", "val.timesteps=[50, 400, 950]", "val.micro_batch_size=2"]


class Recording:
    """The validation set, recording which samples this rank read."""

    def __init__(self, base):
        self.base, self.read = base, []

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        self.read.append(i)
        return self.base[i]


def _validate_rank(rank, world_size, layouts, extra):
    import os
    import sys
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    from parallel.experiment.splits import ring_size
    from parallel.train.engine import build_trainer
    from parallel.train.run import build_val_dataset
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.validation.validate import StageForward, validation_loss
    from tests.train_utils import experiment

    from models.diffusion import Objective

    out = []
    for (tp, pp, dp, *sp), stage in layouts:       # (tp, pp, dp) or (tp, pp, dp, sp)
        sp = sp[0] if sp else 1
        cfg = experiment(tp, pp, dp, VAL + extra, sp)
        ctx = ParallelContext.build(ParallelDims(tp_size=tp, sp_size=sp, pp_size=pp, dp_size=dp, ring_size=ring_size(cfg)))
        seed_all(cfg.train.seed)
        trainer = build_trainer(cfg, fp32_config(stage), ctx)
        dataset = Recording(build_val_dataset(cfg))
        result = validation_loss(StageForward(trainer.engine, ctx), dataset, Objective(cfg.model.objective), cfg, ctx)
        out.append({"result": result, "read": dataset.read,
                    "replica": (ctx.dp_rank, ctx.tp_rank, ctx.pp_rank, ctx.sp_rank)})
    return out


def _check_reads(results, n, lockstep=False):
    reads = [i for r in results if r["replica"][1:] == (0, 0, 0) for i in r["read"]]
    replicas = len({r["replica"][0] for r in results})
    extra = -(-n // replicas) * replicas - n if lockstep else 0
    assert sorted(reads) == [0] * extra + list(range(n))


def _sample_rank(rank, world_size, layouts, out, extra=()):
    import os
    import sys
    from pathlib import Path
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    from parallel.experiment.splits import ring_size
    from parallel.train.engine import build_trainer
    from parallel.train.run import build_val_dataset
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.validation.validate import Validator
    from tests.train_utils import experiment

    frames = []
    for (tp, pp, dp, *sp), stage in layouts:
        sp = sp[0] if sp else 1
        cfg = experiment(tp, pp, dp, VAL + ["val.num_prompts=3", "val.sample_steps=4", "val.formats=[gif, mp4]",
                                            *extra], sp)
        ctx = ParallelContext.build(ParallelDims(tp_size=tp, sp_size=sp, pp_size=pp, dp_size=dp, ring_size=ring_size(cfg)))
        seed_all(cfg.train.seed)
        trainer = build_trainer(cfg, fp32_config(stage), ctx)
        folder = Path(out) / f"tp{tp}pp{pp}dp{dp}z{stage}" if sp == 1 else Path(out) / f"tp{tp}pp{pp}dp{dp}sp{sp}z{stage}"
        validator = Validator(cfg, trainer, ctx, build_val_dataset(cfg), folder if ctx.rank == 0 else None)
        validator.run(1)
        validator.publish()
        frames.append(validator.frames)
    return frames
