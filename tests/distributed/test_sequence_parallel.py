"""Ulysses sequence parallelism (parallel.sp_size) against one process, and its all-to-alls counted.

The `debug` sequence is 8 text + 48 video = 56 tokens: at sp = 2 the first rank holds the 8 text tokens
and 20 video tokens, the second 28 video tokens, so the text/video boundary falls inside a rank.
`debug-stdit`'s sequence is the 48 video tokens (3 frames of 4 x 4): each sp rank holds a frame and a
half, and its spatial and temporal attentions regroup the whole sequence after the all-to-alls.

Every rank function of this module runs in one spawn per world size (1, 2 and 4 ranks: the `spawned` fixture).
"""
import pytest
import torch

from tests.dist_utils import count_all_to_alls
from tests.train_utils import Run, assert_matches, train_all
from tests.helpers.sequence_parallel import sp_config
from tests.helpers.validation import _check_reads, _sample_rank, _validate_rank

B = 2


ROPE = ("model.pos_embed=rope3d",)
REFERENCES = {"debug": (), "debug rope": ROPE, "debug-stdit": ()}


# (reference, tp, pp, dp, sp, zero stage). 3D RoPE is applied inside attention, on the whole sequence.
LAYOUTS = [("debug", 1, 1, 1, 2, 0), ("debug rope", 2, 1, 1, 2, 0), ("debug", 1, 2, 1, 2, 1), ("debug", 1, 1, 2, 2, 2),
           ("debug-stdit", 1, 1, 1, 2, 0), ("debug-stdit", 2, 1, 1, 2, 0)]
PRESETS = ["debug", "debug-stdit"]      # the all-to-alls counted


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """The one-process references and every layout's training; validation and samples at one process and at sp 2;
    the all-to-all counts of each preset."""
    folder = str(tmp_path_factory.mktemp("samples"))
    return train_all({
        **{name: Run(1, 1, 1, sp_config(), extra=extra, preset=name.split()[0]) for name, extra in REFERENCES.items()},
        **{layout: Run(tp, pp, dp, sp_config(stage), sp=sp, extra=REFERENCES[ref], preset=ref.split()[0])
           for layout in LAYOUTS for ref, tp, pp, dp, sp, stage in [layout]}}, {
        "validate one": (1, _validate_rank, ([((1, 1, 1), 0)], [])),
        "validate sp": (2, _validate_rank, ([((1, 1, 1, 2), 0)], [])),
        "sample one": (1, _sample_rank, ([((1, 1, 1), 0)], folder)),
        "sample sp": (2, _sample_rank, ([((1, 1, 1, 2), 0)], folder)),
        **{("all-to-alls", preset): (2, _rank, (preset,)) for preset in PRESETS}})


@pytest.mark.parametrize("layout", LAYOUTS,
                         ids=[f"{r.replace(' ', '-')}-tp{t}-pp{p}-dp{d}-sp{s}-zero{z}" for r, t, p, d, s, z in LAYOUTS])
def test_sequence_parallel_layout_matches_one_process(spawned, layout):
    assert_matches(spawned[layout], spawned[layout[0]])


def test_validation_and_samples_with_sequence_parallel(spawned):
    """Validation and sample videos at sp 2 equal one process's (to fp32 round-off: the sp ranks' attention
    sums in another order); each sample is read once, by the replica's first sp rank."""
    (one,), by_rank = spawned["validate one"], spawned["validate sp"]
    for r in by_rank:
        assert r[0]["result"].keys() == one[0]["result"].keys()
        for key, value in one[0]["result"].items():
            assert r[0]["result"][key] == pytest.approx(value, rel=1e-5), key
    _check_reads([r[0] for r in by_rank], 7)

    (serial,), sp = spawned["sample one"], spawned["sample sp"]
    for i, frames in serial[0].items():
        diff = (sp[0][0][i].astype(int) - frames.astype(int))
        assert abs(diff).max() <= 1 and (diff != 0).mean() < 0.01, i    # uint8 frames: rounding at most


def _rank(rank, world_size, preset):
    """One micro-batch at sp 2, plain and recomputed, against one process; each all-to-all's input size counted."""
    import deepspeed
    import torch.distributed as dist

    from parallel.train.data import DiffusionBatches
    from models.diffusion import Objective
    from parallel.distributed import accelerator
    from parallel.experiment.config import load_config
    from parallel.model.build import build_model
    from parallel.train.run import build_dataset
    from parallel.distributed.topology import ParallelContext, ParallelDims

    with count_all_to_alls() as calls:
        deepspeed.init_distributed(dist_backend=accelerator.backend())
        cfg = load_config(preset, [f"train.micro_batch_size={B}", "parallel.sp_size=2"])
        ctx = ParallelContext.build(ParallelDims(tp_size=1, sp_size=2, pp_size=1, dp_size=1))
        inputs, target = next(DiffusionBatches(build_dataset(cfg), Objective("v_prediction"), seed=0, micro_batch=B,
                                               grad_accum=1, dp_rank=0, dp_size=1))
        serial = build_model(cfg, {}, ParallelContext.single())     # the layers follow the context: sp = 1
        serial_loss = serial(inputs, target)
        serial_loss.backward()

        deepspeed.checkpointing.configure(ctx, partition_activations=False)
        out = {}
        recompute = ({"activation_checkpointing": {}}, deepspeed.checkpointing.checkpoint)
        for name, (ds, fn) in {"plain": ({}, None), "recompute": recompute}.items():
            model = build_model(cfg, ds, ctx, fn)
            calls.clear()
            loss = model(inputs, target)
            fwd = list(calls)
            calls.clear()
            loss.backward()
            bwd = list(calls)
            # The sp ranks' losses and gradients average to the serial ones (DeepSpeed averages over dp x sp).
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss, group=ctx.sp_group)
            grads = {}
            for n, p in model.named_parameters():
                g = p.grad.clone()
                dist.all_reduce(g, group=ctx.sp_group)
                grads[n] = g / 2
            out[name] = {"fwd": fwd, "bwd": bwd, "loss": mean_loss.item() / 2, "grads": grads}
            if name == "plain":
                with torch.no_grad():
                    out[name]["prediction"] = model.final.assemble(model.predict(inputs))
        with torch.no_grad():
            out["serial"] = {"loss": serial_loss.item(), "prediction": serial.predict(inputs),
                             "grads": {n: p.grad for n, p in serial.named_parameters()}}
        return out


@pytest.mark.parametrize("preset, tokens, attentions", [("debug", 8 + 48, 1), ("debug-stdit", 48, 2)])
def test_four_all_to_alls_per_attention_each_way_and_serial_numbers(spawned, preset, tokens, attentions):
    """One micro-batch at sp = 2: the all-to-alls counted (STDiT: a spatial and a temporal attention per
    layer), and the sp ranks' mean loss, mean gradients and assembled prediction against one process."""
    results = spawned["all-to-alls", preset]
    n = 4 * attentions                         # 4 layers
    chunk = B * (tokens // 2) * 4 * 16         # q, k, v and the output: [B, S/sp, 4 heads, 16] on each rank
    for r in results:
        plain, recompute, serial = r["plain"], r["recompute"], r["serial"]
        assert plain["fwd"] == [chunk] * (4 * n)
        assert plain["bwd"] == [chunk] * (4 * n)
        # Recomputation repeats the forward's four inside backward.
        assert recompute["fwd"] == plain["fwd"]
        assert sorted(recompute["bwd"]) == [chunk] * (8 * n)
        torch.testing.assert_close(plain["prediction"], serial["prediction"])
        for run in (plain, recompute):
            torch.testing.assert_close(run["loss"], serial["loss"])
            for name, grad in serial["grads"].items():
                torch.testing.assert_close(run["grads"][name], grad, msg=lambda m: f"{name}: {m}")
