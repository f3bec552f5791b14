"""Wan 2.2 A14B, both experts in one run (configs/debug-wan22.yaml, models/wan/experts.py): three training steps at
tp 2 x pp 2 and at sp 2 x dp 2 equal one process (losses on every rank, both experts' weights), and every rank of
every layout routes each sample of each step to the expert one process routes it to; a tiny random release
(tests/unit/test_wan22_released.py) read at tp 2 x pp 2 and exported with --format diffusers's writer gives
transformer/ and transformer_2/ that WanTransformer3DModel.from_pretrained reads back bit for bit, and beside them
the pipeline's model_index.json (the boundary), with which python -m parallel.verify routes diffusers' rows. One
spawn of 4 gloo ranks.
"""
import json

import torch

from models.wan.experts import expert_of
from tests.dist_utils import run_ranks
from tests.helpers.wan_layouts import wan_fp32_config
from tests.train_utils import GLOBAL_BATCH, assert_matches, experiment, train

PRESET = "debug-wan22"
TRAIN_LAYOUTS = [(2, 2, 1, 1), (1, 1, 2, 2)]                                     # (tp, pp, sp, dp)
STEPS = 3


def experts_by_position(tp, pp, sp, dp):
    """{global sample position: expert} of the first STEPS steps as this rank's training batches draw them."""
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.run import training_batches

    cfg = experiment(tp, pp, dp, (), sp, PRESET)
    if dp * tp * pp * sp == 1:
        ctx, dp_rank = ParallelContext.single(), 0
    else:
        ctx = ParallelContext.build(ParallelDims(tp_size=tp, sp_size=sp, pp_size=pp, dp_size=dp))
        dp_rank = ctx.dp_rank
    batches, mb, out = training_batches(cfg, ctx), cfg.train.micro_batch_size, {}
    for step in range(STEPS):
        for micro in range(cfg.train.grad_accum_steps):
            (_, t, *_), _ = next(batches)
            first = step * GLOBAL_BATCH + (micro * dp + dp_rank) * mb
            out.update({first + i: e for i, e in enumerate(expert_of(cfg.model, t).tolist())})
    return out


def _export(folder, out):
    """Read the release at tp 2 x pp 2 and at sp 2 x dp 2: the prediction of a batch mixing both experts in
    each; export it from tp 2 x pp 2 as diffusers folders."""
    import types

    from parallel.model.build import build_model
    from parallel.experiment.config import load_config
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.validation.validate import StageForward
    from parallel.weights.diffusers import load_released
    from parallel.weights.diffusers_export import export_diffusers
    from tests.helpers.wan22_released import MIXED, inputs, overrides

    result = {}
    for tp, pp, sp in [(2, 2, 1), (1, 1, 2)]:
        cfg = load_config(PRESET, overrides(folder, f"parallel.tp_size={tp}", f"parallel.pp_size={pp}",
                                            f"parallel.sp_size={sp}"))
        ctx = ParallelContext.build(ParallelDims(tp_size=tp, sp_size=sp, pp_size=pp, dp_size=4 // (tp * pp * sp)))
        model = build_model(cfg, {}, ctx)
        load_released(model, ctx, cfg.model, folder)
        forward = StageForward(types.SimpleNamespace(module=model, device=torch.device("cpu")), ctx)
        x = inputs(MIXED)
        result[(tp, pp, sp)] = forward.predict(x, x[0])
        if (tp, pp) == (2, 2):
            result["files"] = [str(p) for p in export_diffusers(model, ctx, cfg, out, max_shard_bytes=100_000)]
    return result


def _rank(rank, world_size, folder, export):
    import deepspeed

    from parallel.distributed import accelerator
    from tests.train_utils import _train_rank

    deepspeed.init_distributed(dist_backend=accelerator.backend())
    out = {"export": _export(folder, export)}
    for tp, pp, sp, dp in TRAIN_LAYOUTS:
        out[("train", tp, pp, sp, dp)] = _train_rank(rank, world_size, tp, pp, dp, wan_fp32_config(), STEPS, (), sp,
                                                     PRESET, 0)
        out[("experts", tp, pp, sp, dp)] = experts_by_position(tp, pp, sp, dp)
    return out


def test_both_experts_train_alike_in_every_layout(tmp_path):
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    from tests.helpers.wan22_released import write_release
    folder, models = write_release(tmp_path / "release")
    results = run_ranks(_rank, 4, str(folder), str(tmp_path / "export"))
    # Prediction at tp 2 x pp 2 and sp 2 x dp 2, every rank: each row by its own expert, as diffusers.
    from tests.helpers.wan22_released import MIXED, inputs
    from tests.helpers.wan import diffusers_forward
    want = torch.cat([diffusers_forward(models[0], *inputs(MIXED))[:1], diffusers_forward(models[1], *inputs(MIXED))[1:]])
    for rank, r in enumerate(results):
        for layout in [(2, 2, 1), (1, 1, 2)]:
            torch.testing.assert_close(r["export"][layout], want, msg=lambda m: f"{layout} rank {rank}: {m}")
    # Export: both folders, sharded, read back bit for bit by diffusers.
    for sub, model in zip(("transformer", "transformer_2"), models):
        files = sorted((tmp_path / "export" / sub).glob("*.safetensors"))
        assert len(files) > 1 and (tmp_path / "export" / sub / "diffusion_pytorch_model.safetensors.index.json").is_file()
        again = WanTransformer3DModel.from_pretrained(tmp_path / "export" / sub)
        theirs = {n: p for n, p in model.state_dict().items()}
        ours = again.state_dict()
        assert ours.keys() == theirs.keys() and sum(len(load_file(str(f))) for f in files) == len(theirs)
        for name, want in theirs.items():
            assert torch.equal(ours[name], want), (sub, name)
    # The boundary between them, as the release's model_index.json holds it: parallel.verify of the export (which
    # reads it to route each row to diffusers' expert) passes.
    from parallel import verify
    from tests.helpers.wan22_released import BOUNDARY, overrides
    index = json.loads((tmp_path / "export" / "model_index.json").read_text())
    assert (index["_class_name"], index["boundary_ratio"]) == ("WanPipeline", BOUNDARY)
    assert index["transformer"] == index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    from diffusers import UniPCMultistepScheduler, WanPipeline
    pipe = WanPipeline.from_pretrained(tmp_path / "export", vae=None, text_encoder=None, tokenizer=None,
                                       scheduler=UniPCMultistepScheduler())      # the release's other components
    assert pipe.config.boundary_ratio == BOUNDARY
    for got, model in zip((pipe.transformer, pipe.transformer_2), models):
        assert all(torch.equal(got.state_dict()[n], v) for n, v in model.state_dict().items())
    assert verify.main(["--config", PRESET, *(f"--set={o}" for o in overrides(tmp_path / "export")), "--batch", "4"]) == 0
    reference = train(1, 1, 1, wan_fp32_config(), steps=STEPS, preset=PRESET)
    want = experts_by_position(1, 1, 1, 1)
    # Both experts train, and some micro-batch of 2 mixes them (the split-by-sample path).
    assert sorted(set(want.values())) == [0, 1]
    assert any(want[2 * i] != want[2 * i + 1] for i in range(len(want) // 2))
    for tp, pp, sp, dp in TRAIN_LAYOUTS:
        seen = {}
        for rank, r in enumerate(results):
            mine = r[("experts", tp, pp, sp, dp)]
            assert all(want[p] == e for p, e in mine.items()), (tp, pp, sp, dp, rank, mine)
            seen.update(mine)
        assert seen == want, (tp, pp, sp, dp)
        run = {"losses": results[0][("train", tp, pp, sp, dp)]["losses"],
               "all_losses": [r[("train", tp, pp, sp, dp)]["losses"] for r in results],
               "state": {k: v for r in results for k, v in r[("train", tp, pp, sp, dp)]["state"].items()},
               "replica_mismatches": sorted({n for r in results
                                             for n in r[("train", tp, pp, sp, dp)]["replica_mismatches"]})}
        assert any(".experts.1." in n for n in run["state"]) and any(".experts.0." in n for n in run["state"])
        assert_matches(run, reference)
    # Each expert's weights moved from their initial values over the three steps.
    from parallel.model.build import build_model
    from parallel.distributed.topology import ParallelContext
    from parallel.weights.gather import full_state
    cfg = experiment(1, 1, 1, (), 1, PRESET)
    from parallel.distributed.seed import seed_all
    seed_all(cfg.train.seed)
    initial = full_state(build_model(cfg, {}, ParallelContext.single()), ParallelContext.single(), cfg.model.num_layers)
    for e in (0, 1):
        name = f"blocks.3.experts.{e}.ffn_out.weight"
        assert not torch.equal(initial[name], reference["state"][name]), name
