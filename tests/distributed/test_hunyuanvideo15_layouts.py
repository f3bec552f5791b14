"""The HunyuanVideo 1.5 family in 4 gloo ranks against diffusers' HunyuanVideo15Transformer3DModel and against one
process.

One spawn serves every case: the tiny random release (tests/helpers/hunyuanvideo15.py's `released` fixture: 2
dual-stream blocks) loaded at (tp, pp) = (1, 1), (2, 1), (1, 2), (2, 2) and at sp 2 (tp 1 and tp 2) predicts what
diffusers predicts on text-to-video and image-to-video inputs (sp 2 splits the 16 text + 72 video tokens so that
one rank holds all the text, the other none), and so do ring 2 and Ulysses 2 x ring 2 (the joint attention's
padding text rows masked as keys round the ring); at tp 2 the gradients of a loss equal diffusers' own (the embed
stage's projections and condition embeddings replicated, the replicated q/k RMSNorm weights summed over ranks),
and one block's forward issues the four all-reduces of a dual-stream block; tp 2 x pp 2 exports a diffusers
folder that `from_pretrained` reads back bit for bit; and three training steps at tp 2 x pp 2, at sp 2 x dp 2 and
at Ulysses 2 x ring 2 equal one process, and so do three steps of rank-4 adapters at tp 2 x pp 2.
"""
from pathlib import Path

import torch

from parallel.experiment.config import load_config
from tests.released_utils import assert_export_reads_back, assert_grads_match, layout_model
from tests.train_utils import Run, assert_matches, merge_ranks, train_all
from tests.helpers.hunyuanvideo_layouts import hunyuan_fp32_config
from models.hunyuanvideo15.released import DIFFUSERS  # noqa: F401
from tests.helpers.hunyuanvideo15 import diffusers_forward, inputs, overrides, released  # noqa: F401

PRESET = "debug-hunyuan15"
# (tp, pp, sp, ring); dp fills 4 ranks; sp 4 with ring 2 is Ulysses 2 x ring 2
LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (2, 2, 1, 1), (1, 1, 2, 1), (2, 1, 2, 1), (1, 1, 2, 2),
           (1, 1, 4, 2)]
TRAIN_LAYOUTS = [(2, 2, 1, 1, 1), (1, 1, 2, 2, 1), (1, 1, 4, 1, 2)]             # (tp, pp, sp, dp, ring)
# Adapters on the video q (one part of the column-parallel [q; k; v]), the text k and the row-parallel text output.
LORA = ("model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[to_q,add_k_proj,to_add_out]")


def _model(folder, tp, pp, sp, world_size, ring=1):
    return layout_model(PRESET, overrides(folder), folder, world_size, tp, pp, sp, ring)


def _rank(rank, world_size, folder, export_dir):
    import types

    import deepspeed

    from parallel.distributed import accelerator
    from parallel.distributed.comm import count_comm
    from parallel.validation.validate import StageForward
    from parallel.weights.diffusers_export import export_diffusers
    from parallel.weights.gather import full_tensors
    from tests.train_utils import _train_rank

    deepspeed.init_distributed(dist_backend=accelerator.backend())
    out = {}
    for tp, pp, sp, ring in LAYOUTS:
        cfg, ctx, model = _model(folder, tp, pp, sp, world_size, ring)
        forward = StageForward(types.SimpleNamespace(module=model, device=torch.device("cpu")), ctx)
        for i2v in (False, True):
            x = inputs(i2v)
            out[("predict", tp, pp, sp, ring, i2v)] = forward.predict(x, x[0][:, :4].contiguous())  # like: the 4 predicted channels
        if (tp, pp) == (2, 2):
            export_diffusers(model, ctx, cfg, Path(export_dir), max_shard_bytes=2_000_000)
    cfg, ctx, model = _model(folder, 2, 1, 1, world_size)
    x = inputs(True)
    target = torch.randn(x[0][:, :4].shape, generator=torch.Generator().manual_seed(3))
    h = model.embed(x)
    with count_comm() as dual:
        h = model.blocks[0](h)
    out["all_reduces"] = dual.numels("all_reduce")
    torch.nn.functional.mse_loss(model.final(model.blocks[1](h)), target).backward()
    out["grads"] = dict(full_tensors(model, ctx, cfg.model.num_layers, value=lambda p: p.grad))
    ds = hunyuan_fp32_config()
    for tp, pp, sp, dp, ring in TRAIN_LAYOUTS:
        out[("train", tp, pp, sp, dp, ring)] = _train_rank(rank, world_size, tp, pp, dp, ds, 3,
                                                           (f"parallel.ring_size={ring}",), sp, PRESET, 0)
    out["lora"] = _train_rank(rank, world_size, 2, 2, 1, ds, 3, LORA, 1, PRESET, 0)
    return out


def test_hunyuanvideo15_in_every_layout(released, tmp_path):
    folder, model = released
    spawned = train_all({"reference": Run(1, 1, 1, hunyuan_fp32_config(), preset=PRESET),
                         "lora": Run(1, 1, 1, hunyuan_fp32_config(), extra=LORA, preset=PRESET)},
                        {"layouts": (4, _rank, (str(folder), str(tmp_path / "export")))})
    reference, lora_reference, results = spawned["reference"], spawned["lora"], spawned["layouts"]

    # Prediction: every layout, every rank, text- and image-to-video, equals diffusers.
    for i2v in (False, True):
        want = diffusers_forward(model, inputs(i2v))
        for rank, out in enumerate(results):
            for tp, pp, sp, ring in LAYOUTS:
                torch.testing.assert_close(out[("predict", tp, pp, sp, ring, i2v)], want, msg=lambda m: f"tp={tp} "
                                           f"pp={pp} sp={sp} ring={ring} i2v={i2v} rank {rank}: {m}")

    # Gradients at tp 2 equal diffusers' (names through the released format's map).
    cfg = load_config(PRESET, overrides(folder))
    model.zero_grad()
    target = torch.randn(inputs(True)[0][:, :4].shape, generator=torch.Generator().manual_seed(3))
    fmt = DIFFUSERS.bind(cfg.model)
    torch.nn.functional.mse_loss(fmt.reference_call(model, inputs(True), {}), target).backward()
    # the last block's text outputs reach no prediction: diffusers leaves their gradient None, ours is zero
    theirs = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}
    assert_grads_match(results[0]["grads"], cfg.model, theirs)

    # One dual-stream block's forward at tp 2: the text and video outputs of attention and of the FFNs.
    b, text, video, hid = 2, 16, 72, 64
    assert results[0]["all_reduces"] == [b * text * hid, b * video * hid, b * text * hid, b * video * hid]

    # Export from tp 2 x pp 2: shards of each stage with an index; from_pretrained gives the original bits.
    assert_export_reads_back(tmp_path / "export", model)

    # Training: tp 2 x pp 2, sp 2 x dp 2 and Ulysses 2 x ring 2 equal one process, 3 steps; adapters at tp 2 x pp 2.
    for key, want in [(("train", *layout), reference) for layout in TRAIN_LAYOUTS] + [("lora", lora_reference)]:
        assert_matches(merge_ranks([r[key] for r in results]), want)
    adapted = sorted(n for n in lora_reference["state"] if n.endswith("lora_B"))
    assert adapted == [f"blocks.{i}.{m}.lora_B" for i in (0, 1) for m in ("add_qkv", "to_add_out", "to_qkv")], adapted
    assert lora_reference["state"]["blocks.0.to_add_out.lora_B"].abs().sum() > 0     # the adapters trained (the
    assert lora_reference["state"]["blocks.1.to_add_out.lora_B"].abs().sum() == 0    # last text output reaches none)
