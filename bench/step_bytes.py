"""What train.py's step does outside its transformer blocks, counted on CPU, not timed (issue #42; on a device
bench/step_phases.py times it).

    python -m bench.step_bytes --config cogvideox-5b --deepspeed-config zero1_bf16 --set model.num_layers=2 \
        --set model.hidden_size=256 --set model.num_heads=4 --set model.max_text_len=16 \
        --set data.num_frames=9 --set data.height=64 --set data.width=64          # about a minute on CPU

The 5B's structure (its non-block layers, two blocks) at a width CPU bf16 matmuls can run: the engine train.py
builds (`start_engine`, synthetic data); after --warmup steps one `train_step` and the loop's StopSignal check
are counted, per phase, under a TorchDispatchMode:

    ops        aten calls that run a kernel (views, allocations, copies of a tensor onto itself left out)
    syncs      host reads of tensor values (`.item()`, `float()`, `.cpu()`, ...), device synchronisations
    bytes      what each kernel reads and writes (arguments read, mutated ones written, fresh outputs), over
               the trainable parameter count: memory traffic, device-independent
    MFLOP      matmul and attention FLOPs (torch's flop counter): the blocks' recomputation shows

The floor is what bytes/param cannot go below: fused AdamW on fp32 master weights 28, the bf16 copy-back 6, the
gradient norm 4 (with clipping), an EMA 12, fp32 accumulation of bf16 gradients 10 per micro-batch.
"""
from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

ROOT = Path(__file__).resolve().parent.parent
WRITE_ONLY = {"copy_", "zero_", "fill_", "_foreach_zero_", "_foreach_copy_", "normal_", "uniform_", "bernoulli_"}
READ_ONLY = {("_fused_adamw_", "grads"), ("_fused_adam_", "grads")}    # marked mutable for grad_scale, unused here
FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_", "resize_", "lift_fresh"}
HOST_READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
              torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy}
PHASES = ("data (host)", "forward outside blocks", "backward outside blocks", "blocks", "gradient accumulation", "boundary step", "rest")


def nbytes(value) -> int:
    return sum(t.nbytes for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def same_data(a, b) -> bool:
    return (a.data_ptr(), a.dtype, a.shape, a.stride()) == (b.data_ptr(), b.dtype, b.shape, b.stride())


def kernel_bytes(func, args, kwargs, out) -> int:
    """Arguments read (not those of write-only ops), mutated ones written, fresh outputs written."""
    schema, total = func._schema, 0
    values = list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args):]]
    for a, v in zip(schema.arguments, values):
        written = a.alias_info is not None and a.alias_info.is_write and \
            (func.overloadpacket.__name__, a.name) not in READ_ONLY
        read = not written or (func.overloadpacket.__name__ not in WRITE_ONLY and a.name != "out")
        total += nbytes(v) * (int(read) + int(written))
    fresh = [o for r, o in zip(schema.returns, out if isinstance(out, tuple) else (out,)) if r.alias_info is None]
    return total + nbytes(fresh)


class Counts(TorchDispatchMode):
    """Kernels, bytes and FLOPs per phase: `outer` as `phases` sets it, "blocks" while a block runs."""

    def __init__(self):
        super().__init__()
        self.outer, self.depth, self.backward_blocks = "rest", 0, set()
        self.ops, self.bytes, self.syncs, self.flops = (defaultdict(int) for _ in range(4))

    @property
    def phase(self) -> str:
        return "blocks" if self.depth or self.backward_blocks else self.outer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name in FREE or (name == "copy_" and same_data(*args[:2])):
            return out
        self.ops[self.phase] += 1
        self.bytes[self.phase] += kernel_bytes(func, args, kwargs, out)
        if func.overloadpacket in flop_registry:
            self.flops[self.phase] += flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        return out


class HostReads(TorchFunctionMode):             # Tensor methods are seen here even where they dispatch nothing
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.counts.syncs[self.counts.phase] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def phases(counts: Counts, trainer, batches, blocks):
    """Set counts.outer around the engine's forward, backward, backward epilogue and step; count the blocks'
    forward (recomputation included), their backward and DeepSpeed's checkpointed segments as "blocks"."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing.checkpointing import CheckpointFunction
    engine, saved, handles = trainer.engine, [], []

    def wrap(owner, name, phase=None, depth=0):
        original = getattr(owner, name)

        def within(*args, **kwargs):
            outer, counts.outer = counts.outer, phase or counts.outer
            counts.depth += depth
            if phase is None:
                counts.syncs[counts.phase] += 1         # a device synchronisation
            try:
                return original(*args, **kwargs)
            finally:
                counts.outer, counts.depth = outer, counts.depth - depth
        saved.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, staticmethod(within) if isinstance(vars(owner).get(name), staticmethod) else within)

    wrap(type(batches), "__next__", "data (host)")      # synthetic batches made on the host
    wrap(engine, "forward", "forward outside blocks")
    wrap(engine, "backward", "backward outside blocks")
    wrap(engine, "_backward_epilogue", "gradient accumulation")
    wrap(engine, "step", "boundary step")
    wrap(get_accelerator(), "synchronize")
    wrap(CheckpointFunction, "backward", depth=1)       # recomputation and backward of checkpointed blocks

    def depth(by: int):
        return lambda *_: setattr(counts, "depth", counts.depth + by)
    for block in blocks:
        handles += [block.register_forward_pre_hook(depth(1)), block.register_forward_hook(depth(-1)),
                    block.register_full_backward_pre_hook(lambda m, *_: counts.backward_blocks.add(m)),
                    block.register_full_backward_hook(lambda m, *_: counts.backward_blocks.discard(m))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for owner, name, original in reversed(saved):       # an instance's attribute: back to its class's
            delattr(owner, name) if original is None else setattr(owner, name, original)


def measure(args) -> dict:
    from bench.step_phases import transformer_blocks
    from parallel.check import load_and_check
    from parallel.distributed import accelerator
    from parallel.distributed.topology import read_launch_env
    from parallel.train.run import start_engine, training_batches
    from parallel.train.trainer import StopSignal

    cfg, ds, layout = load_and_check(args.config, [f"train.output_dir={args.out}", *args.overrides],
                                     args.deepspeed_config, 1)
    ctx, trainer = start_engine(cfg, ds, layout, env := read_launch_env())
    batches, stop = training_batches(cfg, ctx), StopSignal(accelerator.device(env.local_rank))
    for _ in range(args.warmup):
        trainer.train_step(batches)
    counts = Counts()
    with phases(counts, trainer, batches, transformer_blocks(trainer.engine.module)), HostReads(counts), counts:
        trainer.train_step(batches)
        stop.requested()
    params = [p for p in trainer.engine.module.parameters() if p.requires_grad]      # per-tensor kernels scale
    return {"counts": counts, "params": sum(p.numel() for p in params), "tensors": len(params),    # with these
            "micro": cfg.train.grad_accum_steps, "ema": "ema" in str(ds.get("optimizer", {}).get("type", "")).lower(),
            "clip": float(ds.get("gradient_clipping", 0.0))}


def render(r: dict, command: str) -> str:
    c, n = r["counts"], r["params"]
    floor = {"gradient accumulation": 10 * r["micro"],          # AdamW + copy-back, the norm, the EMA:
             "boundary step": 28 + 6 + 4 * bool(r["clip"]) + 12 * r["ema"]}
    lines = [f"`{command}`: {n:,} trainable parameters in {r['tensors']} tensors, {r['micro']} micro-batch(es)",
             "", "| phase | ops | host syncs | bytes/param | floor | MFLOP |", "|---|---|---|---|---|---|"]
    for p in PHASES:
        lines.append(f"| {p} | {c.ops[p]} | {c.syncs[p]} | {c.bytes[p] / n:.2f} | {floor.get(p, '')} | "
                     f"{c.flops[p] / 1e6:.1f} |")
    outside = [p for p in PHASES if p not in ("blocks", "data (host)")]
    lines.append(f"| outside the blocks | {sum(c.ops[p] for p in outside)} | {sum(c.syncs[p] for p in outside)} | "
                 f"{sum(c.bytes[p] for p in outside) / n:.2f} | {sum(floor.values())} | "
                 f"{sum(c.flops[p] for p in outside) / 1e6:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from parallel.experiment.cli import Parser, add_experiment_args
    ap = Parser(prog="python -m bench.step_bytes", description=__doc__.splitlines()[0])
    add_experiment_args(ap)
    ap.add_argument("--warmup", type=int, default=2, help="steps before the counted one (Adam state exists)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "step_bytes"))
    args = ap.parse_args(argv)
    command = "python -m bench.step_bytes " + " ".join(sys.argv[1:] if argv is None else argv)
    print(render(measure(args), command))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
