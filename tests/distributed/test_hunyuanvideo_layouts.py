"""The HunyuanVideo family in 4 gloo ranks against diffusers' HunyuanVideoTransformer3DModel and against one process.

One spawn serves every case: the tiny random release (tests/helpers/hunyuanvideo.py's `released` fixture: 2
dual-stream + 2 single-stream blocks) loaded at (tp, pp) = (1, 1), (2, 1), (1, 2), (2, 2) and at sp 2 (tp 1 and
tp 2) predicts what diffusers predicts (sp 2 splits the 8 text + 72 video tokens so that one rank holds all the
text, the other none); at tp 2 the gradients of a loss equal diffusers' own (the single block's fused
[q, k, v, MLP] input and [attention; MLP] output split per part, the replicated q/k RMSNorm weights summed over
ranks), and one block's forward issues the all-reduces docs/tensor-parallel.md lists; tp 2 x pp 2 exports a diffusers folder that `from_pretrained` reads back bit for bit; and three training
steps at tp 2 x pp 2 and at sp 2 x dp 2 equal one process, and so do three steps of rank-4 adapters at tp 2 x pp 2.
"""
from pathlib import Path

import torch

from parallel.experiment.config import load_config
from tests.released_utils import assert_export_reads_back, assert_grads_match, layout_model
from tests.train_utils import Run, assert_matches, merge_ranks, train_all
from models.hunyuanvideo.released import DIFFUSERS  # noqa: F401
from tests.helpers.hunyuanvideo import diffusers_forward, inputs, overrides, released  # noqa: F401
from tests.helpers.hunyuanvideo_layouts import hunyuan_fp32_config

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2)]     # (tp, pp, sp); dp fills 4 ranks
TRAIN_LAYOUTS = [(2, 2, 1, 1), (1, 1, 2, 2)]                                     # (tp, pp, sp, dp)
# Adapters on the single block's fused input (its q and MLP parts) and its [attention; MLP] output (row-parallel over
# two input parts), and on the dual block's text output.
LORA = ("model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[proj_out,to_q,proj_mlp,to_add_out]")


def _model(folder, tp, pp, sp, world_size):
    return layout_model("debug-hunyuan", overrides(folder), folder, world_size, tp, pp, sp)


def _rank(rank, world_size, folder, export_dir):
    import types

    import deepspeed

    from parallel.distributed import accelerator
    from parallel.validation.validate import StageForward
    from parallel.weights.diffusers_export import export_diffusers
    from parallel.weights.gather import full_tensors
    from tests.train_utils import _train_rank

    deepspeed.init_distributed(dist_backend=accelerator.backend())
    x, out = inputs(), {}
    for tp, pp, sp in LAYOUTS:
        cfg, ctx, model = _model(folder, tp, pp, sp, world_size)
        forward = StageForward(types.SimpleNamespace(module=model, device=torch.device("cpu")), ctx)
        out[("predict", tp, pp, sp)] = forward.predict(x, x[0])
        if (tp, pp) == (2, 2):
            export_diffusers(model, ctx, cfg, Path(export_dir), max_shard_bytes=200_000)
    cfg, ctx, model = _model(folder, 2, 1, 1, world_size)
    target = torch.randn(x[0].shape, generator=torch.Generator().manual_seed(3))
    from parallel.distributed.comm import count_comm
    h = model.embed(x)
    with count_comm() as dual:
        h = model.blocks[0](h)
    h = model.blocks[1](h)
    with count_comm() as single:
        h = model.blocks[2](h)
    out["all_reduces"] = dual.numels("all_reduce"), single.numels("all_reduce")
    torch.nn.functional.mse_loss(model.final(model.blocks[3](h)), target).backward()
    out["grads"] = dict(full_tensors(model, ctx, cfg.model.num_layers, value=lambda p: p.grad))
    ds = hunyuan_fp32_config()
    for tp, pp, sp, dp in TRAIN_LAYOUTS:
        out[("train", tp, pp, sp, dp)] = _train_rank(rank, world_size, tp, pp, dp, ds, 3, (), sp, "debug-hunyuan", 0)
    out["lora"] = _train_rank(rank, world_size, 2, 2, 1, ds, 3, LORA, 1, "debug-hunyuan", 0)
    return out


def test_hunyuanvideo_in_every_layout(released, tmp_path):
    folder, model = released
    spawned = train_all({"reference": Run(1, 1, 1, hunyuan_fp32_config(), preset="debug-hunyuan"),
                         "lora": Run(1, 1, 1, hunyuan_fp32_config(), extra=LORA, preset="debug-hunyuan")},
                        {"layouts": (4, _rank, (str(folder), str(tmp_path / "export")))})
    reference, lora_reference, results = spawned["reference"], spawned["lora"], spawned["layouts"]

    # Prediction: every layout, every rank, equals diffusers.
    want = diffusers_forward(model, *inputs())
    for rank, out in enumerate(results):
        for tp, pp, sp in LAYOUTS:
            torch.testing.assert_close(out[("predict", tp, pp, sp)], want,
                                       msg=lambda m: f"tp={tp} pp={pp} sp={sp} rank {rank}: {m}")

    # Gradients at tp 2 equal diffusers' (names through the released format's map).
    cfg = load_config("debug-hunyuan", overrides(folder))
    model.zero_grad()
    target = torch.randn(inputs()[0].shape, generator=torch.Generator().manual_seed(3))
    torch.nn.functional.mse_loss(DIFFUSERS.reference_call(model, inputs(), {}), target).backward()
    assert_grads_match(results[0]["grads"], cfg.model, {n: p.grad for n, p in model.named_parameters()})

    # One block's forward at tp 2: dual, the text and video outputs of attention and of the FFNs (B x L x H and
    # B x S x H each); single, its one [attention; MLP] output over all B x (L + S) tokens.
    b, text, video, hid = 2, 8, 72, 64
    assert results[0]["all_reduces"] == ([b * text * hid, b * video * hid, b * text * hid, b * video * hid],
                                         [b * (text + video) * hid])

    # Export from tp 2 x pp 2: shards of each stage with an index; from_pretrained gives the original bits.
    assert_export_reads_back(tmp_path / "export", model)

    # Training: tp 2 x pp 2 and sp 2 x dp 2 equal one process, 3 steps.
    for tp, pp, sp, dp in TRAIN_LAYOUTS:
        assert_matches(merge_ranks([r[("train", tp, pp, sp, dp)] for r in results]), reference)
    assert_matches(merge_ranks([r["lora"] for r in results]), lora_reference)
    adapted = [n for n in lora_reference["state"] if n.endswith("lora_B")]
    assert "blocks.3.proj_out.lora_B" in adapted and "blocks.0.to_add_out.lora_B" in adapted
    assert lora_reference["state"]["blocks.3.proj_out.lora_B"].abs().sum() > 0       # the adapters trained
