"""train.float8 (torchao tensorwise) against bf16: step time, device peak memory and the loss curve.

    python -m bench.fp8 [--steps 200] [--out DIR]      # a device with float8 tensor cores (H100, H200, L40S, ...)
    python -m bench.fp8 --tiny                          # CPU: the debug preset, float8 emulated, a few steps
    python -m bench.fp8 --no-compile                    # the eager pair only

One process, ds_configs/zero1_bf16.json, the same initial weights (train.seed) and batches: the model trained
`steps` steps in bf16, then again with train.float8=tensorwise, then both again with train.compile=true (inductor;
aot_eager with --tiny: torchao's float8 speed-up needs the casts fused into the gemms' neighbours, which only a
compiled block does; --no-compile leaves the compiled pair out). The model (not --tiny): configs/debug.yaml widened so
the blocks' gemms are large enough for float8 to matter (hidden 1536, 12 heads x 128, 8 blocks, FFN 6144: 231,780,432
parameters; 17 frames at 256 x 256: 1,288 tokens a sample, 1,280 of them video; micro-batch 2); every block linear is a
multiple of 16. Rows: median step time (after 10 warm-up steps) and the ratio, the device's peak allocated memory
and the ratio (none on CPU), and the loss curves' difference: the mean of the last 20 steps of each, and the
largest per-step difference. --out DIR writes fp8.md (the table) and fp8.json (every step's loss and time).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WIDE = ["model.hidden_size=1536", "model.num_heads=12", "model.head_dim=128", "model.num_layers=8",
        "model.ffn_hidden_size=6144", "data.num_frames=17", "data.height=256", "data.width=256",
        "train.micro_batch_size=2", "train.grad_accum_steps=1", "train.lr=1e-4"]
TINY = ["train.micro_batch_size=2", "train.grad_accum_steps=1"]
WARMUP, TAIL = 10, 20


def runs(tiny: bool, compile: bool) -> list[tuple[str, list[str]]]:
    """(name, keys) of each run, in order: bf16, float8, and with `compile` both compiled."""
    float8 = ["train.float8=tensorwise"] + (["train.float8_emulate=true"] if tiny else [])
    pairs = [("bf16", []), ("float8", float8)]
    if compile:
        compiled = ["train.compile=true"] + (["train.compile_backend=aot_eager"] if tiny else [])
        pairs += [(f"{name} compiled", keys + compiled) for name, keys in pairs]
    return pairs


def _train(rank: int, world_size: int, steps: int, tiny: bool, compile: bool) -> dict:
    from parallel.distributed import accelerator
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.experiment.config import load_config
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches

    ds = json.loads((ROOT / "ds_configs/zero1_bf16.json").read_text())
    ctx, out = ParallelContext.build(ParallelDims()), {}
    for name, extra in runs(tiny, compile):
        cfg = load_config("debug", [*(TINY if tiny else WIDE), f"train.max_steps={steps}", *extra])
        seed_all(cfg.train.seed)
        trainer = build_trainer(cfg, ds, ctx)
        batches = training_batches(cfg, ctx)
        accelerator.release_memory()            # the previous run's engine: its cycles and cached blocks
        accelerator.reset_peak_memory()
        losses, times = [], []
        for _ in range(steps):
            accelerator.synchronize()
            start = time.perf_counter()
            losses.append(trainer.train_step(batches).loss)
            accelerator.synchronize()
            times.append(time.perf_counter() - start)
        params = sum(p.numel() for p in trainer.engine.module.parameters())
        out[name] = {"losses": losses, "times": times, "peak": accelerator.peak_allocated(), "params": params,
                     "float8_layers": len(getattr(trainer.engine.module, "float8_layers", ([], []))[0])}
        del trainer
    out["device"] = accelerator.product_name()
    return out


def measure(steps: int = 200, tiny: bool = False, compile: bool = True) -> dict:
    from bench.ranks import run_ranks
    # the ranks' own deadline past any --budget a caller sets (bench/gpu_speed.py): four runs, two cold compiles
    return {"steps": steps, "tiny": tiny, **run_ranks(_train, 1, steps, tiny, compile, timeout=3600)[0]}


def _mb(n) -> str:
    return "n/a (CPU)" if n is None else f"{n / 2**20:,.0f} MiB"


def report(r: dict) -> str:
    """The table: for each pair (eager; compiled where run) float8 against bf16 from the same weights and batches."""
    warm, tail = min(WARMUP, r["steps"] // 2), min(TAIL, r["steps"])
    f0 = r["float8"]
    mode = "debug preset, float8 emulated (--tiny)" if r["tiny"] else "debug widened (hidden 1536, 8 blocks)"
    lines = [f"## float8 against bf16 (bench/fp8.py; {r['device']}, {mode}, {r['bf16']['params']:,} parameters, "
             f"{f0['float8_layers']} float8 layers, {r['steps']} steps, ZeRO-1, one process)", "",
             "| what | float8 | bf16 | ratio |", "|---|---|---|---|"]
    for suffix in ("", " compiled"):
        if "bf16" + suffix not in r:
            continue
        b, f = r["bf16" + suffix], r["float8" + suffix]
        tb, tf = statistics.median(b["times"][warm:]), statistics.median(f["times"][warm:])
        lb, lf = statistics.mean(b["losses"][-tail:]), statistics.mean(f["losses"][-tail:])
        worst = max(abs(x - y) for x, y in zip(b["losses"], f["losses"]))
        mem = f"{f['peak'] / b['peak']:.3f}" if b["peak"] and f["peak"] else "n/a"
        first = f" (first step {f['times'][0]:.1f} s / {b['times'][0]:.1f} s: compiling)" if suffix else ""
        lines += [f"| step time{suffix} (median after {warm} steps){first} | {tf * 1e3:.1f} ms | {tb * 1e3:.1f} ms "
                  f"| {tf / tb:.3f} |",
                  f"| device peak allocated{suffix} | {_mb(f['peak'])} | {_mb(b['peak'])} | {mem} |",
                  f"| loss{suffix}, mean of the last {tail} steps | {lf:.5f} | {lb:.5f} | difference {lf - lb:+.2e} |",
                  f"| largest per-step loss difference{suffix} | {worst:.2e} | | |"]
    if "bf16 compiled" in r:
        tb, tc = (statistics.median(r[k]["times"][warm:]) for k in ("bf16", "float8 compiled"))
        lines.append(f"| float8 compiled against eager bf16 | {tc * 1e3:.1f} ms | {tb * 1e3:.1f} ms | {tc / tb:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fp8", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="training steps of each run (default 200; --tiny 12)")
    ap.add_argument("--tiny", action="store_true", help="the debug preset on CPU, float8 emulated")
    ap.add_argument("--no-compile", action="store_true", help="the eager pair only (no train.compile runs)")
    ap.add_argument("--out", type=Path, default=None, help="a folder for fp8.md and fp8.json")
    args = ap.parse_args(argv)
    r = measure(args.steps or (12 if args.tiny else 200), args.tiny, not args.no_compile)
    table = report(r)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8.md").write_text(table + "\n")
        (args.out / "fp8.json").write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
