"""One peer row in its own process (bench/gpu_speed.py's commands): a family at a size, with compiled blocks too.

    python -m bench.peer_release --preset debug --size release --compile inductor --out DIR    # CogVideoX-5B, 4 blocks
    python -m bench.peer_release --preset debug-wan --size mid --compile aot_eager --out DIR   # CPU, seconds

bench/peer.py's pair (the toolkit's model and diffusers' class on the same weights and inputs; --size release is
peer.RELEASE's geometry) measured as peer.py measures it: prediction difference, train step and forward times in
alternating blocks, saved bytes, model FLOPs. DIR/result.json is written then, before anything is compiled, so a
compile stopped by a time budget leaves the eager row. With --compile BACKEND the toolkit's blocks get
train.compile's regional compilation (parallel/distributed/compile.py `compile_layers`: one graph per block class)
and the three are timed in alternation: compiled, toolkit eager (the same weights,
each block's forward switched back to its class's), diffusers. Compile time is the compiled model's
first forward and first train step minus their medians (dynamo compiles a no-grad graph and a training one);
result.json then gains "compiled".
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def compiled_row(pair, backend: str, blocks: int, sync) -> dict:
    """The compiled copy of the toolkit's model against its eager self and diffusers (see the module docstring)."""
    import torch

    from bench.peer import alternate
    from models.geometry import position_caches
    from parallel.distributed.compile import compile_layers, compile_stats

    model = pair.toolkit
    # sets each block's forward (an instance attribute), which builds the block's position tables first, as train.py's
    count = compile_layers(model, pair.layer_class, backend, tables=position_caches)
    layers = [m for m in model.modules() if isinstance(m, pair.layer_class)]
    forwards = [b.forward for b in layers]

    def predict(compiled: bool):
        """The toolkit's prediction with its blocks compiled or eager (the class's forward: the attribute removed)."""
        for block, forward in zip(layers, forwards):
            if compiled:
                block.forward = forward
            else:
                block.__dict__.pop("forward", None)
        return pair.run_toolkit()

    compile_stats(reset=True)
    sync()
    tic = time.perf_counter()
    with torch.no_grad():
        ours = predict(True)
    sync()
    first_forward = time.perf_counter() - tic
    with torch.no_grad():
        diff = (ours.float() - predict(False).float()).abs().max().item()
    runs = {"compiled": (lambda: predict(True), model), "toolkit": (lambda: predict(False), model),
            "diffusers": (pair.run_peer, pair.peer)}
    first = {}
    times, _ = alternate(runs, torch.randn_like(ours), blocks, 1, sync, first)
    med = {f"{what}_{k}_s": statistics.median(v) for (what, k), v in times.items()}

    def paired(what, a, b):
        return statistics.median(x / y for x, y in zip(times[what, a], times[what, b]))

    stats = compile_stats()
    return {"backend": backend, "blocks_compiled": count, "max_abs_diff_vs_eager": diff, **med,
            "compile_s": first_forward - med["forward_compiled_s"] + first["train", "compiled"]
            - med["train_compiled_s"],
            "train_compiled_over_eager": paired("train", "compiled", "toolkit"),
            "train_compiled_over_diffusers": paired("train", "compiled", "diffusers"),
            "train_eager_over_diffusers": paired("train", "toolkit", "diffusers"),
            "forward_compiled_over_eager": paired("forward", "compiled", "toolkit"),
            "graphs": stats["graphs"], "graph_breaks": stats["graph_breaks"]}


def main(argv=None) -> int:
    import torch

    from bench import device as dev
    from bench import peer
    from parallel.distributed import accelerator

    ap = argparse.ArgumentParser(prog="python -m bench.peer_release", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=list(peer.PRESETS), required=True, help="a peer.PRESETS row (its family)")
    ap.add_argument("--size", choices=[*peer.SIZES, "release"], default="release")
    ap.add_argument("--compile", default="none", choices=["none", "inductor", "aot_eager"],
                    help="also time the toolkit's blocks compiled by this backend (default none)")
    ap.add_argument("--blocks", type=int, default=3, help="timed blocks of one step each, after a warm-up block")
    ap.add_argument("--out", type=Path, required=True, help="folder for result.json")
    args = ap.parse_args(argv)
    where, dtype = dev.device_and_dtype()
    if where.type == "cpu":
        torch.set_num_threads(1)        # as peer.run: the shared machine's ratios are noise with two threads
    sync = accelerator.synchronize
    tic = time.perf_counter()
    pair = peer.build_pair(args.preset, args.size, where, dtype)
    result = {"device": str(where), "dtype": str(dtype).replace("torch.", ""), "build_s": time.perf_counter() - tic,
              "peak": dev.peak_flops(where, dtype), "row": peer.measure(pair, args.blocks, 1, sync)}
    row, flops = result["row"], result["peak"]["flops"]
    row["mfu_toolkit"] = row["step_flops"] / row["train_toolkit_s"] / flops if flops else None
    row["mfu_diffusers"] = row["step_flops"] / row["train_diffusers_s"] / flops if flops else None
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{row['family']} {row['size']}: train {row['train_toolkit_s'] * 1e3:.1f} ms toolkit / "
          f"{row['train_diffusers_s'] * 1e3:.1f} ms diffusers (ratio {row['train_ratio']:.3f})", flush=True)
    if args.compile != "none":
        result["compiled"] = c = compiled_row(pair, args.compile, args.blocks, sync)
        (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"compiled ({args.compile}): train {c['train_compiled_s'] * 1e3:.1f} ms, compiled / eager "
              f"{c['train_compiled_over_eager']:.3f}, compile {c['compile_s']:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
