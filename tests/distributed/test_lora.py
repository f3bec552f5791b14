"""LoRA (parallel/model/lora.py; the adapters in parallel/distributed/layers.py) in one spawn of 4 gloo ranks and one of 1.

* Layers: a fused Column (q, k, v; adapters on q and v) and a Row layer with adapters at tp 2 against tp 1:
  outputs and the gradients of x, A and B (fp32); the all-reduces are the ones the layers issue without
  adapters (Row's forward, Column's backward), r (or 2 r) elements wider per token.
* diffusers + peft: a random adapter (A and B non-zero, rank 4, alpha 8) in diffusers' file format on q and v
  of the fused QKV, the attention output (row-parallel) and the FFN input (column-parallel), read through
  model.lora.init_from at (tp, pp) = (1, 1) and (2, 2): the prediction equals `CogVideoXTransformer3DModel`
  with the file loaded by `load_lora_adapter` (peft), fp32. Exported from tp 2 x pp 2, `--format
  diffusers-lora` gives the file's tensors bit for bit; `--merge-lora` a folder predicting the adapted output.
* Training: 3 steps of the `debug` DiT with rank-4 adapters on q, k, v and the attention output at tp 2 x pp 2
  (ZeRO-0) and sp 2 x dp 2 (ZeRO-2), fp32: losses on every rank and final weights equal one process
  (tests/train_utils.assert_matches); the base is bit for bit unchanged; the optimizer holds adapters only;
  the planner's parameter + gradient + optimizer bytes equal what the engine holds in step 2 within 1%. The
  one-process run also stops after step 2, checkpoints, and resumes into a model of another seed: same losses.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from diffusers import CogVideoXTransformer3DModel
from safetensors import safe_open
from safetensors.torch import save_file

from parallel.experiment.config import load_config
from parallel.distributed.comm import count_comm, gather_shards
from parallel.distributed.layers import ColumnParallelLinear, RowParallelLinear
from parallel.distributed.topology import ParallelContext, ParallelDims
from parallel.model.lora import LORA_WEIGHTS_NAME
from parallel.plan.memory import EngineSettings, plan_memory
from parallel.plan.trace import ActivationTracer
from tests.dist_utils import run_ranks
from tests.helpers.released_weights_layouts import _inputs, diffusers_forward
from tests.train_utils import assert_matches, experiment, fp32_config
from tests.helpers.plan import STATES
from tests.helpers.released_weights import overrides, released  # noqa: F401  (fixture)

B, S, H, R = 2, 5, 16, 4
PARTS = [0, 2]                       # adapters on q and v of the fused [q; k; v]


def _pair(ctx):
    torch.manual_seed(3)
    col = ColumnParallelLinear(H, [H, H, H], ctx=ctx)
    row = RowParallelLinear(3 * H, H, ctx=ctx, input_is_parallel=False)
    col.add_lora(R, 2.0 * R, PARTS, torch.Generator().manual_seed(5))
    row.add_lora(R, 2.0 * R, torch.Generator().manual_seed(6))
    g = torch.Generator().manual_seed(7)           # non-zero B (peft starts at 0), the same full B everywhere
    for layer, dim in ((col, 0), (row, None)):
        full = torch.randn(len(PARTS) * H if dim == 0 else H, R, generator=g)
        if dim == 0:                                # this rank's rows of each adapted part
            full = torch.cat([p.chunk(ctx.tp_size)[ctx.tp_rank] for p in full.chunk(len(PARTS))])
        layer.lora_B.data.copy_(full)
    return col, row


def _run(ctx):
    col, row = _pair(ctx)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(B, S, H, generator=g).requires_grad_()
    z = torch.randn(B, S, 3 * H, generator=g).requires_grad_()       # Row's full input (it scatters it)
    dq, dy = torch.randn(B, S, 3 * H, generator=g), torch.randn(B, S, H, generator=g)
    full = lambda p, dim, parts=None: gather_shards(p, ctx, dim, parts) if ctx.tp_size > 1 else p
    dq_local = torch.cat([p.chunk(ctx.tp_size, -1)[ctx.tp_rank] for p in dq.chunk(3, -1)], -1)
    with count_comm() as comm:
        q, y = col(x), row(z)
        q.backward(dq_local)
        y.backward(dy)
    grads = {"col.A": col.lora_A.grad, "row.B": row.lora_B.grad,
             "col.B": full(col.lora_B.grad, 0, col.lora_B.tp_parts), "row.A": full(row.lora_A.grad, 1)}
    calls = [c for c in comm.calls if c[0] == "all_reduce"]
    return {"q": full(q.detach(), 2, [H // ctx.tp_size] * 3), "y": y.detach(), "x.grad": x.grad, "z.grad": z.grad,
            **grads, "calls": calls}


def _layers(world_size):
    """The layer pair at tp 1, and at tp 2 (x dp 2 in the 4 ranks)."""
    ctx = ParallelContext.build(ParallelDims(tp_size=2, pp_size=1, dp_size=world_size // 2))
    return {"tp1": _run(ParallelContext.single()), "tp2": _run(ctx)}


POS, RANK, ALPHA = "sincos", 4, 8.0
TARGETS = ["to_q", "to_v", "to_out.0", "ff.net.0.proj"]
LAYOUTS = [(1, 1), (2, 2)]


def adapter_file(model, folder: Path) -> Path:
    """Random A [r, in] and B [out, r] for every targeted module, with the peft config diffusers writes."""
    from parallel.model.lora import peft_metadata
    g, tensors = torch.Generator().manual_seed(11), {}
    for name, module in model.named_modules():
        if any(name.endswith("." + t) for t in TARGETS):
            out_f, in_f = module.weight.shape
            tensors[f"transformer.{name}.lora_A.weight"] = torch.randn(RANK, in_f, generator=g) / in_f ** 0.5
            tensors[f"transformer.{name}.lora_B.weight"] = 0.5 * torch.randn(out_f, RANK, generator=g)
    cfg = load_config("debug", _lora(overrides(POS, "unused"), "unused"))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / LORA_WEIGHTS_NAME), metadata=peft_metadata(cfg.model))
    return folder / LORA_WEIGHTS_NAME


def _lora(extra, path) -> list[str]:
    return extra + [f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", f"model.lora.targets={TARGETS}",
                    f"model.lora.init_from={path}"]


def _diffusers(world_size, folder, lora_path, export_dir):
    import types

    import deepspeed

    from parallel.model.build import build_model
    from parallel.distributed import accelerator
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.model.lora import load_lora
    from parallel.validation.validate import StageForward
    from parallel.weights.diffusers import load_released
    from parallel.weights.diffusers_export import export_diffusers
    from parallel.weights.lora_export import export_lora

    deepspeed.init_distributed(dist_backend=accelerator.backend())
    inputs, out = _inputs(), {}
    for tp, pp in LAYOUTS:
        cfg = load_config("debug", _lora(overrides(POS, folder), lora_path) + [f"parallel.tp_size={tp}",
                                                                               f"parallel.pp_size={pp}"])
        ctx = ParallelContext.build(ParallelDims(tp_size=tp, pp_size=pp, dp_size=world_size // (tp * pp)))
        model = build_model(cfg, {}, ctx)
        load_released(model, ctx, cfg.model, folder)
        load_lora(model, ctx, cfg.model, cfg.model.lora.init_from)
        forward = StageForward(types.SimpleNamespace(module=model, device=torch.device("cpu")), ctx)
        out[(tp, pp)] = forward.predict(inputs, inputs[0])
    export_lora(model, ctx, cfg, Path(export_dir) / "lora")
    export_diffusers(model, ctx, cfg, Path(export_dir) / "merged", merge_lora=True)
    return out


LORA = ["model.lora.rank=4", "model.lora.alpha=8"]
STEPS = 3
# (name, tp, pp, dp, sp, ZeRO stage)
CASES = [("tp2 x pp2 zero0", 2, 2, 1, 1, 0), ("sp2 x dp2 zero2", 1, 1, 2, 2, 2)]


def _train(cfg, ds, ctx):
    from parallel.distributed.replicas import replica_mismatches
    from parallel.distributed.seed import seed_all
    from parallel.model.lora import is_adapter
    from parallel.train.probe import StepProbe
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches
    from parallel.weights.gather import full_state

    seed_all(cfg.train.seed)
    trainer = build_trainer(cfg, ds, ctx)
    module, n = trainer.engine.module, cfg.model.num_layers
    before = {k: v for k, v in full_state(module, ctx, n).items() if not is_adapter(k)}
    batches, losses, probe = training_batches(cfg, ctx), [], None
    for step in range(1, STEPS + 1):
        if step == 2:
            with StepProbe(trainer.engine) as measuring:
                losses.append(trainer.train_step(batches).loss)
            probe = measuring.result
        else:
            losses.append(trainer.train_step(batches).loss)
    names = {id(p): name for name, p in module.named_parameters()}
    stepped = [names.get(id(p), "<flat partition>") for g in trainer.optimizer.param_groups for p in g["params"]]
    moments = sum(s["exp_avg"].numel() for s in trainer.optimizer.state.values())
    adapters = sum(p.numel() for name, p in module.named_parameters() if is_adapter(name))
    return {"losses": losses, "state": full_state(module, ctx, n), "before": before, "probe": probe.states,
            "stage": ctx.pp_rank, "stepped": stepped, "moments": moments, "adapters": adapters,
            "trainable": sorted(name for name, p in module.named_parameters() if p.requires_grad),
            "replica_mismatches": replica_mismatches(module, ctx)}


def _trainings(cases):
    from parallel.distributed.topology import ParallelContext, ParallelDims
    out = {}
    for name, tp, pp, dp, sp, stage in cases:
        cfg = experiment(tp, pp, dp, LORA, sp)
        ctx = ParallelContext.build(ParallelDims(tp_size=tp, sp_size=sp, pp_size=pp, dp_size=dp))
        out[name] = _train(cfg, fp32_config(stage), ctx)
    return out


def _reference_rank(rank, world_size, directory):
    """The one-process run, and the same run stopped after step 2, saved, and resumed into a model built
    from another seed (base and adapters): the checkpoint restores both."""
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches
    out = _trainings([("one", 1, 1, 1, 1, 0)])
    cfg, ds = experiment(1, 1, 1, LORA), fp32_config(0)
    ctx = ParallelContext.build(ParallelDims(tp_size=1, pp_size=1, dp_size=1))
    seed_all(cfg.train.seed)
    trainer = build_trainer(cfg, ds, ctx)
    batches = training_batches(cfg, ctx)
    losses = [trainer.train_step(batches).loss for _ in range(2)]
    trainer.save(directory, 2)
    other = experiment(1, 1, 1, LORA + ["train.seed=99"])
    resumed = build_trainer(other, ds, ctx)
    step = resumed.load(directory, "step2")
    losses.append(resumed.train_step(training_batches(cfg, ctx, start_step=step)).loss)
    out["resumed"] = losses
    return out


def _merged(results, name):
    state, before = {}, {}
    for r in results:
        state.update(r[name]["state"])
        before.update(r[name]["before"])
    return {"losses": results[0][name]["losses"], "all_losses": [r[name]["losses"] for r in results],
            "state": state, "before": before, "replica_mismatches": sorted({m for r in results
                                                                           for m in r[name]["replica_mismatches"]})}


def _four(rank, world_size, folder, lora_path, export_dir):
    return {"layers": _layers(world_size), "diffusers": _diffusers(world_size, folder, lora_path, export_dir),
            "training": _trainings(CASES)}


@pytest.fixture(scope="module")
def runs(released, tmp_path_factory):
    """Every rank's results: the one-process reference's and the 4-rank spawn's."""
    directory = tmp_path_factory.mktemp("lora")
    lora_path = adapter_file(released[POS][1], directory / "given")
    return {"one": run_ranks(_reference_rank, 1, str(directory / "checkpoints")),
            "four": run_ranks(_four, 4, str(released[POS][0]), str(lora_path), str(directory)),
            "dir": directory, "lora_path": lora_path}


def test_adapters_split_like_their_weights_and_ride_on_the_existing_all_reduces(runs):
    for rank, out in enumerate(runs["four"]):
        ref, got = out["layers"]["tp1"], out["layers"]["tp2"]
        for key in ("q", "y", "x.grad", "z.grad", "col.A", "col.B", "row.A", "row.B"):
            torch.testing.assert_close(got[key], ref[key], msg=lambda m: f"rank {rank} {key}: {m}")
        assert ref["calls"] == []
        tokens = B * S
        # forward: Row's all-reduce of [z_i W_i^T, u_i] (H + R); backward: Column's of [dx, du] (H + 2 R)
        assert got["calls"] == [("all_reduce", tokens * (H + R)), ("all_reduce", tokens * (H + len(PARTS) * R))]


def test_prediction_with_adapters_equals_diffusers_with_peft(runs, released):
    folder, base = released[POS]
    tmp_path, lora_path = runs["dir"], runs["lora_path"]
    results = [r["diffusers"] for r in runs["four"]]
    inputs = _inputs()
    adapted = copy.deepcopy(base)
    adapted.load_lora_adapter(str(lora_path.parent), prefix="transformer", weight_name=LORA_WEIGHTS_NAME)
    want = diffusers_forward(adapted, POS, *inputs)
    assert not torch.allclose(want, diffusers_forward(base, POS, *inputs), atol=1e-3)   # the adapter matters
    for rank, out in enumerate(results):
        for tp, pp in LAYOUTS:
            torch.testing.assert_close(out[(tp, pp)], want, msg=lambda m: f"tp={tp} pp={pp} rank {rank}: {m}")
    # The export from tp 2 x pp 2: the given tensors bit for bit, and diffusers loads it the same way.
    exported = tmp_path / "lora" / LORA_WEIGHTS_NAME
    with safe_open(str(lora_path), "pt") as given, safe_open(str(exported), "pt") as written:
        assert sorted(given.keys()) == sorted(written.keys())
        for key in given.keys():
            assert torch.equal(given.get_tensor(key), written.get_tensor(key)), key
    again = copy.deepcopy(base)
    again.load_lora_adapter(str(exported.parent), prefix="transformer", weight_name=LORA_WEIGHTS_NAME)
    torch.testing.assert_close(diffusers_forward(again, POS, *inputs), want)
    merged = CogVideoXTransformer3DModel.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(diffusers_forward(merged, POS, *inputs), want)


def test_lora_layouts_match_one_process_with_a_frozen_base_and_the_planned_states(runs):
    one, results = runs["one"], [r["training"] for r in runs["four"]]
    reference = _merged(one, "one")
    assert one[0]["resumed"] == reference["losses"]        # resumed from a checkpoint: the same steps, bit for bit
    for name, tp, pp, dp, sp, stage in CASES:
        run = _merged(results, name)
        assert_matches(run, reference)
        for key, value in run["before"].items():          # the base, bit for bit
            assert torch.equal(run["state"][key], value), f"{name}: {key} changed"
        assert run["before"].keys() == {k for k in reference["state"] if ".lora_" not in k}
        cfg, ds = experiment(tp, pp, dp, LORA, sp), fp32_config(stage)
        plan = plan_memory(cfg, ds, dp, 80 * 2**30, ActivationTracer(cfg, EngineSettings.from_ds(ds, 1).dtype))
        for r in results:
            got = r[name]
            assert got["trainable"] and all(".lora_" in t for t in got["trainable"]), got["trainable"]
            if stage == 0:                                 # the optimizer steps the module's adapters
                assert sorted(got["stepped"]) == got["trainable"]
                assert got["moments"] == got["adapters"]
            else:                                          # ZeRO-2: this rank's partition of them
                assert got["adapters"] / (dp * sp) <= got["moments"] <= got["adapters"] / (dp * sp) + 8
            predicted = sum(plan.stages[got["stage"]].lines[k] for k in STATES)
            print(f"{name} stage {got['stage']}: predicted {predicted:,} B, measured {got['probe']:,} B")
            assert got["probe"] == pytest.approx(predicted, rel=0.01), name
