"""Where `train.py`'s step goes, by phase, beside the same step's blocks (issue: train.py at the speed of its blocks).

    python -m bench.step_phases --config cogvideox-5b --deepspeed-config zero1_bf16     # one GPU, release size
    python -m bench.step_phases --config debug --deepspeed-config zero1_bf16 --steps 3  # the same on CPU

One process, the engine train.py builds (`start_engine`'s build_trainer on the preset's synthetic data), the
step train.py runs (`TrainingEngine.train_step`). Two passes of --steps steps each, after --warmup steps:

1. phases: the engine's forward, backward and step (the boundary step: gradient reduction, the bf16
   optimizer's fp32 copies, clipping and the gradient norm, AdamW, EMA) timed with the device synchronised
   at each boundary; "rest" is the step's wall time minus the three (data, the loss's host copy, logging
   inside the step). Each phase's share of the step, and the step's MFU.
2. blocks: the same steps with every transformer block's forward and backward timed (synchronised; `block_timer`
   says how: a checkpointed block's backward is DeepSpeed's CheckpointFunction.backward, recomputation included);
   the blocks' share is what a blocks-only step (bench/peer.py) would take, the rest is outside the blocks.
The warm-up steps' seconds are kept too (result.json "warmup_s"): with train.compile=true the first ones compile.
With --trace DIR one more step is profiled (torch.profiler, the device's activities) and its trace written as
DIR/step.json.gz (a few MB at release size: one step only).

Nothing is asserted; the figures go to bench/report.md by hand with the card, the date and this command.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Phases:
    """Wraps an engine's forward, backward and step to add their synchronised wall times to `seconds`."""

    def __init__(self, engine, sync):
        self.engine, self.sync, self.seconds, self.saved = engine, sync, {}, {}

    def __enter__(self):
        for name in ("forward", "backward", "step"):
            original = getattr(self.engine, name)
            self.saved[name] = original

            def timed(*args, _name=name, _original=original, **kwargs):
                self.sync()
                tic = time.perf_counter()
                out = _original(*args, **kwargs)
                self.sync()
                self.seconds[_name] = self.seconds.get(_name, 0.0) + time.perf_counter() - tic
                return out
            setattr(self.engine, name, timed)
        return self

    def __exit__(self, *exc):
        for name in self.saved:
            delattr(self.engine, name)          # back to the class's methods


@contextlib.contextmanager
def block_timer(blocks, sync, seconds: dict):
    """Every transformer block's forward and backward time, synchronised, added to seconds['blocks'].

    Forward: the block's forward pre- and post-hooks. Backward of a checkpointed segment: DeepSpeed's
    CheckpointFunction.backward, timed whole (its recomputed forward included; the block hooks inside it add
    nothing more). Backward of a block kept whole: from the gradient of its output hidden states to that of its
    input's (tensor hooks on the first tensor of the tuple it takes and returns). nn.Module's full backward hooks
    cannot do it: a block takes one tuple, so they see no tensor argument and fire before the block's backward
    runs (torch warns "Full backward hook is firing when gradients are computed with respect to module outputs
    since no inputs require gradients")."""
    import torch
    from deepspeed.runtime.activation_checkpointing.checkpointing import CheckpointFunction

    inside, started, spans, handles = [0], {}, [], []

    def add(s: float) -> None:
        seconds["blocks"] = seconds.get("blocks", 0.0) + s

    def first(value):
        """The hidden states: the first tensor of a block's tuple."""
        while isinstance(value, (tuple, list)) and value:
            value = value[0]
        return value if isinstance(value, torch.Tensor) else None

    def stamp(span: list, end: bool):
        def hook(grad):
            sync()
            span[end] = time.perf_counter()
        return hook

    def before(module, args):
        if not inside[0]:
            sync()
            started[id(module)] = time.perf_counter()

    def after(module, args, output):
        if inside[0]:
            return
        sync()
        add(time.perf_counter() - started.pop(id(module)))
        x, y = first(args), first(output)
        if torch.is_grad_enabled() and x is not None and y is not None and x.requires_grad and y.requires_grad:
            span = [None, None]
            spans.append(span)
            y.register_hook(stamp(span, False))
            x.register_hook(stamp(span, True))

    original = vars(CheckpointFunction)["backward"]

    def timed_backward(ctx, *grads):
        sync()
        tic = time.perf_counter()
        inside[0] += 1
        try:
            return original.__func__(ctx, *grads)
        finally:
            inside[0] -= 1
            sync()
            add(time.perf_counter() - tic)

    CheckpointFunction.backward = staticmethod(timed_backward)
    for block in blocks:
        handles += [block.register_forward_pre_hook(before), block.register_forward_hook(after)]
    try:
        yield
    finally:
        CheckpointFunction.backward = original
        for h in handles:
            h.remove()
        add(sum(end - begin for begin, end in spans if begin is not None and end is not None))


def transformer_blocks(module) -> list:
    """The model's repeated blocks: the longest ModuleList's children (CogVideoX's, Wan's, HunyuanVideo's)."""
    import torch
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def measure(args) -> dict:
    import deepspeed

    from bench.__main__ import step_flops
    from bench.device import device_and_dtype, peak_flops
    from parallel.check import load_and_check
    from parallel.distributed import accelerator
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, read_launch_env
    from parallel.train.engine import build_trainer
    from parallel.train.run import export_launch_env, training_batches

    cfg, ds, layout = load_and_check(args.config, [f"train.output_dir={args.out}", *args.overrides],
                                     args.deepspeed_config, 1)
    env = read_launch_env()
    export_launch_env(env)
    accelerator.set_device(env.local_rank)
    deepspeed.init_distributed(dist_backend=accelerator.backend())
    ctx = ParallelContext.build(layout.dims)
    seed_all(cfg.train.seed)
    trainer = build_trainer(cfg, ds, ctx)
    batches = training_batches(cfg, ctx)
    sync = accelerator.synchronize
    warmup = []                     # each warm-up step's seconds: a compiled model's compile is in the first
    for _ in range(args.warmup):
        tic = time.perf_counter()
        trainer.train_step(batches)
        sync()
        warmup.append(time.perf_counter() - tic)

    walls, phases = [], Phases(trainer.engine, sync)
    with phases:
        for _ in range(args.steps):
            tic = time.perf_counter()
            trainer.train_step(batches)
            sync()
            walls.append(time.perf_counter() - tic)
    blocks, hooked = {}, []
    with block_timer(transformer_blocks(trainer.engine.module), sync, blocks):
        for _ in range(args.steps):
            tic = time.perf_counter()
            trainer.train_step(batches)
            sync()
            hooked.append(time.perf_counter() - tic)
    if args.trace:
        from torch.profiler import profile
        with profile(activities=accelerator.profiler_activities()) as prof:
            trainer.train_step(batches)
            sync()
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        raw = Path(args.trace) / "step.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(f"{raw}.gz", "wb") as g:
            shutil.copyfileobj(f, g)
        raw.unlink()
    step = statistics.median(walls)
    per_step = {k: v / args.steps for k, v in phases.seconds.items()}
    per_step["rest"] = max(step - sum(per_step.values()), 0.0)
    peak = peak_flops(*device_and_dtype())
    flops = step_flops(cfg) * cfg.train.grad_accum_steps
    return {"config": args.config, "deepspeed_config": Path(args.deepspeed_config).stem, "overrides": args.overrides,
            "device": peak["name"], "step_s": step, "warmup_s": warmup, "phases_s": per_step,
            "mfu": flops / step / peak["flops"] if peak["flops"] else None,
            "blocks_s": blocks.get("blocks", 0.0) / args.steps, "hooked_step_s": statistics.median(hooked)}


def render(r: dict) -> str:
    lines = [f"{r['device']}: `python -m bench.step_phases --config {r['config']} --deepspeed-config "
             f"{r['deepspeed_config']}`" + "".join(f" --set {o}" for o in r["overrides"]), "",
             "| phase | seconds per step | share of the step |", "|---|---|---|"]
    for name, s in r["phases_s"].items():
        lines.append(f"| {name} | {s:.4f} | {s / r['step_s']:.1%} |")
    lines.append(f"| whole step | {r['step_s']:.4f} | MFU {r['mfu']:.1%} |" if r["mfu"] else
                 f"| whole step | {r['step_s']:.4f} | (no peak known) |")
    lines.append(f"| of it in the blocks (hooked pass) | {r['blocks_s']:.4f} | "
                 f"{r['blocks_s'] / r['hooked_step_s']:.1%} of that pass's {r['hooked_step_s']:.4f} s |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from parallel.experiment.cli import Parser, add_experiment_args
    ap = Parser(prog="python -m bench.step_phases", description=__doc__.splitlines()[0])
    add_experiment_args(ap)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--trace", default=None, help="folder for one profiled step's trace (step.json.gz)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "step_phases"))
    args = ap.parse_args(argv)
    result = measure(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
