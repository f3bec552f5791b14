"""The DiT at tp=2: all-reduces counted per block, recomputation's extra ones, and the replica checks (bitwise, and
by CRC-32 as the layout-free copy checks its buffers)."""
import torch

from tests.dist_utils import run_ranks

B = 2


def _rank(rank, world_size):
    import deepspeed

    from parallel.train.data import DiffusionBatches
    from models.diffusion import Objective
    from parallel.distributed import accelerator
    from parallel.distributed.comm import count_comm
    from parallel.experiment.config import load_config
    from parallel.model.build import build_model
    from parallel.distributed.replicas import checksum_mismatches, replica_mismatches
    from parallel.train.run import build_dataset
    from parallel.distributed.topology import ParallelContext, ParallelDims

    cfg = load_config("debug", ["parallel.tp_size=2", f"train.micro_batch_size={B}"])
    ctx = ParallelContext.build(ParallelDims(tp_size=2, pp_size=1, dp_size=1))
    inputs, target = next(DiffusionBatches(build_dataset(cfg), Objective("v_prediction"), seed=0, micro_batch=B,
                                           grad_accum=1, dp_rank=0, dp_size=1))
    deepspeed.init_distributed(dist_backend=accelerator.backend())
    ds = {"activation_checkpointing": {"partition_activations": True}}
    deepspeed.checkpointing.configure(ctx, partition_activations=True)
    out = {}
    for name, (spec, fn) in {"plain": ({}, None), "recompute": (ds, deepspeed.checkpointing.checkpoint)}.items():
        model = build_model(cfg, spec, ctx, fn)
        with count_comm() as fwd:
            loss = model(inputs, target)
        with count_comm() as bwd:
            loss.backward()
        out[name] = {"fwd": fwd.calls, "bwd": bwd.calls, "loss": loss.item(),
                     "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    replicated = lambda: ((n, p) for n, p in model.named_parameters() if not getattr(p, "tensor_model_parallel", False))
    assert replica_mismatches(model, ctx) == [] and checksum_mismatches(replicated(), ctx) == set()
    with torch.no_grad():
        if rank == 1:
            model.blocks[2].norm2.norm.weight.add_(1e-7)
    out["drift"] = replica_mismatches(model, ctx)
    out["crc_drift"] = checksum_mismatches(replicated(), ctx)
    return out


def test_allreduce_count_per_block_and_recompute():
    results = run_ranks(_rank, 2)
    layers, s, h, d = 4, 8 + 48, 64, 16            # debug: 8 text + 3 x 4 x 4 video tokens
    bsh = B * s * h
    for r in results:
        plain, recompute = r["plain"], r["recompute"]
        # Forward: attention-out and FFN-out (row-parallel) reduce b x s x h each, per block.
        assert plain["fwd"] == [("all_reduce", bsh)] * (2 * layers)
        # Backward: the inputs of QKV and FFN-in (column-parallel) reduce their gradient, plus one
        # 3 x head_dim reduce of the q/k norm parameters' partial gradients.
        assert sorted(plain["bwd"]) == sorted([("all_reduce", bsh)] * (2 * layers) + [("all_reduce", 3 * d)] * layers)
        # Full recompute: the forward's 2 per block again, inside backward.
        assert recompute["fwd"] == plain["fwd"]
        assert sorted(recompute["bwd"]) == sorted(plain["bwd"] + [("all_reduce", bsh)] * (2 * layers))
        assert recompute["loss"] == plain["loss"]
        for name, grad in plain["grads"].items():
            torch.testing.assert_close(recompute["grads"][name], grad, msg=lambda m: f"{name}: {m}")
    assert results[0]["drift"] == results[1]["drift"] == ["blocks.2.norm2.norm.weight"]
    assert results[0]["crc_drift"] == results[1]["crc_drift"] == {"blocks.2.norm2.norm.weight"}
