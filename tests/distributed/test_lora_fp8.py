"""model.lora.base_dtype: float8_e4m3fn at tp 2 (2 gloo ranks) against one process.

The scale is over the full weight (s = amax|W| / 448, the shards' amax all-reduced), so tp 2 quantises as tp 1
does. Checked: every rank's fp8 weight is the slice of the one-process model's fp8 weight and its scale the
one-process scale, bit for bit; the debug model's prediction at tp 2 equals the one-process fp8 model's (fp32). And
deepspeed.initialize under ZeRO-1 bf16 leaves the fp8 weights and fp32 scales as they are and steps the adapters only.
"""
from __future__ import annotations

import torch

from parallel.model.build import build_model
from parallel.experiment.config import load_config
from parallel.distributed.topology import ParallelContext, ParallelDims
from parallel.model.lora import apply_fp8_base, tp_linears
from parallel.distributed.layers import ColumnParallelLinear
from tests.dist_utils import run_ranks

ARGS = ["model.lora.rank=4", "model.lora.base_dtype=float8_e4m3fn"]
TP = 2


def _inputs(cfg):
    g = torch.Generator().manual_seed(9)
    m = cfg.model
    latent = torch.randn(2, m.in_channels, (cfg.data.num_frames - 1) // 4 + 1, cfg.data.height // 8,
                         cfg.data.width // 8, generator=g)
    return latent, torch.tensor([10, 700]), torch.randn(2, m.max_text_len, m.text_embed_dim, generator=g)


def _build(cfg, ctx):
    torch.manual_seed(1)
    model = build_model(cfg, {}, ctx)
    for name, layer in tp_linears(model, cfg.model.num_layers):
        if layer.lora_B is None:
            continue
        column = isinstance(layer, ColumnParallelLinear)     # B split like the weight's rows; else replicated
        rows = sum(layer.lora_B.tp_parts) * ctx.tp_size if column else layer.lora_B.shape[0]
        full = torch.randn(rows, layer.lora_B.shape[1], generator=torch.Generator().manual_seed(len(name)))
        layer.lora_B.data.copy_(_shard(full, layer.lora_B.tp_parts, ctx.tp_size, ctx.tp_rank, 0) if column else full)
    return model


def _shard(full, local_parts, p, r, dim):
    """Rank r's slice of each fused part (local sizes `local_parts`) along dim, concatenated."""
    pieces = full.split([n * p for n in local_parts], dim=dim)
    return torch.cat([piece.narrow(dim, r * n, n) for piece, n in zip(pieces, local_parts)], dim=dim)


def _rank(rank, world_size):
    cfg = load_config("debug", ARGS + [f"parallel.tp_size={TP}"])
    ctx = ParallelContext.build(ParallelDims(tp_size=TP, pp_size=1, dp_size=world_size // TP))
    model = _build(cfg, ctx)
    apply_fp8_base(model, cfg.model)
    weights = {n: (layer.weight.clone(), layer.weight_scale.clone())
               for n, layer in tp_linears(model, cfg.model.num_layers)}
    with torch.no_grad():
        return {"weights": weights, "prediction": model.predict(_inputs(cfg))}


def test_tp2_fp8_base_is_the_slices_of_the_one_process_fp8_base():
    ranks = run_ranks(_rank, TP)
    cfg = load_config("debug", ARGS)
    one = _build(cfg, ParallelContext.single())
    full = {name: layer.weight.detach().clone() for name, layer in tp_linears(one, cfg.model.num_layers)}
    apply_fp8_base(one, cfg.model)
    per_shard = 0                                        # layers a shard's own amax would scale differently
    for name, layer in tp_linears(one, cfg.model.num_layers):
        column = isinstance(layer, ColumnParallelLinear)
        local = [n // TP for n in layer.parts] if column else [layer.in_features // TP]
        w8 = layer.weight.view(torch.uint8)                # the fp8 codes, compared as bytes
        for r, out in enumerate(ranks):
            got, scale = out["weights"][name]
            assert got.dtype == torch.float8_e4m3fn
            assert torch.equal(got.view(torch.uint8), _shard(w8, local, TP, r, 0 if column else 1)), f"rank {r} {name}"
            assert scale.item() == layer.weight_scale.item(), f"rank {r} {name}"
        shards = [_shard(full[name], local, TP, r, 0 if column else 1) for r in range(TP)]
        per_shard += any(sh.abs().max() != full[name].abs().max() for sh in shards)
    assert per_shard > 0
    with torch.no_grad():
        want = one.predict(_inputs(cfg))
    for r, out in enumerate(ranks):
        torch.testing.assert_close(out["prediction"], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {r}: {m}")


def _engine(rank, world_size):
    import json
    from pathlib import Path

    from parallel.train.engine import build_trainer
    ds = json.loads((Path(__file__).resolve().parents[2] / "ds_configs/zero1_bf16.json").read_text())
    cfg = load_config("debug", ARGS)
    trainer = build_trainer(cfg, ds, ParallelContext.build(ParallelDims()))
    module = trainer.engine.module
    stepped = {id(p) for group in trainer.engine.optimizer.param_groups for p in group["params"]}
    return {"buffers": {n: b.dtype for n, b in module.named_buffers() if n.endswith(("weight", "weight_scale"))},
            "linears": [n for n, _ in tp_linears(module, cfg.model.num_layers)],
            "params": {n: (p.dtype, id(p) in stepped or p.requires_grad) for n, p in module.named_parameters()}}


def test_deepspeed_bf16_keeps_the_fp8_base_and_steps_the_adapters_only():
    """deepspeed.initialize (ZeRO-1 bf16) casts parameters to bf16 and leaves the fp8 buffers and fp32 scales."""
    out = run_ranks(_engine, 1)[0]
    linears = out["linears"]
    assert linears and set(out["buffers"]) == {f"{n}.{leaf}" for n in linears for leaf in ("weight", "weight_scale")}
    for name, dtype in out["buffers"].items():
        assert dtype == (torch.float32 if name.endswith("scale") else torch.float8_e4m3fn), name
    for name, (dtype, trained) in out["params"].items():
        assert dtype == torch.bfloat16 and trained == name.endswith(("lora_A", "lora_B")), name
