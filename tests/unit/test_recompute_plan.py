"""The planner's activation line for each recompute option and for bf16 compression against a real fp32
forward of the debug model (pp = 1, micro-batch 2): saved-tensor bytes counted with saved_tensors_hooks
(compressed blocks: what their hooks store), at the tolerance of tests/unit/test_plan.py (5%); and the
search's step-time model orders the options by the FLOPs they repeat."""
from __future__ import annotations

import pytest
import torch

from parallel.experiment.config import load_config
from parallel.plan.memory import plan_memory
from parallel.train.probe import storage_key
from parallel.plan.trace import ActivationTracer
from tests.train_utils import fp32_config

GiB = 2 ** 30
B = 2
OPTIONS = {"block": ["train.recompute.granularity=block"], "attention": ["train.recompute.granularity=attention"],
           "mlp": ["train.recompute.granularity=mlp"],
           "every-2": ["train.recompute.granularity=block", "train.recompute.every=2"],
           "bf16": ["train.activation_compression.dtype=bf16"], "none": []}


def measured_bytes(cfg) -> int:
    """Bytes autograd keeps after one real forward of the model with cfg's options: distinct storages seen by
    an outer saved-tensor hook (parameters and buffers skipped) plus what compressed blocks store."""
    from models.geometry import latent_shape
    from parallel.model.build import build_model
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext
    from parallel.model.recompute import apply_recompute

    seed_all(0)
    bare = cfg.train.model_copy(update={"recompute": None, "activation_compression": None})
    model = build_model(cfg.model_copy(update={"train": bare}), fp32_config(0, False), ParallelContext.single())
    packed = {}

    def on_pack(t, p):          # keeps t alive, so that no later tensor reuses its storage's address (the key)
        if not isinstance(p, torch.Tensor):
            packed.setdefault(storage_key(t), (t, p[0].untyped_storage().nbytes()))
    apply_recompute(model, cfg, on_pack)
    m = cfg.model
    inputs = (torch.randn(B, m.transformer_in_channels, *latent_shape(m, cfg.data)), torch.randint(0, 1000, (B,)),
              torch.randn(B, m.max_text_len, m.text_embed_dim))
    target = torch.randn(B, m.in_channels, *latent_shape(m, cfg.data))
    seen = {}

    def pack(t):
        seen.setdefault(storage_key(t), t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(inputs, target)
    skip = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
    outer = sum(t.untyped_storage().nbytes() for k, t in seen.items() if k not in skip and k not in packed)
    loss.backward()
    return outer + sum(n for _, n in packed.values())


def test_predicted_activations_of_each_option_match_a_real_forward():
    tracer = ActivationTracer(load_config("debug"), torch.float32)
    results = {}
    for name, extra in OPTIONS.items():
        cfg = load_config("debug", [f"train.micro_batch_size={B}", *extra])
        predicted = plan_memory(cfg, fp32_config(0, False), 1, 80 * GiB, tracer).stages[0].lines["activations"]
        measured = measured_bytes(cfg)
        results[name] = measured
        print(f"{name}: measured {measured:,} B predicted {predicted:,} ({predicted / measured - 1:+.2%})")
        assert predicted == pytest.approx(measured, rel=0.05), name
    # Each option keeps less than none; the whole block least; bf16 at most about half (a saved view is packed
    # at its own size, which can be less than the storage it views).
    assert results["block"] < results["every-2"] < results["none"]
    assert results["block"] < min(results["attention"], results["mlp"])
    assert max(results["attention"], results["mlp"]) < results["none"]
    assert 0.3 * results["none"] < results["bf16"] < 0.55 * results["none"]


def test_step_time_model_charges_the_flops_each_option_repeats():
    """Block: 1/3 more block compute (the 4/3 of full checkpointing); attention core and MLP: their share of a
    block's forward FLOPs, counted on the traced block; every 2nd block: half of the block's."""
    from parallel.plan.memory import EngineSettings
    from parallel.plan.search import recompute_fraction

    cfg = load_config("debug")
    tracer = ActivationTracer(cfg, torch.float32)
    eng = EngineSettings.from_ds(fp32_config(0, False), cfg.model.num_layers)
    f = {name: recompute_fraction(load_config("debug", extra), eng, tracer) for name, extra in OPTIONS.items()
         if name != "bf16"}
    print(f)
    assert f["none"] == 0 and f["block"] == 1.0 and f["every-2"] == pytest.approx(f["block"] / 2)
    assert 0 < f["attention"] < f["mlp"] < 0.5
    ckpt = EngineSettings.from_ds(fp32_config(0, True), cfg.model.num_layers)
    assert recompute_fraction(cfg, ckpt, tracer) == 1.0
