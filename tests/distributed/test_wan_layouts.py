"""The Wan 2.1 family in 4 gloo ranks against diffusers' WanTransformer3DModel and against one process.

One spawn serves every case, for text-to-video, image-to-video (debug-wan-i2v: the CLIP tokens and the image
cross-attention, tests/helpers/wan_i2v.py's `released_i2v`) and Wan 2.2 TI2V (debug-wan22-ti2v: a timestep per
token, tests/helpers/wan22_ti2v.py's `released_ti2v`) alike: the tiny random release
(tests/helpers/wan.py's `released` fixture) loaded at
(tp, pp) = (1, 1), (2, 1), (1, 2), (2, 2) and at sp 2 (tp 1 and tp 2) predicts what diffusers predicts; at
tp 2 the gradients of a loss (the q/k RMSNorm across heads all-reduces its statistic, forward and backward)
equal diffusers' own; tp 2 x pp 2 exports a diffusers folder that `from_pretrained` reads back bit for bit;
and three training steps at tp 2 x pp 2 and at sp 2 x dp 2 equal one process.
"""
from pathlib import Path

import torch

from parallel.experiment.config import load_config
from tests.released_utils import assert_export_reads_back, assert_grads_match, layout_model
from tests.train_utils import Run, assert_matches, merge_ranks, train_all
from tests.helpers import wan as test_wan, wan22_ti2v as test_wan22_ti2v, wan_i2v as test_wan_i2v
from tests.helpers.wan import released  # noqa: F401  (fixture)
from tests.helpers.wan22_ti2v import released_ti2v  # noqa: F401  (fixture)
from tests.helpers.wan_i2v import released_i2v  # noqa: F401  (fixture)
from tests.helpers.wan_layouts import wan_fp32_config

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2)]     # (tp, pp, sp); dp fills 4 ranks
TRAIN_LAYOUTS = [(2, 2, 1, 1), (1, 1, 2, 2)]                                     # (tp, pp, sp, dp)
VARIANTS = {"debug-wan": test_wan, "debug-wan-i2v": test_wan_i2v,               # preset -> its unit-test module
            "debug-wan22-ti2v": test_wan22_ti2v}


def _model(preset, folder, tp, pp, sp, world_size):
    return layout_model(preset, VARIANTS[preset].overrides(folder), folder, world_size, tp, pp, sp)


def _rank(rank, world_size, variants):
    import deepspeed

    from parallel.distributed import accelerator

    deepspeed.init_distributed(dist_backend=accelerator.backend())
    return {preset: _variant(rank, world_size, preset, folder, export_dir) for preset, folder, export_dir in variants}


def _variant(rank, world_size, preset, folder, export_dir):
    import types

    from parallel.distributed.comm import count_comm
    from parallel.validation.validate import StageForward
    from parallel.weights.diffusers_export import export_diffusers
    from parallel.weights.gather import full_tensors
    from tests.train_utils import _train_rank

    x, out = VARIANTS[preset].inputs(), {}
    for tp, pp, sp in LAYOUTS:
        cfg, ctx, model = _model(preset, folder, tp, pp, sp, world_size)
        forward = StageForward(types.SimpleNamespace(module=model, device=torch.device("cpu")), ctx)
        out[("predict", tp, pp, sp)] = forward.predict(x, x[0][:, :cfg.model.in_channels])
        if (tp, pp) == (2, 2):
            export_diffusers(model, ctx, cfg, Path(export_dir), max_shard_bytes=100_000)
    # tp 2 (pp 1): a loss's gradients as full tensors; the all-reduces of one block's forward counted.
    cfg, ctx, model = _model(preset, folder, 2, 1, 1, world_size)
    target = torch.randn(x[0][:, :cfg.model.in_channels].shape, generator=torch.Generator().manual_seed(3))
    with count_comm() as counter:
        h = model.embed(x)
        h = model.blocks[0](h)
    out["block_all_reduces"] = counter.numels("all_reduce")
    for block in model.blocks[1:]:
        h = block(h)
    torch.nn.functional.mse_loss(model.final(h), target).backward()
    out["grads"] = dict(full_tensors(model, ctx, cfg.model.num_layers, value=lambda p: p.grad))
    ds = wan_fp32_config()
    for tp, pp, sp, dp in TRAIN_LAYOUTS:
        out[("train", tp, pp, sp, dp)] = _train_rank(rank, world_size, tp, pp, dp, ds, 3, (), sp, preset, 0)
    return out


def test_wan_in_every_layout(released, released_i2v, released_ti2v, tmp_path):
    """Text-to-video, image-to-video (y = [image tokens; caption]: one more all-reduce per block, the image
    keys' RMSNorm statistic over B x I tokens) and Wan 2.2 TI2V (a timestep per token: temb and tproj split with
    the tokens under sp and sent between stages; training with the first latent frame clean and out of the
    loss), from one spawn."""
    variants = [("debug-wan", released, tmp_path / "export"), ("debug-wan-i2v", released_i2v, tmp_path / "export_i2v"),
                ("debug-wan22-ti2v", released_ti2v, tmp_path / "export_ti2v")]
    spawned = train_all({preset: Run(1, 1, 1, wan_fp32_config(), preset=preset) for preset, _, _ in variants},
                        {"layouts": (4, _rank, ([(preset, str(folder), str(export))
                                                 for preset, (folder, _), export in variants],))})
    for preset, (folder, model), export in variants:
        check_variant(preset, folder, model, export, [r[preset] for r in spawned["layouts"]], spawned[preset])


def check_variant(preset, folder, model, exported, results, reference):
    """One variant's layouts (`results`, by rank) against diffusers and its one-process training `reference`."""
    unit = VARIANTS[preset]

    # Prediction: every layout, every rank, equals diffusers.
    want = unit.diffusers_forward(model, *unit.inputs())
    for rank, out in enumerate(results):
        for tp, pp, sp in LAYOUTS:
            torch.testing.assert_close(out[("predict", tp, pp, sp)], want,
                                       msg=lambda m: f"tp={tp} pp={pp} sp={sp} rank {rank}: {m}")

    # Gradients at tp 2 equal diffusers' (names through the released format's map).
    cfg = load_config(preset, unit.overrides(folder))
    model.zero_grad()
    x = unit.inputs()
    target = torch.randn(x[0][:, :cfg.model.in_channels].shape, generator=torch.Generator().manual_seed(3))
    prediction = model(hidden_states=x[0], timestep=x[1], encoder_hidden_states=x[2],
                       encoder_hidden_states_image=x[3] if len(x) > 3 else None).sample
    torch.nn.functional.mse_loss(prediction, target).backward()
    assert_grads_match(results[0]["grads"], cfg.model, {n: p.grad for n, p in model.named_parameters()})
    # One block's forward at tp 2: the q and k statistics of both attentions (B x S and B x L of them), then
    # the self-attention, cross-attention and FFN outputs (B x S x H each).
    # Image-to-video: then the image keys' statistic (B x I).
    b, s, text, hid = 2, 72, cfg.model.max_text_len, 64
    image = [b * cfg.model.image_len] if cfg.model.image_dim else []
    assert results[0]["block_all_reduces"] == [b * s, b * s, b * s * hid, b * s, b * text, *image, b * s * hid,
                                               b * s * hid]

    # Export from tp 2 x pp 2: shards of each stage with an index; from_pretrained gives the original bits.
    assert_export_reads_back(exported, model)

    # Training: tp 2 x pp 2 and sp 2 x dp 2 equal one process, 3 steps.
    for tp, pp, sp, dp in TRAIN_LAYOUTS:
        assert_matches(merge_ranks([r[("train", tp, pp, sp, dp)] for r in results]), reference)
