"""Peer rows: the toolkit's model (tp = pp = 1, one process) against diffusers' class on the same weights.

    python -m bench --only peer          # the peer section of bench/report.md alone

For each preset of PRESETS (a family with a diffusers counterpart: CogVideoX's CogVideoXTransformer3DModel with
3D rotary positions, as 5B; Wan 2.1's WanTransformer3DModel) and each size, the diffusers class the family's
ReleasedFormat names is built from the config.json the toolkit would export (random weights), written by
save_pretrained and read into the toolkit by `load_released` (the path `model.init_from` takes), so both hold
the same weights; each is called as its pipeline calls it (ReleasedFormat.reference_call). Then, on the same
inputs:

    max |diff|        of the two predictions (before any step)
    train step        forward + MSE loss + backward + AdamW (foreach) step, median over alternating blocks
    forward           the prediction under no_grad (sampling's cost), likewise
    saved bytes       what autograd saves for backward in one forward (unique storages, parameters skipped)
    profile           torch.profiler self time of one training step by op group (bench/profile.py)

Both run on parallel.distributed.accelerator's device: fp32 on CPU, bf16 with SDPA's flash kernels on a GPU.
"""
from __future__ import annotations

import math
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench import profile

# (heads, head_dim, latent frames, latent height = width): mid 4 x 64 = 256 hidden at 4 x 10 x 10 = 400
# video tokens (CogVideoX adds 16 text tokens: 416); wide 8 x 64 = 512 hidden at 4 x 16 x 16 = 1,024 (+16).
SIZES = {"mid": (4, 64, 4, 20), "wide": (8, 64, 4, 32)}
# The release size (bench/peer_release.py, not in `run`'s rows): a PRESETS row's release preset at its own geometry,
# with a few blocks: CogVideoX-5B, 4 blocks at 49 x 480 x 720 (17,550 video + 226 text = 17,776 tokens); Wan 2.1 14B,
# 2 blocks at its 480p size 81 x 480 x 832 (32,760 tokens; the preset's 720p is 75,600).
RELEASE = {"debug": ("cogvideox-5b", ("model.num_layers=4",)),
           "debug-wan": ("wan2.1-t2v-14b", ("model.num_layers=2", "parallel.sp_size=1", "data.height=480",
                                            "data.width=832"))}
LAYERS, CHANNELS, TEXT_LEN, TEXT_DIM, BATCH = 4, 16, 16, 128, 1
# The models compared: a preset (configs/<name>.yaml) and the overrides that make it the released architecture
# the row stands for, on top of the size's (_overrides). `{latent}`, `{hidden}`, ... take the size's values.
# debug: CogVideoX with 3D rotary positions, as 5B (the crop base = the latent grid, as 5B samples at its
# sample size); debug-wan: Wan 2.1, FFN 4 x hidden, diffusers' default freq_dim 256.
PRESETS = {
    "debug": ("model.time_embed_dim=128", "model.pos_embed=rope3d", "model.sample_height={latent}",
              "model.sample_width={latent}"),
    "debug-wan": ("model.time_embed_dim=256", "model.ffn_hidden_size={ffn}"),
}


@dataclass
class Pair:
    """One family at one size: the diffusers model, the toolkit's, and how each is called."""
    family: str
    size: str
    peer: torch.nn.Module
    toolkit: torch.nn.Module
    inputs: tuple            # (latents [B, C, T, H, W], timesteps [B], text [B, L, TEXT_DIM])
    fmt: object              # the family's ReleasedFormat (models/spec.py): diffusers' call convention
    peer_kwargs: dict        # extra diffusers arguments (CogVideoX's rotary tables, as its pipeline makes them)
    tokens: int              # the sequence the layers see (text tokens included where they join it)
    hidden: int = 0
    heads: int = 0
    layer_class: type = None  # the toolkit's block class (what train.compile compiles)

    def run_toolkit(self):
        return self.toolkit.predict(self.inputs)

    def run_peer(self):
        return self.fmt.reference_call(self.peer, self.inputs, self.peer_kwargs)


def _overrides(preset: str, size: str, folder: str) -> tuple[str, list[str]]:
    """The config to load and its overrides: at SIZES, the size's (generic model and data keys) and the preset's own
    (PRESETS); at "release", RELEASE's preset and its block count."""
    if size == "release":
        config, keys = RELEASE[preset]
        return config, [*keys, f"train.micro_batch_size={BATCH}", f"model.init_from={folder}"]
    heads, head_dim, frames, latent = SIZES[size]
    hid = heads * head_dim
    common = [f"model.num_layers={LAYERS}", f"model.hidden_size={hid}", f"model.num_heads={heads}",
              f"model.head_dim={head_dim}", f"model.in_channels={CHANNELS}", f"model.text_embed_dim={TEXT_DIM}",
              f"model.max_text_len={TEXT_LEN}", f"data.num_frames={(frames - 1) * 4 + 1}",
              f"data.height={latent * 8}", f"data.width={latent * 8}", f"train.micro_batch_size={BATCH}",
              f"model.init_from={folder}"]
    return preset, common + [o.format(latent=latent, hidden=hid, ffn=4 * hid, heads=heads, frames=frames)
                             for o in PRESETS[preset]]


def build_pair(preset: str, size: str, device: torch.device, dtype: torch.dtype) -> Pair:
    """The diffusers model built from the toolkit config's released config.json (ReleasedFormat.config, what
    export writes; random weights, every tensor perturbed so norms and biases matter) and the toolkit's model
    read from its save_pretrained folder."""
    import diffusers

    from models.registry import family, sequence_tokens
    from parallel.model.build import layer_specs
    from parallel.experiment.config import load_config
    from parallel.distributed.pipeline import SequentialDiT
    from parallel.distributed.topology import ParallelContext
    from parallel.weights.diffusers import load_released, released_format

    with tempfile.TemporaryDirectory() as folder:
        cfg = load_config(*_overrides(preset, size, folder))
        fmt = released_format(cfg.model)
        torch.manual_seed(0)
        peer = getattr(diffusers, fmt.class_name).from_config(fmt.config(cfg.model, cfg.data))
        with torch.no_grad():
            for p in peer.parameters():
                p.add_(0.02 * torch.randn_like(p))
        peer.save_pretrained(folder)
        ctx = ParallelContext.single()
        specs = layer_specs(cfg, ctx)
        toolkit = SequentialDiT(specs)
        read = load_released(toolkit, ctx, cfg.model, folder)
    name = family(cfg.model).name
    if read != sum(p.numel() for p in peer.parameters()):
        raise RuntimeError(f"{preset} {size}: the toolkit read {read} weights, diffusers holds "
                           f"{sum(p.numel() for p in peer.parameters())}")
    inputs = fmt.example_inputs(cfg.model, cfg.data, BATCH, torch.Generator().manual_seed(7))
    inputs = tuple(x.to(device, dtype if x.is_floating_point() and x.dim() > 1 else None) for x in inputs)
    peer, toolkit = peer.to(device, dtype), toolkit.to(device, dtype)
    return Pair(name, size, peer, toolkit, inputs, fmt, fmt.reference_kwargs(peer, inputs),
                sequence_tokens(cfg.model, cfg.data), cfg.model.hidden_size, cfg.model.num_heads, specs[1].typename)


def saved_bytes(run, model: torch.nn.Module) -> int:
    """Bytes autograd saves for backward in one forward: unique storages, the model's parameters left out."""
    from parallel.plan.trace import parameter_storages, record_saved, storage_bytes
    params = parameter_storages(model)
    with record_saved() as found:
        out = run()
    total = sum(storage_bytes(t) for key, t in found.items() if key not in params)
    del out
    return total


def step_flops(pair: Pair) -> int:
    """FLOPs of one training step of the toolkit's model (forward + backward), counted by torch's
    FlopCounterMode: matmuls and attention, the same work diffusers does."""
    from torch.utils.flop_counter import FlopCounterMode
    counter = FlopCounterMode(display=False)
    with counter:
        pair.run_toolkit().float().square().mean().backward()
    pair.toolkit.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def alternate(runs: dict, target, blocks: int, per_block: int, sync, first: dict | None = None):
    """Times of `runs` ({name: (predict, model)}) in alternating blocks of `per_block` steps, the first block a
    warm-up: ({("train" or "forward", name): [seconds]}, the train step function). A train step is forward + MSE +
    backward + AdamW (foreach); forward the prediction under no_grad. `first` gets each (what, name)'s first call's
    seconds (a compiled model's compile is in it)."""
    opts = {k: torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True) for k, (_, model) in runs.items()}

    def train_step(name):
        run, model = runs[name]
        F.mse_loss(run().float(), target.float()).backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)

    def forward(name):
        with torch.no_grad():
            runs[name][0]()

    times = {(what, k): [] for what in ("train", "forward") for k in runs}
    for block in range(blocks + 1):
        for what, fn in (("train", train_step), ("forward", forward)):
            for name in runs:
                for i in range(per_block):
                    sync()
                    tic = time.perf_counter()
                    fn(name)
                    sync()
                    if block:
                        times[what, name].append(time.perf_counter() - tic)
                    elif first is not None and i == 0:
                        first[what, name] = time.perf_counter() - tic
    return times, train_step


def measure(pair: Pair, blocks: int, per_block: int, sync) -> dict:
    """Alternating blocks of `per_block` steps, toolkit then diffusers, the first block a warm-up."""
    with torch.no_grad():
        diff = (pair.run_toolkit().float() - pair.run_peer().float()).abs().max().item()
    runs = {"toolkit": (pair.run_toolkit, pair.toolkit), "diffusers": (pair.run_peer, pair.peer)}
    saved = {k: saved_bytes(run, model) for k, (run, model) in runs.items()}
    flops = step_flops(pair)
    target = torch.randn_like(pair.run_toolkit().detach())
    times, train_step = alternate(runs, target, blocks, per_block, sync)
    med = {f"{what}_{k}_s": statistics.median(v) for (what, k), v in times.items()}
    # the ratio: median of toolkit / diffusers over steps adjacent in time, so load that changes over minutes
    # (other jobs on the machine) cancels within each pair
    paired = {what: statistics.median(a / b for a, b in zip(times[what, "toolkit"], times[what, "diffusers"]))
              for what in ("train", "forward")}
    table = {name: profile.step_table(lambda n=name: train_step(n), sync, steps=1) for name in runs}
    return {"family": pair.family, "size": pair.size, "hidden": pair.hidden, "heads": pair.heads,
            "tokens": pair.tokens, "max_abs_diff": diff, **med, "steps_each": len(times["train", "toolkit"]),
            "train_ratio": paired["train"], "forward_ratio": paired["forward"],
            "saved_toolkit_bytes": saved["toolkit"], "saved_diffusers_bytes": saved["diffusers"],
            "saved_ratio": saved["toolkit"] / saved["diffusers"], "step_flops": flops, "profile": table}


def run(blocks: int = 6, per_block: int = 1) -> dict:
    """Every family x size; the device, its dtype and its peak FLOP/s (bench/device.py) for the MFU."""
    from bench import device as dev
    from parallel.distributed import accelerator

    where, dtype = dev.device_and_dtype()
    threads = torch.get_num_threads()
    if where.type == "cpu":        # one thread: on a machine shared with other jobs, OpenMP's spinning threads
        torch.set_num_threads(1)   # made steps 20-70x slower and the ratios noise; one thread keeps them stable
    rows = []
    for preset in PRESETS:
        for size in SIZES:
            pair = build_pair(preset, size, where, dtype)
            rows.append(measure(pair, blocks, per_block, accelerator.synchronize))
            del pair
    peak = dev.peak_flops(where, dtype)
    torch.set_num_threads(threads)
    for r in rows:
        r["mfu_toolkit"] = r["step_flops"] / r["train_toolkit_s"] / peak["flops"] if peak["flops"] else None
        r["mfu_diffusers"] = r["step_flops"] / r["train_diffusers_s"] / peak["flops"] if peak["flops"] else None
    return {"device": str(where), "dtype": str(dtype).replace("torch.", ""), "peak": peak, "rows": rows,
            "threads": 1 if where.type == "cpu" else None,
            "blocks": blocks, "per_block": per_block, "geomean_train_ratio":
            math.exp(statistics.mean(math.log(r["train_ratio"]) for r in rows))}


def markdown(p: dict) -> list[str]:
    """The report's peer section: one row per family x size, then the profile table."""
    from bench.profile import ORDER
    peak = p["peak"]
    mfu_note = (f"MFU: model FLOPs (torch FlopCounterMode, forward + backward) per second over {peak['name']}'s "
                f"peak {peak['flops'] / 1e12:.3g} TFLOP/s ({peak['source']})" if peak["flops"]
                else f"MFU: {peak['name']}: unknown peak, none reported")
    lines = ["", "## Peer: the toolkit against diffusers", "",
             f"`python -m bench --only peer`: each family's diffusers class and the toolkit's model (tp = pp = 1) "
             f"on the same weights (save_pretrained, then `load_released`, the `model.init_from` path) and inputs, "
             f"one process on {p['device']}{' (1 thread)' if p.get('threads') else ''} in {p['dtype']}, {LAYERS} blocks, batch {BATCH}; {p['blocks']} "
             f"alternating blocks of {p['per_block']} step(s) after a warm-up block; times are medians, ratios the "
             f"median of toolkit / diffusers over adjacent blocks. Train step = forward + "
             f"MSE + backward + AdamW (foreach); forward = the prediction under no_grad; saved = bytes autograd "
             f"saves for backward (unique storages, parameters excluded). Ratios are toolkit / diffusers (< 1: "
             f"the toolkit is faster or smaller). {mfu_note}. The machine is shared with other jobs: expect a few "
             f"percent of noise in the time ratios.", "",
             "| family, size | hidden (heads x 64), tokens | max abs diff | train step ms (toolkit / diffusers) "
             "| train ratio | forward ratio | saved MiB (toolkit / diffusers) | saved ratio | MFU (toolkit / "
             "diffusers) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in p["rows"]:
        mfu = f"{r['mfu_toolkit']:.3f} / {r['mfu_diffusers']:.3f}" if r["mfu_toolkit"] is not None else "n/a"
        lines.append(f"| {r['family']}, {r['size']} | {r['hidden']} ({r['heads']}), {r['tokens']} | "
                     f"{r['max_abs_diff']:.1e} | {r['train_toolkit_s'] * 1e3:.1f} / {r['train_diffusers_s'] * 1e3:.1f}"
                     f" | **{r['train_ratio']:.3f}** | {r['forward_ratio']:.3f} | {r['saved_toolkit_bytes'] / 2**20:.1f}"
                     f" / {r['saved_diffusers_bytes'] / 2**20:.1f} | **{r['saved_ratio']:.3f}** | {mfu} |")
    lines += ["", f"Goal: train ratio <= 0.9 and saved ratio <= 1.0 at every size; geometric mean of the train "
              f"ratios: {p['geomean_train_ratio']:.3f}."]
    for r in p["rows"]:
        t = r["profile"]["toolkit"]
        kernels = (t["linear layers"] + t["attention"]) / t["total"]
        misses = [f"train ratio missed by {r['train_ratio'] / 0.9 - 1:.0%}" if r["train_ratio"] > 0.9 else "",
                  f"saved ratio missed by {r['saved_ratio'] - 1:.1%}" if r["saved_ratio"] > 1.0 else ""]
        if any(misses):
            lines.append(f"- {r['family']}, {r['size']}: {'; '.join(m for m in misses if m)}. The profile: matmuls "
                         f"and attention are {kernels:.0%} of the toolkit's step and take the same time as "
                         f"diffusers' (the same kernels on the same shapes); the element-wise rest ({1 - kernels:.0%})"
                         f" would have to lose {min(1.0, (r['train_ratio'] - 0.9) / max(1 - kernels, 1e-9)):.0%} of its"
                         f" time for the goal: work for a fused (compiled) block more than for eager rewrites.")
    lines += ["",
              "Where a training step's time goes (torch.profiler self time per step, ms; groups by op name, "
              "bench/profile.py; the profiler's own overhead inflates small ops):", "",
              "| family, size, model | " + " | ".join(ORDER) + " | total |", "|---" * (len(ORDER) + 2) + "|"]
    for r in p["rows"]:
        for who, table in r["profile"].items():
            lines.append(f"| {r['family']}, {r['size']}, {who} | " + " | ".join(f"{table[g] * 1e3:.1f}" for g in ORDER)
                         + f" | {table['total'] * 1e3:.1f} |")
    return lines
