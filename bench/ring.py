"""Ring attention and Ulysses x ring against Ulysses alone at the same sp, in real runs.

The mid model (bench/overhead.py MID: 8 heads) at sp 4 = Ulysses 4, Ulysses 2 x ring 2 and ring 4 (4 ranks
each, fp32, no activation checkpointing): the median step time and the bytes one rank moves per step, counted
by wrapping torch.distributed's collectives and sends (bench/comm.py), against the planner's counts:

    Ulysses (u ranks)   8 all-to-alls of b x s/sp x h per attention (q, k, v, out forward; their gradients backward)
    ring (r ranks)      forward r - 1 key/value chunks, backward r - 1 again and r fp32 dK/dV accumulators
                        (parallel.plan.search.ring_traffic), per attention
    both                the gradient all-reduce over the sp ranks (1 x parameters: they are data-parallel ranks
                        to DeepSpeed)

Step times are ratios to Ulysses 4 from one run, on a shared CPU: the ring's overlap of transfer and compute
needs a device whose kernels run beside the transfers to show.
"""
from __future__ import annotations


SP = 4
SPLITS = {"Ulysses 4": 1, "Ulysses 2 x ring 2": 2, "ring 4": 4}      # name -> ring size


def predicted(overrides: list[str], ring: int) -> dict:
    """The planner's bytes one rank moves per step at sp 4 with this ring size: all-to-alls, ring sends, the
    gradient all-reduce."""
    import torch

    from models.registry import family
    from parallel.model.build import layer_specs
    from parallel.experiment.config import load_config
    from parallel.distributed.pipeline import SequentialDiT
    from parallel.distributed.topology import ParallelContext
    from parallel.plan.search import ring_traffic
    from parallel.plan.trace import ActivationTracer
    from parallel.experiment.units import count_parameters

    cfg = load_config("debug", [*overrides, f"parallel.sp_size={SP}", f"parallel.ring_size={ring}"])
    m, t = cfg.model, cfg.train
    with torch.device("meta"):
        params = count_parameters(SequentialDiT(layer_specs(cfg, ParallelContext.single())))
    chunk = ActivationTracer(cfg, torch.float32).trace("block", 1, t.micro_batch_size, SP).input_bytes
    attentions = m.num_layers * t.grad_accum_steps * family(m).costs.attentions_per_layer
    ulysses = SP // ring
    fwd, bwd = ring_traffic(chunk, ring, 4) if ring > 1 else (0, 0)
    return {"all_to_all": 8 * chunk * attentions if ulysses > 1 else 0, "ring": (fwd + bwd) * attentions,
            "all_reduce": params * 4}


def measure(overrides: list[str], steps: int) -> list[dict]:
    from bench.comm import counted_rank
    from bench.ranks import run_ranks

    rows = []
    for name, ring in SPLITS.items():
        dims = {"tp_size": 1, "pp_size": 1, "dp_size": 1, "sp_size": SP, "ring_size": ring}
        per_rank = run_ranks(counted_rank, SP, dims, overrides, 0, None, steps, timeout=900)
        moved = per_rank[0]["bytes"]
        want = predicted(overrides, ring)
        got = {"all_to_all": moved.get("all_to_all_single", 0),
               "ring": moved.get("isend", 0) + moved.get("send", 0),
               "all_reduce": moved.get("all_reduce", 0)}
        rows.append({"split": name, "ring": ring, "median_step_s": per_rank[0]["median_step_s"],
                     "measured": got, "planner": want,
                     "ratio": {k: got[k] / want[k] for k in want if want[k]}})
    base = rows[0]["median_step_s"]
    for r in rows:
        r["step_time_vs_ulysses"] = r["median_step_s"] / base
    return rows


def markdown(rows: list[dict], stamp: dict | None = None) -> list[str]:
    run = f"`python -m bench --only ring --steps {stamp['steps']}`, {stamp['date']}, {stamp['machine']}: " if stamp else ""
    lines = ["", f"## Ring attention (sp {SP}, the mid model, fp32, 4 ranks)", "",
             f"{run}medians of the steps after 3 warm-up steps; bytes one rank moves per step.", "",
             "| split | step time vs Ulysses 4 | all-to-all bytes (measured / planner) | ring bytes (measured / planner) |",
             "|---|---|---|---|"]
    for r in rows:
        cells = [f"{r['measured'][k]:,} / {r['planner'][k]:,}" if r["planner"][k] else "0 / 0"
                 for k in ("all_to_all", "ring")]
        lines.append(f"| {r['split']} | {r['step_time_vs_ulysses']:.2f}x | {cells[0]} | {cells[1]} |")
    return lines
