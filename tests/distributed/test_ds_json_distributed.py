"""DeepSpeed JSON keys handed to DeepSpeed, checked in spawned gloo ranks: gradient_clipping reaches the step,
ZeRO-2 optimizer offload and ZeRO-3 optimizer + parameter offload to the CPU train like one process, and
the planner's host-memory lines are what each offload run holds there. One spawn per world size (1 and 2
ranks: the `spawned` fixture)."""
import json
import os

import pytest

from parallel.experiment.config import load_config
from tests.train_utils import Run, assert_matches, fp32_config, train_all

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _first_update(rank, world_size, clips):
    """The largest weight change of the first AdamW step under each gradient_clipping value."""
    import copy

    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches

    cfg = load_config("debug", ["train.warmup_steps=0"])
    ctx = ParallelContext.build(ParallelDims(tp_size=1, sp_size=1, pp_size=1, dp_size=1))
    out = []
    for clip in clips:
        ds = json.load(open(os.path.join(ROOT, "ds_configs/zero0_fp32.json")))
        ds["gradient_clipping"] = clip
        seed_all(cfg.train.seed)
        trainer = build_trainer(cfg, ds, ctx)
        before = copy.deepcopy(trainer.engine.module.state_dict())
        result = trainer.train_step(training_batches(cfg, ctx))
        after = trainer.engine.module.state_dict()
        out.append((result.lr, result.grad_norm, max(float((after[k] - v).abs().max()) for k, v in before.items())))
    return out


def zero2_offload() -> dict:
    ds = fp32_config(stage=2)
    ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return ds


def zero3_offload() -> dict:
    ds = fp32_config(stage=3)
    ds["zero_optimization"].update(offload_optimizer={"device": "cpu", "pin_memory": False},
                                   offload_param={"device": "cpu", "pin_memory": False},
                                   stage3_param_persistence_threshold=1000)
    return ds


@pytest.fixture(scope="module")
def spawned():
    """The one-process reference, both offload runs at dp 2 (their second step probed), the first update under
    two clippings, and the ZeRO-2 offload's optimizer."""
    return train_all({"reference": Run(1, 1, 1, fp32_config()),
                      "zero2": Run(1, 1, 2, zero2_offload(), probe_step=2),
                      "zero3": Run(1, 1, 2, zero3_offload(), probe_step=2)},
                     {"clipping": (1, _first_update, ((1e9, 1e-12),)),
                      "zero2 optimizer": (1, _offloaded, (zero2_offload(),))})


def test_gradient_clipping_reaches_the_step(spawned):
    """Adam's first step moves a weight by lr g / (|g| + eps): about lr unclipped, and about lr x clip-scaled g /
    eps when the gradient is clipped to a norm of 1e-12 (eps 1e-8): DeepSpeed clips with the JSON's value."""
    (lr, norm, free), (_, norm_clipped, clipped) = spawned["clipping"][0]
    assert norm == pytest.approx(norm_clipped) and norm > 1e-3          # the norm reported is before clipping
    assert lr * 0.5 < free <= lr * 1.0001
    assert clipped < lr * 1e-3


def _offloaded(rank, world_size, ds):
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.engine import build_trainer

    ctx = ParallelContext.build(ParallelDims(tp_size=1, sp_size=1, pp_size=1, dp_size=world_size))
    zero = build_trainer(load_config("debug"), ds, ctx).engine.optimizer
    return type(zero).__name__, zero.cpu_offload


def _host_lines(ds: dict, dp: int) -> dict[str, int]:
    """The planner's non-zero host lines for `ds` at the tests' batch layout (train_utils.experiment)."""
    from parallel.plan.memory import EngineSettings, plan_memory
    from parallel.plan.trace import ActivationTracer
    from tests.train_utils import experiment

    cfg = experiment(1, 1, dp)
    plan = plan_memory(cfg, ds, dp, 2 ** 40, ActivationTracer(cfg, EngineSettings.from_ds(ds, 1).dtype))
    return {k: v for k, v in plan.stages[0].host.items() if v}


def _held_on_host(run: dict) -> dict[str, int]:
    """Per line, the largest of the ranks' offloaded bytes at the peak of the probed step (the planner
    plans the worst rank)."""
    from parallel.distributed.deepspeed.accounting import zero_offloaded

    held = [zero_offloaded(probe.held) for probe in run["probes"]]
    print(f"host bytes held per rank {held}")
    return {k: max(h[k] for h in held) for k in held[0]}


def test_zero2_cpu_optimizer_offload_trains_like_one_process_and_holds_the_planned_host_memory(spawned):
    """ZeRO-2 at dp 2 with the optimizer states and step on the CPU (DeepSpeed's offload_optimizer, running
    the toolkit's torch AdamW): per-step losses on both ranks and the final weights equal one process's.
    The planner's host lines are within 1% of what the worst rank keeps on its offload device at the peak of
    the second step (parallel.distributed.deepspeed.accounting.zero_offloaded: master, moments, every group's fp32
    gradient, the lp partition copy, the two micro-batches' accumulated gradients and the staging buffer).
    This machine has no accelerator: "host" and "device" are one memory, so the test sums the buffers
    DeepSpeed places on its offload device."""
    assert spawned["zero2 optimizer"] == [("DeepSpeedZeroOptimizer", True)]
    run = spawned["zero2"]
    assert_matches(run, spawned["reference"])
    planned = _host_lines(zero2_offload(), 2)
    assert planned.keys() == {"parameters", "gradients", "master_weights", "adam_moments"}
    assert _held_on_host(run) == pytest.approx(planned, rel=0.01)


def test_zero3_cpu_offload_trains_like_one_process_and_holds_the_planned_host_memory(spawned):
    """ZeRO-3 at dp 2 (fp32) with offload_optimizer and offload_param on the CPU: per-step losses on both
    ranks and the final weights equal one process's. The planner's host lines (parameters, gradients,
    master weights, Adam moments) are within 1% of what each rank's DeepSpeedZeroOptimizer_Stage3 keeps on
    its offload device at the peak of the second step (its optimizer step), summed from the buffers
    DeepSpeed offloads (parallel.distributed.deepspeed.accounting.zero_offloaded). This machine has no accelerator:
    "host" and "device" are one memory, so the test sums the buffers DeepSpeed places on its offload device.
    Persistence threshold 1000: the debug model's matrices are partitioned, its vectors stay whole on every
    rank (device memory, not offloaded)."""
    run = spawned["zero3"]
    assert_matches(run, spawned["reference"])
    planned = _host_lines(zero3_offload(), 2)
    assert planned.keys() == {"parameters", "gradients", "master_weights", "adam_moments"}
    assert _held_on_host(run) == pytest.approx(planned, rel=0.01)
