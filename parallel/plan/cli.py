"""Will it fit? Per-rank memory of a layout, or a search for the layouts that fit, ranked by step time.

    python -m parallel.plan --config configs/cogvideox-5b.yaml --deepspeed-config ds_configs/zero1_bf16.json \
        --world-size 8 --device-memory 80GiB --set parallel.tp_size=2 [--search] [--format text|json|markdown] \
        [--device-profile a100-80gb] [--buckets preset|FxHxW,...]

Plan mode sizes the layout in the config (checked first by `parallel.check`); `--search` tries every
layout of the process count, and when its best layout needs a DeepSpeed JSON that ds_configs/ does not
ship, writes it (`--ds-out`) and names it in the command it prints. A run of several shapes (buckets: `--buckets`, or a directory dataset's
manifest) is sized on its longest, with a row per bucket (parallel/plan/buckets.py).
Exit status: 0 fits, 2 does not fit (or nothing fits), 1 refused input.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
from pathlib import Path
from typing import Optional

# DeepSpeed's logger writes to the stdout it finds when first imported; point it at stderr, so stdout
# carries only the report (`--format json | jq` works).
with contextlib.redirect_stdout(sys.stderr):
    import deepspeed  # noqa: F401

from parallel.experiment import ds_config as dsc
from parallel.check import check
from parallel.experiment.config import ConfigError, ExperimentConfig, RecomputeConfig, load_config
from parallel.experiment.cli import Parser, add_experiment_args, add_renamed, add_world_size, refused, require
from parallel.plan.buckets import bucket_rows, plan_buckets, render_buckets_text
from parallel.plan.memory import LINES, OPTIONAL_LINES, EngineSettings, MemoryPlan, plan_memory
from parallel.plan.search import (DEVICES, Candidate, SearchResult, count_params, fewest_swapped, search,
                                  shipped_config, with_block_swap, zero3_offload)
from parallel.plan.trace import ActivationTracer, ring_of, sequence_length
from parallel.experiment.units import gib, parse_size

SCHEMA = "video-dit-parallel/memory-plan/1"
INVALID_SHOWN = 8


def parse_bytes(text: str, option: str) -> int:
    """A size flag with its unit required (GiB and GB differ by 7%); a ConfigError naming the flag."""
    try:
        return parse_size(text, unit_required=True)
    except ValueError as e:
        raise ConfigError(f"{option} {e}") from None


def _model_info(cfg: ExperimentConfig, tracer: ActivationTracer, ds: dict) -> dict:
    d = cfg.data
    return {"name": cfg.model.name, "parameters": count_params(tracer)[0],
            "video": f"{d.num_frames}x{d.height}x{d.width}", "tokens": sequence_length(cfg),
            "precision": dsc.precision(ds)}


def _memory_dict(memory: MemoryPlan) -> dict:
    return {"stages": [{"stage": s.stage, "blocks": s.blocks, "micro_batches_in_flight": s.in_flight,
                        "parameters_on_rank": s.params, "lines": s.lines, "host": s.host, "total": s.total}
                       for s in memory.stages],
            "worst_stage": memory.worst.stage, "total": memory.worst.total, "device_memory": memory.device_memory,
            "fits": memory.fits, "headroom": memory.headroom, "optimizer": memory.optimizer_path,
            "activations_per_micro_batch": memory.per_block}


def plan_report(cfg: ExperimentConfig, ds: dict, args, tracer: ActivationTracer, dp: int) -> dict:
    memory = plan_memory(cfg, ds, dp, args.device_memory, tracer, args.margin, args.workspace)
    eng = EngineSettings.from_ds(ds, cfg.model.num_layers)
    return {"schema": SCHEMA, "mode": "plan", "model": _model_info(cfg, tracer, ds),
            "layout": {"tp": cfg.parallel.tp_size, "sp": cfg.parallel.sp_size, "pp": cfg.parallel.pp_size, "dp": dp,
                       "ring": ring_of(cfg, cfg.parallel.tp_size, cfg.parallel.sp_size),
                       "world": args.world_size,
                       "zero": eng.zero, "micro_batch": cfg.train.micro_batch_size,
                       "grad_accum": cfg.train.grad_accum_steps, "checkpoint_every": eng.checkpoint_every,
                       "partition_activations": eng.partition_activations,
                       "cpu_checkpointing": eng.cpu_checkpointing,
                       "recompute": None if cfg.train.recompute is None else cfg.train.recompute.model_dump(),
                       "activation_compression": None if cfg.train.activation_compression is None
                       else cfg.train.activation_compression.dtype},
            "device": _device_dict(args), "assumptions": _assumptions(args), **_memory_dict(memory),
            **({"block_swap": _swap_dict(cfg, memory, args)} if cfg.train.block_swap else {})}


def _swap_dict(cfg: ExperimentConfig, memory: MemoryPlan, args) -> dict:
    """train.block_swap's figures on the worst stage: host bytes, device copies, bytes a step copies to the device
    (each swapped block up to twice a micro-batch) and their time over the profile's host link."""
    worst, bw = memory.worst, DEVICES[args.device].host_bw
    copied = 2 * worst.host["block_swap"] * cfg.train.grad_accum_steps
    return {"blocks": cfg.train.block_swap, "host": worst.host["block_swap"], "device": worst.lines["block_swap"],
            "copied_per_step": copied, "copy_seconds": copied / bw, "host_bw": bw}


def _offloaded(cfg: ExperimentConfig, ds: dict, eng: EngineSettings):
    """(keys, cfg, JSON, what the JSON changes or None) with the checkpoint inputs on the host
    (train.offload_activations, with block recompute where nothing is checkpointed); no keys when they are."""
    if cfg.train.offload_activations or eng.cpu_checkpointing:
        return [], cfg, ds, None
    keys, rc = ["train.offload_activations=true"], cfg.train.recompute
    if rc is None and not eng.checkpoint_every:
        keys, rc = keys + ["train.recompute.granularity=block"], RecomputeConfig()
    own = json.loads(json.dumps(ds))
    partitioned = (own.get("activation_checkpointing") or {}).pop("partition_activations", False)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"offload_activations": True, "recompute": rc})})
    return keys, cfg, own, "activation_checkpointing.partition_activations=false" if partitioned else None


def next_step(cfg: ExperimentConfig, ds: dict, args, tracer: ActivationTracer, dp: int) -> dict:
    """What to try when the layout does not fit, the first that fits: the same layout with its checkpoint inputs on
    the host (`_offloaded`); with LoRA at ZeRO 0-2 also the least train.block_swap that fits; then ZeRO-3 optimizer
    and parameter offload (pp = 1); then LoRA's frozen base in fp8 with block swap; else the device count at which
    --search finds a layout."""
    eng = EngineSettings.from_ds(ds, cfg.model.num_layers)
    keys, cfg_off, own, engine = _offloaded(cfg, ds, eng)
    tries = [(keys, cfg_off, own, engine, False)] if keys else []      # (keys, cfg, JSON, what changes, swap)
    lora = cfg.model.lora
    swap = lora is not None and eng.zero < 3
    if swap:
        tries.append((keys, cfg_off, own, engine, True))
    if keys and cfg.parallel.pp_size == 1 and not (eng.zero == 3 and eng.offload_optimizer and eng.offload_param):
        zero3 = zero3_offload(own)
        if own.get("activation_checkpointing") is not None:
            zero3["activation_checkpointing"] = own["activation_checkpointing"]
        tries.append((keys, cfg_off, zero3, "zero_optimization.stage=3 with offload_optimizer and offload_param "
                      "{\"device\": \"cpu\"}" + (", partition_activations=false" if engine else ""), False))
    if swap and lora.base_dtype is None:
        tries.append((keys + ["model.lora.base_dtype=float8_e4m3fn"], with_fp8_base(cfg_off), own, engine, True))
    for keys_t, cfg_t, ds_t, engine_t, swapped in tries:
        if check(with_block_swap(cfg_t, 1) if swapped else cfg_t, ds_t, args.deepspeed_config, args.world_size)[1]:
            continue
        tracer_t = tracer if cfg_t.model.lora == lora else ActivationTracer(cfg_t, tracer.dtype)
        memory = plan_memory(cfg_t, ds_t, dp, args.device_memory, tracer_t, args.margin, args.workspace)
        if swapped and not memory.fits:          # the least N that fits (more than the config's, if it has one)
            cfg_t, memory = fewest_swapped(cfg_t, ds_t, dp, args.device_memory, tracer_t, args.margin, args.workspace)
            keys_t = keys_t + [f"train.block_swap={cfg_t.train.block_swap}"]
        if memory.fits:
            return {"keys": keys_t, "engine": engine_t, "total": memory.worst.total,
                    "host_memory": max(sum(st.host.values()) for st in memory.stages)}
    return {"keys": None, "devices_that_fit": devices_that_fit(cfg, ds, args, tracer)}


def _next_step_text(r: dict) -> list[str]:
    step, world = r["next_step"], r["device"]["count"]
    if step["keys"]:
        sets = " ".join(f"--set {k}" for k in step["keys"])
        engine = f" and a DeepSpeed JSON with {step['engine']}" if step["engine"] else ""
        return [f"next step: {sets}{engine}: {gib(step['total'])} GiB, fits, with {gib(step['host_memory'])} GiB "
                f"of host memory a process; --search ranks every layout with these options"]
    n = step["devices_that_fit"]
    return [f"next step: with checkpoint inputs on the host, ZeRO-3 offload (and with LoRA block swap and an fp8 "
            f"base) it still does not fit on {world} device(s); "
            + (f"{n} would (--world-size {n} --search shows the layouts)" if n else
               "no device count up to 1024 fits: a shorter or smaller video")]


def _device_dict(args) -> dict:
    return {"key": args.device, "name": DEVICES[args.device].name, "count": args.world_size,
            "per_node": args.devices_per_node, "memory": args.device_memory}


def _assumptions(args) -> dict:
    return {"margin_fraction": args.margin, "workspace": args.workspace, "utilisation": args.utilisation}


def _candidate_dict(c: Candidate, args, ds_file: Optional[str] = None) -> dict:
    """One layout; its command only when its JSON exists: shipped, or written (`ds_file`); else null."""
    shipped = shipped_config(c.ds)
    cfg_arg = " ".join(f"--set {o}" for o in c.overrides)
    launcher = f"--num_gpus {args.world_size}" if args.world_size <= args.devices_per_node else "--hostfile hosts"
    ds_arg = shipped or ds_file
    d = c.dims
    return {"tp": d.tp_size, "sp": d.sp_size, "ring": d.ring_size, "pp": d.pp_size, "dp": d.dp_size, "zero": c.zero,
            "checkpointing": c.checkpointing, "recompute": c.recompute, "micro_batch": c.micro_batch,
            "global_batch": c.cfg.global_batch_size(d.dp_size),
            "memory": {"total": c.memory.worst.total, "worst_stage": c.memory.worst.stage,
                       "headroom": c.memory.headroom, "lines": c.memory.worst.lines,
                       "optimizer": c.memory.optimizer_path},
            "step_time": None if c.time is None else vars(c.time), "host_memory": c.host_memory,
            "overrides": c.overrides, "ds_config": {"file": ds_arg, "shipped": shipped is not None, "json": c.ds},
            "command": None if ds_arg is None else
            f"deepspeed {launcher} train.py --config {args.config} --deepspeed-config {ds_arg} {cfg_arg}"}


def planned_name(ds: dict) -> str:
    """ds_config.planned.zero<stage>-<precision>-<8 hex digits of the JSON's SHA-256>.json: each JSON its own
    name, so a later search (another world size, another device) never rewrites the file an earlier search's
    `run it:` line names."""
    digest = hashlib.sha256(json.dumps(ds, sort_keys=True).encode()).hexdigest()[:8]
    return f"ds_config.planned.zero{dsc.zero_stage(ds)}-{dsc.precision(ds)}-{digest}.json"


def write_planned(c: Candidate, cfg: ExperimentConfig, args) -> Optional[str]:
    """The best layout's DeepSpeed JSON, written to --ds-out (default <train.output_dir>/`planned_name`) when
    ds_configs/ has no equal file, so the printed command runs as printed; its path, or None. (An existing
    --ds-out is refused before the search: `ds_out_problem`.)"""
    if shipped_config(c.ds) is not None:
        return None
    path = Path(args.ds_out or f"{cfg.train.output_dir}/{planned_name(c.ds)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(c.ds, indent=2) + "\n")
    print(f"wrote {path} (the best layout's DeepSpeed JSON)", file=sys.stderr)
    return str(path)


def ds_out_problem(args, cfg: ExperimentConfig) -> Optional[str]:
    """An --ds-out that exists: an earlier search's JSON, which that search's `run it:` line names, is not
    rewritten (found before the search, which takes minutes at release sizes)."""
    if not args.ds_out or not Path(args.ds_out).exists():
        return None
    return (f"--ds-out {args.ds_out} exists (an earlier search's DeepSpeed JSON, which its `run it:` line names, "
            f"is not rewritten): give another --ds-out, remove it, or leave --ds-out out (the JSON then gets a name "
            f"of its own in {cfg.train.output_dir}/, ds_config.planned.zero<stage>-<precision>-<hash>.json)")


# The search's passes, each tried when the one before finds nothing: (name, offload, fp8 base). Offload: checkpoint
# inputs on the host, ZeRO-3 optimizer and parameter offload, and (LoRA) block swap; fp8 base (LoRA): all that again
# with the frozen base in fp8, which changes the numbers (docs/lora.md#fp8-base), so it comes last.
PASSES = (("none", False, False), ("offload", True, False), ("fp8_base", True, True))


def with_fp8_base(cfg: ExperimentConfig) -> ExperimentConfig:
    lora = cfg.model.lora.model_copy(update={"base_dtype": "float8_e4m3fn"})
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": lora})})


def _search(cfg: ExperimentConfig, ds: dict, args, tracer: ActivationTracer, world: int,
            progress: bool = False) -> tuple[SearchResult, str]:
    """The search at `world` devices; when nothing fits, again with offload (search's OFFLOAD_OPTIONS, and with LoRA
    the least train.block_swap that fits), then with LoRA's frozen base in fp8 too (unless the config has it): the
    result and the name of the pass (PASSES) that found it, or the last tried."""
    lora = cfg.model.lora
    for name, offload, fp8 in PASSES:
        if fp8 and (lora is None or lora.base_dtype is not None):
            continue
        cfg_p, tracer_p = (with_fp8_base(cfg), ActivationTracer(with_fp8_base(cfg), tracer.dtype)) if fp8 \
            else (cfg, tracer)
        res = search(cfg_p, ds, world, args.devices_per_node, args.device_memory, DEVICES[args.device], tracer_p,
                     args.utilisation, args.margin, args.workspace, source=args.deepspeed_config, progress=progress,
                     offload=offload, swap=offload and lora is not None)
        if res.ranked:
            break
    return res, name


def devices_that_fit(cfg: ExperimentConfig, ds: dict, args, tracer: ActivationTracer, limit: int = 1024):
    """The least device count, doubling from --world-size up to `limit`, at which the search (offload included)
    finds a layout that fits; None when none does."""
    world = args.world_size * 2
    while world <= limit:
        if _search(cfg, ds, args, tracer, world)[0].ranked:
            return world
        world *= 2
    return None


def search_report(cfg: ExperimentConfig, ds: dict, args, tracer: ActivationTracer, found=None) -> dict:
    res, found_by = _search(cfg, ds, args, tracer, args.world_size, progress=True)
    closest = sorted(res.not_fitting, key=lambda c: c.memory.worst.total)
    best = res.ranked[0] if res.ranked else None
    buckets = {"buckets": bucket_rows(best.cfg, found, best.ds, best.dims.dp_size, args)} if found and best else {}
    return {"schema": SCHEMA, "mode": "search", "model": _model_info(cfg, tracer, ds),
            "device": _device_dict(args), "assumptions": _assumptions(args), "grad_accum": cfg.train.grad_accum_steps,
            "counts": {"fitting": len(res.ranked), "not_fitting": len(res.not_fitting), "invalid": len(res.invalid)},
            "offload": found_by != "none", "fp8_base": found_by == "fp8_base",
            "devices_that_fit": None if res.ranked else devices_that_fit(cfg, ds, args, tracer),
            "ranked": [_candidate_dict(c, args, write_planned(c, cfg, args) if i == 0 else None)
                       for i, c in enumerate(res.ranked[:args.top])],
            "not_fitting": [_candidate_dict(c, args) for c in closest[:args.top]],
            "invalid": [{"layout": layout, "problems": problems} for layout, problems in res.invalid], **buckets}


def _header(r: dict) -> list[str]:
    m, d = r["model"], r["device"]
    return [f"model: {m['name']} ({m['parameters']:,} parameters), {m['video']} -> {m['tokens']:,} tokens, "
            f"{m['precision']}",
            f"devices: {d['count']} x {d['key']} ({gib(d['memory'])} GiB, {d['per_node']} per node)"]


def render_plan_text(r: dict) -> str:
    lay, acts = r["layout"], r["activations_per_micro_batch"]
    ckpt = "off"
    if lay["checkpoint_every"]:
        ckpt = f"every {lay['checkpoint_every']} block(s)" + (", partitioned over tp" if lay["partition_activations"]
                                                            else "") + (", on host" if lay["cpu_checkpointing"] else "")
    if lay.get("recompute"):
        rc = lay["recompute"]
        ckpt = f"{rc['granularity']} of every {rc['every']} block(s) (train.recompute)"
    if lay.get("activation_compression"):
        ckpt += f", saved activations stored as {lay['activation_compression']}"
    out = _header(r) + [
        f"layout: tp={lay['tp']} sp={lay['sp']}{_ring_text(lay)} pp={lay['pp']} dp={lay['dp']}, ZeRO-{lay['zero']} "
        f"({r['optimizer']}), "
        f"micro-batch {lay['micro_batch']} x {lay['grad_accum']} accumulation steps, activation checkpointing {ckpt}",
        f"activations per micro-batch on one tp{' x sp' if lay['sp'] > 1 else ''} rank (traced): block {gib(acts['block_activations'])} GiB, "
        f"its input {gib(acts['block_input'])} GiB (kept per checkpoint: {gib(acts['checkpoint_input'])}), "
        f"embed {gib(acts['embed_activations'])}, final + loss {gib(acts['final_activations'])}", ""]
    stages = r["stages"]
    shown = stages if len(stages) <= 8 else stages[:4] + stages[-4:]
    width = max(len(label) for _, label in LINES) + 4
    out.append(f"{'per rank, GiB':<{width}}" + "".join(f"{'stage ' + str(s['stage']):>10}" for s in shown))
    out.append(f"{'blocks':<{width}}" + "".join(f"{s['blocks']:>10}" for s in shown))
    out.append(f"{'micro-batches in flight':<{width}}" + "".join(f"{s['micro_batches_in_flight']:>10}" for s in shown))
    for key, label in LINES:
        if key in OPTIONAL_LINES and not any(s["lines"][key] for s in stages):
            continue
        out.append(f"{label:<{width}}" + "".join(f"{gib(s['lines'][key]):>10}" for s in shown))
    out.append(f"{'total':<{width}}" + "".join(f"{gib(s['total']):>10}" for s in shown))
    host = [sum(s["host"].values()) for s in shown]
    if any(host):
        out.append(f"{'host memory':<{width}}" + "".join(f"{gib(h):>10}" for h in host))
    if "block_swap" in r:
        b = r["block_swap"]
        out.append(f"block swap: the last {b['blocks']} blocks of each stage keep {gib(b['host'])} GiB of frozen "
                   f"weights in host memory, {gib(b['device'])} GiB of copies on the device; a step copies up to "
                   f"{gib(b['copied_per_step'])} GiB to the device, {b['copy_seconds']:.2f} s at the "
                   f"{r['device']['key']} profile's {b['host_bw'] / 1e9:g} GB/s, beside the swapped blocks' compute")
    verdict = "fits" if r["fits"] else "DOES NOT FIT"
    out += ["", f"{verdict}: worst rank (stage {r['worst_stage']}) needs {gib(r['total'])} GiB of "
                f"{gib(r['device_memory'])} GiB; {'free' if r['fits'] else 'short by'} {gib(abs(r['headroom']))} GiB",
            f"margin: {r['assumptions']['margin_fraction']:.0%} of the other lines + "
            f"{gib(r['assumptions']['workspace'])} GiB workspace"]
    if "next_step" in r:
        out += _next_step_text(r)
    if "buckets" in r:
        out += render_buckets_text(r["buckets"], "this layout")
    return "\n".join(out)


def _ring_text(lay: dict) -> str:
    """` (ulysses 8 x ring 2)` for a layout with ring attention, else ``."""
    ring = lay.get("ring", 1)
    return f" (ulysses {lay['sp'] // ring} x ring {ring})" if ring > 1 else ""


def _row(rank, c: dict) -> str:
    t = c["step_time"] or {}
    ckpt = c["recompute"]
    sp = c["sp"] if c.get("ring", 1) == 1 else f"{c['sp'] // c['ring']}x{c['ring']}"     # ulysses x ring
    return (f"{rank:>4} {c['tp']:>3} {sp:>3} {c['pp']:>3} {c['dp']:>4} {c['zero']:>5} {ckpt:>5} "
            f"{c['micro_batch']:>4} {gib(c['memory']['total']):>8} {gib(c['memory']['headroom']):>8} "
            + (f"{t['total']:>8.2f} {t['samples_per_s']:>9.3f} {t['compute']:>8.2f} {t['tp']:>6.2f} {t['sp']:>6.2f} "
               f"{t['pp']:>6.2f} {t['dp']:>6.2f} {t['bubble']:>7.2f}" if t else ""))


def render_search_text(r: dict) -> str:
    n = r["counts"]
    out = _header(r) + [f"layouts: {n['fitting']} fit, {n['not_fitting']} valid but too big at micro-batch 1, "
                        f"{n['invalid']} refused by the checker; ranked by samples/s at "
                        f"{r['assumptions']['utilisation']:.0%} of peak, train.grad_accum_steps={r['grad_accum']}", ""]
    head = (f"{'rank':>4} {'tp':>3} {'sp':>3} {'pp':>3} {'dp':>4} {'ZeRO':>5} {'ckpt':>5} {'mb':>4} {'GiB':>8} "
            f"{'free':>8} {'step s':>8} {'samples/s':>9} {'compute':>8} {'tp':>6} {'sp':>6} {'pp':>6} {'dp':>6} "
            f"{'bubble':>7}")
    out += [head] + [_row(i + 1, c) for i, c in enumerate(r["ranked"])]
    if not r["ranked"]:
        n = r.get("devices_that_fit")
        tried = ", block swap (train.block_swap) and an fp8 base (model.lora.base_dtype)" if r.get("fp8_base") else ""
        out.append("  nothing fits, with checkpoint inputs on the host (train.offload_activations) and ZeRO-3 "
                   f"optimizer and parameter offload{tried} tried too: "
                   + (f"{n} devices would fit (--world-size {n} --search)" if n else "no device count up to 1024 "
                      "fits") + "; or a shorter or smaller video")
    if r["ranked"]:
        best = r["ranked"][0]
        labels = dict(LINES)
        host = f" (host memory: {gib(best['host_memory'])} GiB a process)" if best["host_memory"] else ""
        out += ["", "best layout, worst rank (GiB): " + ", ".join(f"{labels[k]} {gib(v)}" for k, v in
                                                                  best["memory"]["lines"].items() if v)]
        if r.get("offload"):
            out.append("nothing fits without offload: these layouts keep checkpoint inputs on the host "
                       "(train.offload_activations, ckpt +host), the frozen base of each stage's last N blocks "
                       "(train.block_swap, +swapN) or use ZeRO-3 offload"
                       + ("; with a bf16 base none fits: the frozen base in fp8 (model.lora.base_dtype, +fp8) "
                          "changes the numbers (docs/lora.md#fp8-base)" if r.get("fp8_base") else ""))
        out.append(f"run it{host}: {best['command']}")
    if r["not_fitting"]:
        out += ["", "closest that do not fit (micro-batch 1):"] + [
            f"  tp={c['tp']} sp={c['sp']} pp={c['pp']} dp={c['dp']} ZeRO-{c['zero']} checkpointing "
            f"{c['recompute']}: {gib(c['memory']['total'])} GiB" for c in r["not_fitting"][:3]]
    if r["invalid"]:
        out += ["", "refused by the checker (parallel.check):"]
        for item in r["invalid"][:INVALID_SHOWN]:
            lay, problems = item["layout"], item["problems"]
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            out.append(f"  tp={lay['tp']} sp={lay['sp']}{_ring_text(lay)} pp={lay['pp']} dp={lay['dp']} ZeRO-{lay['zero']}: "
                       f"{problems[0]}{more}")
        if len(r["invalid"]) > INVALID_SHOWN:
            out.append(f"  ... {len(r['invalid']) - INVALID_SHOWN} more (--format json lists every one)")
    if "buckets" in r:
        out += render_buckets_text(r["buckets"], "the best layout")
    return "\n".join(out)


def render_markdown(r: dict) -> str:
    if r["mode"] == "plan":
        stages = r["stages"]
        rows = ["| per rank (GiB) | " + " | ".join(f"stage {s['stage']}" for s in stages) + " |",
                "|---|" + "---:|" * len(stages)]
        rows += [f"| {label} | " + " | ".join(gib(s["lines"][key]) for s in stages) + " |" for key, label in LINES
                 if key not in OPTIONAL_LINES or any(s["lines"][key] for s in stages)]
        rows.append("| **total** | " + " | ".join(f"**{gib(s['total'])}**" for s in stages) + " |")
        verdict = "fits" if r["fits"] else "does not fit"
        rows += ["", f"Worst rank {gib(r['total'])} GiB of {gib(r['device_memory'])} GiB: {verdict}."]
        if "buckets" in r:
            rows += ["", "| bucket | samples | tokens | sp pad | activations (GiB) | total (GiB) | step s |",
                     "|---|" + "---:|" * 6]
            rows += [f"| {'x'.join(map(str, b['shape']))} | {b['samples'] if b['samples'] is not None else '-'} | "
                     f"{b['tokens']:,} | {b['padded_tokens'] - b['tokens']} | {gib(b['activations'])} | "
                     f"{gib(b['total'])} | {b['step_time']:.2f} |" for b in r["buckets"]]
        return "\n".join(_header(r) + [""] + rows)
    rows = ["| rank | tp | sp | pp | dp | ZeRO | ckpt | micro-batch | GiB | step s | samples/s |", "|" + "---:|" * 11]
    for i, c in enumerate(r["ranked"]):
        t = c["step_time"]
        ckpt = c["recompute"]
        rows.append(f"| {i + 1} | {c['tp']} | {c['sp']} | {c['pp']} | {c['dp']} | {c['zero']} | {ckpt} | {c['micro_batch']} "
                    f"| {gib(c['memory']['total'])} | {t['total']:.2f} | {t['samples_per_s']:.3f} |")
    return "\n".join(_header(r) + [""] + rows)


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="python -m parallel.plan", description=__doc__.splitlines()[0])
    add_experiment_args(ap)
    add_world_size(ap, help="number of processes, every node's together, one a device (required)")
    ap.add_argument("--device-memory", required=True, help="per device, with a unit: 80GiB")
    ap.add_argument("--devices-per-node", type=int, default=8)
    # dest "device": the profile's key (DEVICES); launch.sh's --device is the accelerator kind (cpu|cuda|npu)
    ap.add_argument("--device-profile", dest="device", choices=sorted(DEVICES),
                    default="a100-80gb", help="peak FLOP/s and bandwidths of the devices")
    add_renamed(ap, "--device", "--device-profile", "device", choices=sorted(DEVICES))
    ap.add_argument("--format", choices=("text", "json", "markdown"), default="text")
    ap.add_argument("--search", action="store_true", help="try every layout of --world-size processes")
    ap.add_argument("--ds-out", default=None, help="--search: where to write the best layout's DeepSpeed "
                    "JSON when ds_configs/ has none equal (default <train.output_dir>/ds_config.planned.zero<stage>-"
                    "<precision>-<hash>.json, a name of its own); an existing file is refused")
    ap.add_argument("--top", type=int, default=10, help="layouts shown by --search")
    ap.add_argument("--margin", type=float, default=0.10, help="fragmentation margin, fraction of the rest")
    ap.add_argument("--workspace", default="1GiB", help="fixed workspace (context, kernels' scratch)")
    ap.add_argument("--utilisation", type=float, default=0.4, help="assumed fraction of peak FLOP/s")
    ap.add_argument("--png", default=None, help="write a stacked-bar chart of the breakdown to this file")
    ap.add_argument("--buckets", default=None, help="several clip shapes, 'FxHxW,...' in pixels or 'preset' (the "
                    "config's data.buckets): sized on the longest, a row per bucket; default: a directory "
                    "dataset's shapes, else the config's one")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    ap = parser()
    args = require(ap, ap.parse_args(argv), world_size="--world-size")
    try:
        if args.world_size < 1 or args.devices_per_node < 1:
            raise ConfigError("--world-size and --devices-per-node must be >= 1")
        args.device_memory = parse_bytes(args.device_memory, "--device-memory")
        args.workspace = parse_bytes(args.workspace, "--workspace")
        cfg = load_config(args.config, args.overrides)
        found = plan_buckets(cfg, args.buckets, f"--config={args.config}")
        cfg = found[0][2]                       # the longest bucket (the config's shape without buckets)
        found = found if len(found) > 1 or found[0][0] is not None else None     # a table: several shapes
        auto = dsc.fill_auto(dsc.read_ds_config(args.deepspeed_config), cfg, args.deepspeed_config)
        if auto.problems:                  # an "auto" the toolkit cannot fill; the batch keys stay, per layout
            raise ConfigError("\n".join(auto.problems))
        ds = auto.ds
        tracer = ActivationTracer(cfg, EngineSettings.from_ds(ds, 1).dtype)
        if args.search:
            if ds_out_problem(args, cfg):
                raise ConfigError(ds_out_problem(args, cfg))
            report = search_report(cfg, ds, args, tracer, found)
            status = 0 if report["ranked"] else 2
        else:
            layout, problems = check(cfg, ds, args.deepspeed_config, args.world_size)
            if problems:
                raise ConfigError("\n".join(problems))
            report = plan_report(cfg, ds, args, tracer, layout.dp_size)
            if found:
                report["buckets"] = bucket_rows(cfg, found, ds, layout.dp_size, args)
            if not report["fits"]:
                report["next_step"] = next_step(cfg, ds, args, tracer, layout.dp_size)
            status = 0 if report["fits"] else 2
    except ConfigError as e:
        return refused(ap.prog, str(e))
    if args.format == "json":
        print(json.dumps(report, indent=1))
    elif args.format == "markdown":
        print(render_markdown(report))
    else:
        print(render_plan_text(report) if report["mode"] == "plan" else render_search_text(report))
    if args.png:
        from parallel.plan.render import draw
        draw(report, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
