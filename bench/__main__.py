"""`python -m bench`: the toolkit measured against its references, side by side in one run, as ratios.

    python -m bench [--steps 20] [--out bench]      # writes bench/report.md, bench/report.json and PNGs
    python -m bench --only peer                      # one section (or several, comma-separated); the others
                                                     # keep their figures from the existing report.json

Sections (each names what it is compared with):
  overhead      toolkit DiT vs the same network with plain nn.Linear, one DeepSpeed engine each (ZeRO-0 fp32)
  efficiency    model FLOP/s of both against this machine's measured fp32 matmul FLOP/s (a CPU "MFU")
  checkpointing saved-activation bytes and step time with activation checkpointing on vs off
  planner       the memory plan's model states and activations vs what the engines held (StepProbe)
  pipeline      train.py at pp = 2 with m = 1, 2, 4, 8 micro-batches vs the 1F1B model (m + p - 1) / m
  validation    validation time at 1 and 2 ranks (train.py, the same validation set)
  communication bytes per step of tp 2, dp 2 x ZeRO 1/2/3 and pp 2 runs vs the textbook volumes (bench/comm.py)
  compile       step time with compiled blocks (train.compile) vs eager, and the compile time (bench/compile.py)
  recompute     each train.recompute / activation_compression option: step time and saved bytes vs the
                planner, and compression's loss curve (bench/recompute.py; alone: --only recompute)
  ring          sp 4 as Ulysses 4, Ulysses 2 x ring 2 and ring 4: step time and the bytes each moves vs the
                planner's counts (bench/ring.py)
  peer          the toolkit vs diffusers' CogVideoX and Wan on the same weights, with a profile (bench/peer.py)
Nothing here is asserted: these are measurements on a shared machine, reported with their medians.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import comm, peer, recompute, ring
from bench import compile as compiled
from bench.device import matmul_flops
from bench.overhead import MID, build_engines


def step_flops(cfg) -> float:
    """Model FLOPs of one training step (forward + backward): 6 x parameters x tokens for the matrices,
    12 x layers x seq^2 x hidden for attention, per sample, times the micro-batch."""
    from parallel.model.build import layer_specs
    from parallel.distributed.pipeline import SequentialDiT
    from parallel.plan.trace import sequence_length
    from parallel.distributed.topology import ParallelContext
    from parallel.experiment.units import count_parameters

    with torch.device("meta"):
        model = SequentialDiT(layer_specs(cfg, ParallelContext.single()))
    n = count_parameters(model, matrices_only=True)
    seq, m = sequence_length(cfg), cfg.model
    return cfg.train.micro_batch_size * (6 * n * seq + 12 * m.num_layers * seq ** 2 * m.hidden_size)


def in_process(steps: int) -> dict:
    """Overhead, efficiency, checkpointing and planner accuracy: engines in this process, alternating in
    blocks of 5 steps so the machine's noise falls on all of them alike."""
    import deepspeed

    from parallel.train.data import DiffusionBatches
    from models.diffusion import Objective
    from parallel.experiment.config import load_config
    from parallel.train.probe import StepProbe
    from parallel.plan.memory import plan_memory
    from parallel.plan.trace import ActivationTracer
    from parallel.train.run import build_dataset, export_launch_env
    from parallel.distributed.topology import read_launch_env
    from parallel.experiment.units import TiB

    export_launch_env(read_launch_env())
    from parallel.distributed import accelerator
    deepspeed.init_distributed(dist_backend=accelerator.backend())
    cfg = load_config("debug", MID)
    with_ckpt = json.loads((ROOT / "ds_configs/zero0_fp32.json").read_text())
    without = {k: v for k, v in with_ckpt.items() if k != "activation_checkpointing"}
    engines = build_engines(cfg, {"toolkit": (without, False), "nn.Linear": (without, True),
                                  "toolkit, checkpointing": (with_ckpt, False)})
    data = DiffusionBatches(build_dataset(cfg), Objective(cfg.model.objective), seed=0, micro_batch=2,
                            grad_accum=1, dp_rank=0, dp_size=1)
    batches = [next(data) for _ in range(5)]
    times = {k: [] for k in engines}
    probes = {}
    for block in range(steps // 5 + 1):
        for name, engine in engines.items():
            for i in range(5):
                inputs, target = batches[i]
                probe = StepProbe(engine) if (block, i) == (0, 1) else None
                tic = time.perf_counter()
                with probe if probe else contextlib.nullcontext():
                    loss = engine(inputs, target)
                    engine.backward(loss)
                    engine.step()
                if block:                                   # the first block warms up every engine
                    times[name].append(time.perf_counter() - tic)
                if probe:
                    probes[name] = probe.result
    med = {k: statistics.median(v) for k, v in times.items()}
    peak, flops = matmul_flops(), step_flops(cfg)
    planner = {}
    for name, ds in (("toolkit", without), ("toolkit, checkpointing", with_ckpt)):
        stage = plan_memory(cfg, ds, 1, TiB, ActivationTracer(cfg, torch.float32)).stages[0]
        states = sum(stage.lines[k] for k in ("parameters", "gradients", "adam_moments", "master_weights",
                                               "ema_shadow"))
        planner[name] = {"model_states": {"predicted": states, "measured": probes[name].states},
                         "activations": {"predicted": stage.lines["activations"],
                                         "measured": max(probes[name].activations)}}
    return {
        "model": {"overrides": MID, "step_flops": flops},
        "median_step_s": med, "steps_each": len(times["toolkit"]),
        "overhead": med["toolkit"] / med["nn.Linear"],
        "matmul_flops": peak,
        "mfu": {k: flops / med[k] / peak for k in ("toolkit", "nn.Linear")},
        "checkpointing": {"activation_bytes_ratio": probes["toolkit, checkpointing"].activations[0]
                          / probes["toolkit"].activations[0],
                          "step_time_ratio": med["toolkit, checkpointing"] / med["toolkit"]},
        "planner": planner,
    }


def train_py(ranks: int, out: str, steps: int, *overrides: str) -> list[dict]:
    """train.py under `deepspeed --num_gpus ranks` (fp32 ZeRO-0, the mid model); its metrics records."""
    deepspeed = str(Path(sys.executable).parent / "deepspeed")
    cmd = [deepspeed, "--num_gpus", str(ranks), str(ROOT / "train.py"), "--config", "debug",
           "--deepspeed_config", str(ROOT / "ds_configs/zero0_fp32.json"), *sum((["--set", s] for s in MID), []),
           "--set", "train.memory_check=false", "--set", f"train.max_steps={steps}",
           "--set", f"train.output_dir={out}", *sum((["--set", s] for s in overrides), [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=env)
    return [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()]


def pipeline(steps: int) -> list[dict]:
    """pp = 2 (2 ranks) at m micro-batches of 1: time per micro-batch against the 1F1B model, both
    relative to m = 8; the model says a step of m micro-batches takes (m + p - 1) stage-times."""
    rows = []
    for m in (1, 2, 4, 8):
        with tempfile.TemporaryDirectory() as out:
            records = train_py(2, out, steps, "parallel.pp_size=2", "train.micro_batch_size=1",
                               f"train.grad_accum_steps={m}")
        rows.append({"m": m, "median_step_s": statistics.median(r["step_time_s"] for r in records[2:])})
    base = rows[-1]["median_step_s"] / 8
    for r in rows:
        r["measured_per_micro_batch"] = r["median_step_s"] / r["m"] / base
        r["model_per_micro_batch"] = (r["m"] + 1) / r["m"] / (9 / 8)
    return rows


def validation(samples: int) -> dict:
    """Validation of the same `samples` at 1 and 2 ranks (dp), from train.py's val_time_s."""
    times = {}
    for ranks in (1, 2):
        with tempfile.TemporaryDirectory() as out:
            records = train_py(ranks, out, 3, "val.every=1", f"val.num_samples={samples}",
                               "train.micro_batch_size=1", "train.grad_accum_steps=2")
        times[ranks] = statistics.median(r["val_time_s"] for r in records[1:])
    return {"samples": samples, "time_s": times, "speedup": times[1] / times[2]}


def plots(report: dict, out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ms = [r["m"] for r in report["pipeline"]]
    ax.plot(ms, [r["measured_per_micro_batch"] for r in report["pipeline"]], "o-", label="measured")
    ax.plot(ms, [r["model_per_micro_batch"] for r in report["pipeline"]], "s--", label="1F1B model (m+p-1)/m")
    ax.set(xscale="log", xticks=ms, xticklabels=ms, xlabel="micro-batches m (pp = 2)",
           ylabel="time per micro-batch, relative to m = 8", title="pipeline bubble")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "pipeline.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    labels, errors = [], []
    for name, lines in report["in_process"]["planner"].items():
        for kind, v in lines.items():
            labels.append(f"{name}\n{kind}")
            errors.append(100 * (v["predicted"] / v["measured"] - 1))
    ax.bar(range(len(errors)), errors)
    ax.set_xticks(range(len(errors)), labels, fontsize=7)
    ax.set(ylabel="predicted / measured - 1 (%)", title="memory planner error")
    ax.axhline(0, color="black", linewidth=0.5)
    fig.tight_layout()
    fig.savefig(out / "planner.png", dpi=100)
    plt.close(fig)
    return ["pipeline.png", "planner.png"]


def markdown(r: dict, figures: list[str]) -> str:
    peer_lines = peer.markdown(r["peer"]) if "peer" in r else []
    peer_lines += recompute.markdown(r["recompute"]) if "recompute" in r else []
    peer_lines += ring.markdown(r["ring"], r.get("runs", {}).get("ring")) if "ring" in r else []
    if "in_process" not in r:                      # a report of the peer section alone
        return "\n".join([f"# Benchmarks ({r['date']}, {r['machine']})", *peer_lines, ""])
    p = r["in_process"]
    med = p["median_step_s"]
    lines = [f"# Benchmarks ({r['date']}, {r['machine']})", "",
             f"`python -m bench --steps {r['steps']}`; model: `debug` with {' '.join(p['model']['overrides'])}; "
             f"fp32, ZeRO-0, one process unless noted; medians of {p['steps_each']} steps.", "",
             "| what | measured | compared with | ratio |", "|---|---|---|---|",
             f"| step time, toolkit (tp = pp = 1) | {med['toolkit'] * 1e3:.1f} ms | plain nn.Linear, same engine: "
             f"{med['nn.Linear'] * 1e3:.1f} ms | {p['overhead']:.3f} |",
             f"| model FLOP/s, toolkit | {p['model']['step_flops'] / med['toolkit'] / 1e9:.2f} GFLOP/s | this "
             f"machine's fp32 matmul: {p['matmul_flops'] / 1e9:.1f} GFLOP/s | {p['mfu']['toolkit']:.3f} (MFU) |",
             f"| model FLOP/s, plain nn.Linear | {p['model']['step_flops'] / med['nn.Linear'] / 1e9:.2f} GFLOP/s | "
             f"the same | {p['mfu']['nn.Linear']:.3f} (MFU) |",
             f"| saved activations with checkpointing | | without | "
             f"{p['checkpointing']['activation_bytes_ratio']:.3f} |",
             f"| step time with checkpointing | {med['toolkit, checkpointing'] * 1e3:.1f} ms | without: "
             f"{med['toolkit'] * 1e3:.1f} ms | {p['checkpointing']['step_time_ratio']:.3f} |"]
    for name, kinds in p["planner"].items():
        for kind, v in kinds.items():
            lines.append(f"| planner, {kind} ({name}) | {v['measured']:,} B held | predicted {v['predicted']:,} B "
                         f"| {v['predicted'] / v['measured']:.4f} |")
    for row in r["pipeline"]:
        lines.append(f"| pp = 2, m = {row['m']}: time per micro-batch vs m = 8 | {row['measured_per_micro_batch']:.3f}"
                     f" | 1F1B model (m+1)/m / (9/8): {row['model_per_micro_batch']:.3f} | "
                     f"{row['measured_per_micro_batch'] / row['model_per_micro_batch']:.3f} |")
    for row in r["communication"]:
        lines.append(f"| {row['kind']} bytes per step ({', '.join(f'{k} {v}' for k, v in row['layout'].items())}) | "
                     f"{row['measured']:,} B | {row['formula']}: {row['theory']:,} B | {row['ratio']:.4f} |")
    lines += compiled.markdown_rows(r["compile"]) if "compile" in r else []
    v = dict(r["validation"], time_s={int(k): t for k, t in r["validation"]["time_s"].items()})   # JSON keys: str
    lines.append(f"| validation of {v['samples']} samples, 2 ranks | {v['time_s'][2]:.2f} s | 1 rank: "
                 f"{v['time_s'][1]:.2f} s | {v['speedup']:.2f}x speed-up |")
    lines += ["", *[f"![{f}]({f})" for f in figures], "",
              "Communication volumes are whole-tensor sizes per step and rank (an all-gather's output, a "
              "reduce-scatter's input); pipeline bytes are what both stages sent. ZeRO-3 moves 2 x parameters "
              "here, not 3: DeepSpeed keeps a gathered parameter for backward when it is reused within "
              "stage3_max_reuse_distance, which every parameter of a small model is.", *peer_lines, ""]
    return "\n".join(lines)


SECTIONS = {"in_process": lambda steps: in_process(steps), "pipeline": lambda steps: pipeline(max(6, steps // 2)),
            "validation": lambda steps: validation(8), "communication": lambda steps: comm.measure(MID),
            "compile": lambda steps: compiled.measure(MID, steps), "recompute": lambda steps: recompute.measure(steps),
            "ring": lambda steps: ring.measure(MID, max(3, steps // 4)), "peer": lambda steps: peer.run()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench"))
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run ({', '.join(SECTIONS)}); the others keep the figures "
                         f"of the existing report.json in --out")
    args = ap.parse_args()
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = [x for x in only if x not in SECTIONS]
    if unknown:
        ap.error(f"--only {','.join(unknown)}: unknown section; choose from {', '.join(SECTIONS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tic = time.perf_counter()
    old = out / "report.json"
    report = json.loads(old.read_text()) if old.is_file() and len(only) < len(SECTIONS) else {}
    stamp = {"steps": args.steps, "date": time.strftime("%Y-%m-%d"),
             "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}"}
    if len(only) == len(SECTIONS) or "date" not in report:
        report.update(stamp)                     # the header's run; a section run alone carries its own stamp
    report.setdefault("runs", {}).update({name: stamp for name in only})
    bar = tqdm(only, desc="bench", unit="section", file=sys.stderr, dynamic_ncols=True)
    for name in bar:
        bar.set_postfix_str(name)
        report[name] = SECTIONS[name](args.steps)
    report["seconds"] = round(time.perf_counter() - tic, 1)
    figures = plots(report, out) if "pipeline" in report and "in_process" in report else []
    if "recompute" in report:
        recompute.plot(report["recompute"], out)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report, figures))
    print((out / "report.md").read_text())
    print(f"bench: {report['seconds']} s; {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
