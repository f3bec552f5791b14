"""Wan 2.2 A14B with both experts: an expert no sample of the global batch chose is left out of the update
(parallel/train/optim.py SkipsIdleExperts, parallel/train/experts.py). From a tiny random release
(tests/unit/test_wan22_released.py), EmaAdamW with weight decay 0.1, four steps: high-noise samples only (H),
H, a batch of both experts (M), H.

- after H, H the low-noise expert is bit for bit its released weights, and the high-noise expert equals a
  one-expert run (`model.experts.train=high_noise`) given the same two batches: exactly at one process,
  at fp32 tolerance at a split layout;
- the last H leaves the low-noise expert's weights, Adam moments, EMA and step count (where the client
  optimizer holds them) bit for bit as M left them, while the high-noise expert moves;
- the layout-free checkpoint copy (parallel/train/relayout.py) records each expert's step count, and at one
  process the copy of step 2 (the low-noise expert never stepped) resumed gives steps 3 and 4 bit for bit.

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

from tests.dist_utils import run_ranks
from tests.train_utils import experiment, fp32_config
from tests.unit.test_wan22_released import overrides, write_release

PRESET = "debug-wan22"
LAYOUTS = [(2, 2, 1, 1, 1), (1, 1, 2, 2, 1)]              # (tp, pp, sp, dp, ZeRO stage)
IDLE = ".experts.1."
LORA_LAYOUT = (2, 2, 1, 1, 1)           # model.lora on both experts: tp 2 x pp 2, ZeRO-1


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
    from parallel.build import expert_of_parameter
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
    out["steps"] = [float(opt.state[p]["step"]) for g in opt.param_groups if g.get("expert") == 1
                    for p in g["params"] if "step" in opt.state[p]]
    return out


def _run(tp, pp, sp, dp, stage, folder, world_size):
    """Snapshots before training, after H H, after M and after the last H; and a one-expert run's after H H."""
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train import relayout
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches

    ctx = ParallelContext.build(ParallelDims(tp_size=tp, sp_size=sp, pp_size=pp, dp_size=dp))
    cfg = {train: experiment(tp, pp, dp, overrides(folder, f"model.experts.train={train}"), sp, PRESET)
           for train in ("both", "high_noise")}
    seed_all(0)
    trainer = build_trainer(cfg["both"], _ds(stage), ctx)
    high, mixed = training_batches(cfg["high_noise"], ctx), training_batches(cfg["both"], ctx)
    out = {"init": _snapshot(trainer, ctx, cfg["both"], held=())}
    saved = Path(folder).parent / f"layout_free_{tp}{pp}{sp}{dp}{stage}" / "step2"
    for step, batches in enumerate((high, high, mixed, high), 1):
        trainer.train_step(batches)
        if step >= 2:
            out[step] = _snapshot(trainer, ctx, cfg["both"], held=(0,) if step == 2 else (0, 1))
            part = relayout.collect(trainer)
            out[step]["expert_steps"] = part["expert_steps"]
        if step == 2:
            relayout.write(part, saved, step, trainer.layout())
    if world_size == 1:           # the layout-free copy of step 2 resumed: M and H as above, bit for bit
        again = build_trainer(cfg["both"], _ds(stage), ctx, init_from=False)
        assert relayout.load(again, saved) == 2
        again.train_step(training_batches(cfg["both"], ctx))
        again.train_step(training_batches(cfg["high_noise"], ctx, start_step=2))
        out["resumed"] = _snapshot(again, ctx, cfg["both"])
        one = build_trainer(cfg["high_noise"], _ds(stage), ctx)
        high = training_batches(cfg["high_noise"], ctx)
        for _ in range(2):
            one.train_step(high)
        out["one_expert"] = _snapshot(one, ctx, cfg["high_noise"], held=(None,))
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
            merged = out.setdefault(when, {"steps": snap["steps"], "expert_steps": snap.get("expert_steps")})
            for key in ("weights", "exp_avg", "exp_avg_sq", "ema"):
                merged.setdefault(key, {}).update(snap[key])
    return out


def _part(tensors: dict, marker: str) -> dict:
    """The tensors of one expert, named as the one-expert model names them (experts.0 dropped)."""
    return {n.replace(marker[1:], ""): t for n, t in tensors.items() if marker in n}


def _assert_idle_expert_kept(run: dict, reference: dict, label: str, exact: bool):
    bitwise = dict(rtol=0, atol=0, equal_nan=True)
    # H H: the low-noise expert is its released weights, untouched; no state.
    for name, want in _part(reference["init"]["weights"], IDLE).items():
        torch.testing.assert_close(_part(run[2]["weights"], IDLE)[name], want, **bitwise, msg=f"{label} {name}")
    assert all(t.isnan().all() for t in _part(run[2]["exp_avg"], IDLE).values()), label
    # ... and the high-noise expert is the one-expert run's.
    one, close = reference["one_expert"], (bitwise if exact else {})
    for key in ("weights", "exp_avg", "exp_avg_sq", "ema"):
        ours = _part(run[2][key], ".experts.0.")
        assert ours.keys() == one[key].keys(), (label, key)
        for name, want in one[key].items():
            torch.testing.assert_close(ours[name], want, **close, msg=lambda m: f"{label} {key} {name}: {m}")
    # M trained both; the last H left the low-noise expert's weights and states as M left them.
    moved = lambda a, b, marker: all(not torch.equal(a[n], b[n]) for n in a if marker in n and "norm" not in n)
    assert moved(run[2]["weights"], run[3]["weights"], IDLE), label
    assert moved(run[3]["weights"], run[4]["weights"], ".experts.0."), label
    for key in ("weights", "exp_avg", "exp_avg_sq", "ema"):
        for name, want in _part(run[3][key], IDLE).items():
            assert not want.isnan().any(), (label, key, name)
            torch.testing.assert_close(_part(run[4][key], IDLE)[name], want, **bitwise,
                                       msg=lambda m: f"{label} {key} {name}: {m}")
    assert run[3]["steps"] == run[4]["steps"], (label, run[3]["steps"], run[4]["steps"])
    # The layout-free copy records each expert's step count.
    assert [run[s]["expert_steps"] for s in (2, 3, 4)] == [{"0": 2, "1": 0}, {"0": 3, "1": 1}, {"0": 4, "1": 1}], label


def test_an_expert_without_samples_is_left_out_of_the_update(tmp_path):
    folder, _ = write_release(tmp_path / "release")
    one = run_ranks(_rank, 1, str(folder), [(1, 1, 1, 1, 0)], (1, 1, 1, 1, 0))[0]
    reference = one[(1, 1, 1, 1, 0)]
    _assert_idle_adapters_kept(one["lora"], "LoRA one process")
    assert set(reference[3]["steps"]) == {1.0} == set(reference[4]["steps"])     # each parameter stepped once
    _assert_idle_expert_kept(reference, reference, "one process", exact=True)
    for key in ("weights", "exp_avg", "exp_avg_sq", "ema"):
        for name, want in reference[4][key].items():
            torch.testing.assert_close(reference["resumed"][key][name], want, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m: f"resumed {key} {name}: {m}")
    assert reference["resumed"]["steps"] == reference[4]["steps"]
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
        assert run[4]["steps"] == ([1.0, 1.0] if layout[-1] < 3 else []), (layout, run[4]["steps"])
        _assert_idle_expert_kept(run, reference, f"tp pp sp dp zero {layout}", exact=False)
        for name, want in reference[4]["weights"].items():
            torch.testing.assert_close(run[4]["weights"][name], want, msg=lambda m: f"{layout} {name}: {m}")
