"""Wan 2.2 A14B with both experts: an expert no sample of the global batch chose is left out of the update
(parallel/train/optim.py SkipsIdleExperts, parallel/train/experts.py) and its learning rate follows the schedule
at its own update count (parallel/train/schedule.py ExpertLambdaLR). From a tiny random release
(tests/unit/test_wan22_released.py), EmaAdamW with weight decay 0.1, warmup over 3 steps then a cosine decay
(train.warmup_steps=3, decay_steps=4, min_lr), four steps: high-noise samples only (H), low-noise only (L), H, a
batch of both experts (M).

- after H the low-noise expert is bit for bit its released weights, with no state;
- L leaves the high-noise expert's weights, Adam moments, EMA and step count bit for bit as H left them, and
  the low-noise expert, which sat out a step, equals a one-expert run (`model.experts.train=low_noise`) given
  L: weights, moments and EMA, the lr of its first step (train.lr / 3, not the global step's 2 train.lr / 3)
  exactly at one process, at fp32 tolerance at a split layout;
- the second H leaves the low-noise expert as L left it, and the high-noise expert equals a one-expert run
  (`high_noise`) given the same two H batches, at its second step's lr (2 train.lr / 3, not the third step's);
- each step's lr per expert is train.lr * f(the expert's own update count), in every layout;
- the layout-free checkpoint copy (parallel/checkpoints/relayout.py) records each expert's step count (and the
  schedule's), and at one process the copy of step 1 (the low-noise expert never stepped) resumed gives steps
  2 to 4 bit for bit, at the same lrs.

The same spawns train LoRA adapters on both experts (model.lora rank 4) for H, M, H at one process and at tp 2 x
pp 2 (ZeRO-1): the base never moves, the low-noise expert's adapters stay bit for bit through each H (its groups'
step counts too) and move in M, and every step's weights equal one process's (fp32 tolerance).

One process (ZeRO-0), then tp 2 x pp 2 (the pipeline engine, ZeRO-1) and sp 2 x dp 2 (ZeRO-1) in one spawn
of 4 gloo ranks, whose four steps (the replicas' micro-batches choosing different experts in M) equal one
process's. ZeRO-2 and 3 with both experts are refused by the checker (tests/unit/test_wan22.py): at sp 2 x dp 2
ZeRO-2 ends this test's four steps with other weights than one process (patch_embedding off by 7e-3), and
ZeRO-3 fails in the forward (an idle expert's weights are not gathered).
"""
from pathlib import Path

import torch

from parallel.train.schedule import lr_factor
from tests.dist_utils import run_ranks
from tests.train_utils import experiment, fp32_config
from tests.helpers.wan22_released import overrides, write_release

PRESET = "debug-wan22"
LAYOUTS = [(2, 2, 1, 1, 1), (1, 1, 2, 2, 1)]              # (tp, pp, sp, dp, ZeRO stage)
IDLE, HIGH = ".experts.1.", ".experts.0."
LORA_LAYOUT = (2, 2, 1, 1, 1)           # model.lora on both experts: tp 2 x pp 2, ZeRO-1
# f(n) = (n + 1) / 3 for n < 3, then a cosine to min_lr: an expert's count and the global step give other lrs
SCHEDULE = ("train.warmup_steps=3", "train.decay_steps=4", "train.min_lr=3.0e-4")


def _ds(stage: int) -> dict:
    ds = fp32_config(stage, optimizer="EmaAdamW")
    ds["optimizer"]["params"].update(eps=1e-6, weight_decay=0.1)
    return ds


def _snapshot(trainer, ctx, cfg, held=(0, 1)) -> dict:
    """Full weights, Adam moments and EMA of this rank's parameters by canonical name (NaN for the experts not in
    `held`, those not stepped yet: ZeRO reads a state over the data-parallel ranks, a collective, which fails
    where the state does not exist); the step counts of the low-noise expert's groups (ZeRO-0: per parameter;
    1/2: per flat partition; ZeRO-3 holds its partitions outside its step: none)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    from parallel.distributed.deepspeed.optimizer import relink_optimizer_fragments, zero_holds_master
    from parallel.distributed.deepspeed.zero3 import full_shape
    from parallel.model.build import expert_of_parameter
    from parallel.weights.gather import full_state

    engine, opt, n = trainer.engine, trainer.optimizer, cfg.model.num_layers
    relink_optimizer_fragments(engine.optimizer)

    expert = {id(p): expert_of_parameter(n) for n, p in engine.module.named_parameters()}

    def state(key):
        def value(p):
            s = None
            if expert[id(p)] in held:
                s = safe_get_full_optimizer_state(p, key) if zero_holds_master(p) else opt.state[p].get(key)
            return torch.full(tuple(full_shape(p)), float("nan")) if s is None else s.reshape(full_shape(p))
        return value

    out = {"weights": full_state(engine.module, ctx, n, zero3=engine.zero_optimization_stage() == 3)}
    for key in ("exp_avg", "exp_avg_sq", "ema"):
        out[key] = full_state(engine.module, ctx, n, state(key))
    out["steps"] = {e: [float(opt.state[p]["step"]) for g in opt.param_groups if g.get("expert") == e
                        for p in g["params"] if "step" in opt.state[p]] for e in (None, 0, 1)}
    return out


def _lrs(trainer) -> dict:
    """The lr each expert's groups (None: a one-expert model's) take in the coming update."""
    out = {}
    for g in trainer.optimizer.param_groups:
        assert out.setdefault(g.get("expert"), g["lr"]) == g["lr"], "one lr per expert"
    return out


def _run(tp, pp, sp, dp, stage, folder, world_size):
    """Snapshots before training and after each of H, L, H, M, with the lrs each step ran at; at one process also
    the step-1 copy resumed, and one-expert runs' snapshots after H, H and after L."""
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.checkpoints import relayout
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches

    ctx = ParallelContext.build(ParallelDims(tp_size=tp, sp_size=sp, pp_size=pp, dp_size=dp))
    cfg = {train: experiment(tp, pp, dp, overrides(folder, f"model.experts.train={train}", *SCHEDULE), sp, PRESET)
           for train in ("both", "high_noise", "low_noise")}
    seed_all(0)
    trainer = build_trainer(cfg["both"], _ds(stage), ctx)
    high, low, mixed = (training_batches(cfg[t], ctx) for t in ("high_noise", "low_noise", "both"))
    out = {"init": _snapshot(trainer, ctx, cfg["both"], held=()), "lrs": [], "step_lrs": []}
    saved = Path(folder).parent / f"layout_free_{tp}{pp}{sp}{dp}{stage}" / "step1"
    for step, batches in enumerate((high, low, high, mixed), 1):
        out["lrs"].append(_lrs(trainer))
        out["step_lrs"].append(trainer.train_step(batches).expert_lrs)      # what metrics.jsonl logs
        out[step] = _snapshot(trainer, ctx, cfg["both"], held=(0,) if step == 1 else (0, 1))
        part = relayout.collect(trainer)
        out[step]["expert_steps"] = part["expert_steps"]
        out[step]["schedule_steps"] = part["schedule"]["expert_steps"]
        if step == 1:
            relayout.write(part, saved, step, trainer.layout())
    if world_size == 1:           # the layout-free copy of step 1 resumed: L, H and M as above, bit for bit
        again = build_trainer(cfg["both"], _ds(stage), ctx, init_from=False)
        assert relayout.load(again, saved) == 1
        out["resumed_lrs"] = []
        for batches in (training_batches(cfg["low_noise"], ctx), training_batches(cfg["high_noise"], ctx, start_step=1),
                        training_batches(cfg["both"], ctx)):
            out["resumed_lrs"].append(_lrs(again))
            again.train_step(batches)
        out["resumed"] = _snapshot(again, ctx, cfg["both"])
        for train, steps in (("high_noise", 2), ("low_noise", 1)):
            one = build_trainer(cfg[train], _ds(stage), ctx)
            batches, lrs = training_batches(cfg[train], ctx), []
            for _ in range(steps):
                lrs.append(_lrs(one)[None])
                assert one.train_step(batches).expert_lrs is None
            out[train] = {**_snapshot(one, ctx, cfg[train], held=(None,)), "lrs": lrs}
    return out


def _lora_run(tp, pp, sp, dp, stage, folder):
    """model.lora on both experts, three steps H, M, H: the full weights (base and adapters) before and after each,
    and the low-noise expert's groups' step counts."""
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches
    from parallel.weights.gather import full_state

    ctx = ParallelContext.build(ParallelDims(tp_size=tp, sp_size=sp, pp_size=pp, dp_size=dp))
    cfg = {train: experiment(tp, pp, dp, overrides(folder, f"model.experts.train={train}", "model.lora.rank=4"), sp,
                             PRESET) for train in ("both", "high_noise")}
    seed_all(0)
    trainer = build_trainer(cfg["both"], _ds(stage), ctx)
    high, mixed = training_batches(cfg["high_noise"], ctx), training_batches(cfg["both"], ctx)
    module, n = trainer.engine.module, cfg["both"].model.num_layers
    out = [{"weights": full_state(module, ctx, n)}]
    for batches in (high, mixed, high):
        trainer.train_step(batches)
        out.append({"weights": full_state(module, ctx, n),
                    "steps": [float(trainer.optimizer.state[p]["step"]) for g in trainer.optimizer.param_groups
                              if g.get("expert") == 1 for p in g["params"] if "step" in trainer.optimizer.state[p]]})
    return out


def _rank(rank, world_size, folder, layouts, lora_layout=None):
    import deepspeed

    from parallel.distributed import accelerator
    deepspeed.init_distributed(dist_backend=accelerator.backend())
    out = {layout: _run(*layout, folder, world_size) for layout in layouts}
    if lora_layout is not None:
        out["lora"] = _lora_run(*lora_layout, folder)
    return out


def _assert_idle_adapters_kept(run: list, label: str):
    """LoRA on both experts: the base never moves; H moves the high-noise expert's adapters only; M both; the last
    H leaves the low-noise expert's adapters (and its groups' step counts) as M left them."""
    adapter = lambda name: name.rsplit(".", 1)[1] in ("lora_A", "lora_B")
    init = run[0]["weights"]
    assert any(adapter(k) and IDLE in k for k in init) and any(adapter(k) and ".experts.0." in k for k in init), label
    for name, want in init.items():
        if not adapter(name):
            assert torch.equal(run[3]["weights"][name], want), (label, name)
    for before, after, idle in ((0, 1, IDLE), (2, 3, IDLE)):
        for name in init:
            if adapter(name) and idle in name:
                assert torch.equal(run[after]["weights"][name], run[before]["weights"][name]), (label, after, name)
    moved = lambda a, b, marker: all(not torch.equal(run[a]["weights"][k], run[b]["weights"][k]) for k in init
                                     if adapter(k) and k.endswith("lora_B") and marker in k)
    assert moved(0, 1, ".experts.0.") and moved(1, 2, IDLE) and moved(2, 3, ".experts.0."), label
    assert run[2]["steps"] == run[3]["steps"] and run[2]["steps"], (label, run[2]["steps"], run[3]["steps"])


def _merged(results, layout) -> dict:
    out = {}
    for r in results:
        for when, snap in r[layout].items():
            if when in ("lrs", "step_lrs"):
                out[when] = snap
                continue
            merged = out.setdefault(when, {k: snap.get(k) for k in ("steps", "expert_steps", "schedule_steps")})
            for key in ("weights", "exp_avg", "exp_avg_sq", "ema"):
                merged.setdefault(key, {}).update(snap[key])
    return out


def _part(tensors: dict, marker: str) -> dict:
    """The tensors of one expert, named as the one-expert model names them (experts.0 dropped)."""
    return {n.replace(marker[1:], ""): t for n, t in tensors.items() if marker in n}


def _assert_kept(run: dict, before: int, after: int, marker: str, label: str):
    """Expert `marker`'s weights, Adam moments, EMA and step counts bit for bit the same after step `after` as
    after step `before`."""
    for key in ("weights", "exp_avg", "exp_avg_sq", "ema"):
        for name, want in _part(run[before][key], marker).items():
            assert not want.isnan().any(), (label, key, name)
            torch.testing.assert_close(_part(run[after][key], marker)[name], want, rtol=0, atol=0,
                                       msg=lambda m: f"{label} {key} {name}: {m}")
    e = int(marker[-2])
    assert run[before]["steps"][e] == run[after]["steps"][e] and run[after]["steps"][e], (label, before, after)


def _assert_one_expert(ours: dict, one: dict, marker: str, label: str, exact: bool):
    """Expert `marker` of the two-expert model equals the one-expert model (weights, moments, EMA)."""
    close = dict(rtol=0, atol=0) if exact else {}
    for key in ("weights", "exp_avg", "exp_avg_sq", "ema"):
        part = _part(ours[key], marker)
        assert part.keys() == one[key].keys(), (label, key)
        for name, want in one[key].items():
            torch.testing.assert_close(part[name], want, **close, msg=lambda m: f"{label} {key} {name}: {m}")


def _assert_idle_expert_kept(run: dict, reference: dict, train, label: str, exact: bool):
    # H: the low-noise expert is its released weights, untouched; no state.
    for name, want in _part(reference["init"]["weights"], IDLE).items():
        torch.testing.assert_close(_part(run[1]["weights"], IDLE)[name], want, rtol=0, atol=0, msg=f"{label} {name}")
    assert all(t.isnan().all() for t in _part(run[1]["exp_avg"], IDLE).values()), label
    # L: the high-noise expert kept; the low-noise one, after sitting out H, is the one-expert run's after L.
    _assert_kept(run, 1, 2, HIGH, label)
    _assert_one_expert(run[2], reference["low_noise"], IDLE, f"{label} L", exact)
    # H: the low-noise expert kept; the high-noise one, after sitting out L, is the one-expert run's after H, H.
    _assert_kept(run, 2, 3, IDLE, label)
    _assert_one_expert(run[3], reference["high_noise"], HIGH, f"{label} H L H", exact)
    # M trains both.
    moved = lambda a, b, marker: all(not torch.equal(a[n], b[n]) for n in a if marker in n and "norm" not in n)
    assert moved(run[3]["weights"], run[4]["weights"], IDLE), label
    assert moved(run[3]["weights"], run[4]["weights"], HIGH), label
    # Each expert's lr at its own update count n: train.lr * f(n), the one-expert runs' lrs at their steps.
    counts = [{"0": 0, "1": 0}] + [run[s]["expert_steps"] for s in (1, 2, 3)]
    assert run["lrs"] == [{e: train.lr * lr_factor(n[str(e)], train) for e in (0, 1)} for n in counts], label
    assert [run["lrs"][s][0] for s in (0, 2)] == reference["high_noise"]["lrs"], label
    assert run["step_lrs"] == [[lrs[0], lrs[1]] for lrs in run["lrs"]], label
    assert [run["lrs"][1][1]] == reference["low_noise"]["lrs"], label
    # The layout-free copy records each expert's step count, and the schedule's the same.
    steps = [{"0": 1, "1": 0}, {"0": 1, "1": 1}, {"0": 2, "1": 1}, {"0": 3, "1": 2}]
    assert [run[s]["expert_steps"] for s in (1, 2, 3, 4)] == steps, label
    assert [run[s]["schedule_steps"] for s in (1, 2, 3, 4)] == [[n["0"], n["1"]] for n in steps], label


def test_an_expert_without_samples_is_left_out_of_the_update(tmp_path):
    folder, _ = write_release(tmp_path / "release")
    train = experiment(1, 1, 1, overrides(folder, "model.experts.train=both", *SCHEDULE), 1, PRESET).train
    one = run_ranks(_rank, 1, str(folder), [(1, 1, 1, 1, 0)], (1, 1, 1, 1, 0))[0]
    reference = one[(1, 1, 1, 1, 0)]
    _assert_idle_adapters_kept(one["lora"], "LoRA one process")
    assert set(reference[2]["steps"][1]) == {1.0} == set(reference[3]["steps"][1])   # each parameter stepped once
    _assert_idle_expert_kept(reference, reference, train, "one process", exact=True)
    for key in ("weights", "exp_avg", "exp_avg_sq", "ema"):
        for name, want in reference[4][key].items():
            torch.testing.assert_close(reference["resumed"][key][name], want, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m: f"resumed {key} {name}: {m}")
    assert reference["resumed"]["steps"] == reference[4]["steps"]
    assert reference["resumed_lrs"] == reference["lrs"][1:]
    results = run_ranks(_rank, 4, str(folder), LAYOUTS, LORA_LAYOUT)
    lora = [{"weights": {k: v for r in results for k, v in r["lora"][i]["weights"].items()},
             "steps": results[0]["lora"][i].get("steps")} for i in range(4)]
    _assert_idle_adapters_kept(lora, f"LoRA {LORA_LAYOUT}")
    for i in range(1, 4):              # each step of the split layout: one process's weights, adapters and base
        for name, want in one["lora"][i]["weights"].items():
            torch.testing.assert_close(lora[i]["weights"][name], want, msg=lambda m: f"LoRA step {i} {name}: {m}")
    for layout in LAYOUTS:
        run = _merged(results, layout)
        # ZeRO-1: the flat partitions of its two groups; ZeRO-3 holds them outside its step
        assert run[4]["steps"][1] == [2.0, 2.0], (layout, run[4]["steps"])
        _assert_idle_expert_kept(run, reference, train, f"tp pp sp dp zero {layout}", exact=False)
        for name, want in reference[4]["weights"].items():
            torch.testing.assert_close(run[4]["weights"][name], want, msg=lambda m: f"{layout} {name}: {m}")
