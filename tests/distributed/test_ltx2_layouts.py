"""The LTX-2 family in 4 gloo ranks against diffusers' LTX2VideoTransformer3DModel.

One spawn: the tiny random releases of tests/unit/test_ltx2.py (LTX-2.0, and the LTX-2.3 flags: gated attention,
cross-attention modulation) loaded at (tp, pp) = (1, 1), (2, 1), (1, 2), (2, 2) predict what diffusers predicts,
video and audio, on every rank; at tp 2 the gradients of a loss over both streams equal diffusers' own (every q/k
RMSNorm all-reduces its statistic across heads, forward and backward), and one block's forward all-reduces what
the block's docstring counts. Sequence parallelism is not built for this family yet (docs/models.md#ltx-2).
"""
import torch

from tests.dist_utils import run_ranks
from tests.released_utils import assert_grads_match, layout_model
from tests.helpers import ltx2 as test_ltx2
from tests.helpers.ltx2 import released  # noqa: F401  (fixture)

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]                 # (tp, pp); dp fills 4 ranks
VARIANTS = ["ltx2", "ltx2.3"]


def targets():
    g = torch.Generator().manual_seed(3)
    x = test_ltx2.inputs()
    return torch.randn(x[0].shape, generator=g), torch.randn(x[3].shape, generator=g)


def loss(video, audio):
    want_video, want_audio = targets()
    return torch.nn.functional.mse_loss(video, want_video) + torch.nn.functional.mse_loss(audio, want_audio)


def _predict(model, ctx, inputs):
    """Both predictions on every rank: the stages in order (pp 1), or each pipeline stage's layers with the stage
    tuple sent to the next stage and the last stage's (video, audio) broadcast over the pipeline group."""
    import torch.distributed as dist

    from parallel.distributed.deepspeed.pipeline import stage_layers
    from parallel.train.validate import _recv, _send

    if ctx.pp_size == 1:
        return model.predict(inputs)
    g, c = ctx.dims, ctx.coord
    h = inputs if c.pp == 0 else _recv(g.rank(pp=c.pp - 1, dp=c.dp, tp=c.tp, sp=c.sp), torch.device("cpu"))
    for layer in stage_layers(model):
        h = layer(h)
    last = g.rank(pp=ctx.pp_size - 1, dp=c.dp, tp=c.tp, sp=c.sp)
    if c.pp < ctx.pp_size - 1:
        _send(h, g.rank(pp=c.pp + 1, dp=c.dp, tp=c.tp, sp=c.sp))
        h = tuple(torch.empty(s) for s in (inputs[0].shape, inputs[3].shape))
    h = tuple(t.contiguous() for t in h)
    for t in h:
        dist.broadcast(t, last, group=ctx.pp_group)
    return h


def _rank(rank, world_size, folders):
    import deepspeed

    from parallel.distributed import accelerator

    deepspeed.init_distributed(dist_backend=accelerator.backend())
    return {variant: _variant(world_size, variant, folder) for variant, folder in folders}


def _variant(world_size, variant, folder):
    from parallel.distributed.comm import count_comm
    from parallel.weights.gather import full_tensors

    x, out, overrides = test_ltx2.inputs(), {}, test_ltx2.overrides(folder, variant)
    for tp, pp in LAYOUTS:
        _, ctx, model = layout_model("debug-ltx2", overrides, folder, world_size, tp, pp)
        with torch.no_grad():
            out[("predict", tp, pp)] = _predict(model, ctx, x)
    cfg, ctx, model = layout_model("debug-ltx2", overrides, folder, world_size, 2, 1)
    with count_comm() as counter:
        h = model.blocks[0](model.embed(x))
    out["block_all_reduces"] = counter.numels("all_reduce")
    for block in model.blocks[1:]:
        h = block(h)
    loss(*model.final(h)).backward()
    out["grads"] = dict(full_tensors(model, ctx, cfg.model.num_layers, value=lambda p: p.grad))
    return out


def test_ltx2_in_every_layout(released):
    from parallel.config import load_config

    results = run_ranks(_rank, 4, [(v, str(released[v][0])) for v in VARIANTS])
    for variant in VARIANTS:
        folder, model = released[variant]
        want = test_ltx2.diffusers_forward(model, variant)
        for rank, out in enumerate(r[variant] for r in results):
            for tp, pp in LAYOUTS:
                for got, expected, stream in zip(out[("predict", tp, pp)], want, ("video", "audio")):
                    torch.testing.assert_close(got, expected,
                                               msg=lambda m: f"{variant} {stream} tp={tp} pp={pp} rank {rank}: {m}")

        # tp 2 gradients equal diffusers' (names through the released format's map).
        model.zero_grad()
        from models.ltx2.released import DIFFUSERS
        loss(*DIFFUSERS.reference_call(model, test_ltx2.inputs(), {})).backward()
        cfg = load_config("debug-ltx2", test_ltx2.overrides(folder, variant))
        assert_grads_match(results[0][variant]["grads"], cfg.model, {n: p.grad for n, p in model.named_parameters()})

        # One block at tp 2: per attention, the q and k statistics (B x queries, B x keys) then its output
        # (B x queries x width of the stream the queries come from); then the two FFN outputs.
        b, s, a, text, d, da = 2, 48, 9, 8, 32, 16
        attentions = [(s, s, d), (a, a, da), (s, text, d), (a, text, da), (s, a, d), (a, s, da)]
        expected = [n for q, k, w in attentions for n in (b * q, b * k, b * q * w)] + [b * s * d, b * a * da]
        assert results[0][variant]["block_all_reduces"] == expected
