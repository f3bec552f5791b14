"""Selective recomputation and activation compression (parallel/model/recompute.py) in one process: every
recompute option gives the no-checkpointing loss and gradients; compression moves them by a bounded amount;
the checker refuses train.recompute together with the JSON's activation_checkpointing."""
from __future__ import annotations

import pytest
import torch

from parallel.experiment.config import load_config
from tests.train_utils import fp32_config

B = 2
OPTIONS = {"block": ["train.recompute.granularity=block"], "attention": ["train.recompute.granularity=attention"],
           "mlp": ["train.recompute.granularity=mlp"],
           "every-2": ["train.recompute.granularity=block", "train.recompute.every=2"]}


def loss_and_grads(preset: str, extra=(), on_pack=None):
    """Loss and parameter gradients of one fp32 forward/backward of `preset` at micro-batch 2 (fixed inputs)."""
    from models.geometry import latent_shape
    from parallel.model.build import build_model
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext
    from parallel.model.recompute import apply_recompute

    cfg = load_config(preset, [f"train.micro_batch_size={B}", *extra])
    seed_all(cfg.train.seed)
    model = build_model(cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"recompute": None, "activation_compression": None})}), fp32_config(0, False), ParallelContext.single())
    apply_recompute(model, cfg, on_pack)
    m = cfg.model
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(B, m.transformer_in_channels, *latent_shape(m, cfg.data), generator=g)
    inputs = (latents, torch.randint(0, 1000, (B,), generator=g), torch.randn(B, m.max_text_len, m.text_embed_dim,
                                                                                generator=g))
    target = torch.randn(B, m.in_channels, *latent_shape(m, cfg.data), generator=g)
    loss = model(inputs, target)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset", ["debug", "debug-wan", "debug-stdit"])
def test_every_recompute_option_equals_no_checkpointing(preset):
    """Each family's own parts (attention core, MLP); whole blocks and every-k, family-independent, on debug."""
    ref_loss, ref_grads = loss_and_grads(preset)
    for option, extra in OPTIONS.items():
        if preset != "debug" and option in ("block", "every-2"):
            continue
        loss, grads = loss_and_grads(preset, extra)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0, msg=lambda m: f"{option}: {m}")
        assert grads.keys() == ref_grads.keys()
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, msg=lambda m: f"{option} {name}: {m}")


def test_compression_moves_loss_and_gradients_by_a_bounded_amount():
    """bf16 storage of fp32 activations: the loss is computed forward in fp32 and so is unchanged; the
    gradients' relative error stays under 1% (bf16 rounds at 2^-9 = 0.2%); fp8 e4m3 (2^-4 = 6%) under 15%.
    Every saved activation of the blocks is packed, at half (bf16) or a quarter (fp8) of its bytes."""
    ref_loss, ref_grads = loss_and_grads("debug")
    for dtype, bound, ratio in (("bf16", 0.01, 2), ("fp8", 0.15, 4)):
        packed = {}
        loss, grads = loss_and_grads("debug", [f"train.activation_compression.dtype={dtype}"],
                                     lambda t, p: packed.setdefault(id(t), (t, p)))
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        flat = torch.cat([g.flatten() for g in grads.values()])
        ref = torch.cat([g.flatten() for g in ref_grads.values()])
        err = ((flat - ref).norm() / ref.norm()).item()
        print(f"{dtype}: gradient relative error {err:.2e}")
        assert 0 < err < bound
        squeezed = [(t, p) for t, p in packed.values() if not isinstance(p, torch.Tensor)]
        assert squeezed and all(p[0].element_size() * ratio == t.element_size() for t, p in squeezed)


def test_recompute_and_json_checkpointing_are_refused_together():
    from parallel.check import check

    cfg = load_config("debug", ["train.recompute.granularity=mlp"])
    _, problems = check(cfg, fp32_config(0, True), "ds_configs/zero0_fp32.json", 1)
    assert any("train.recompute=" in p and "ds_configs/zero0_fp32.json: activation_checkpointing" in p
               for p in problems), problems
    _, problems = check(cfg, fp32_config(0, False), "ds_configs/zero0_fp32.json", 1)
    assert problems == []
