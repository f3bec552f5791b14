"""The STDiT3-style family (`debug-stdit`) in gloo ranks: tp = 2 against tp = 1 with its all-reduces
counted, and validation and sampling through a pipeline equal to one process (which tokens each
attention mixes: tests/unit/test_stdit.py). Both rank functions in one spawn of 2 ranks (the `spawned` fixture)."""
import pytest
import torch

from parallel.experiment.config import load_config
from tests.dist_utils import spawn_all
from tests.helpers.stdit import B, S


@pytest.fixture(scope="module")
def spawned():
    return spawn_all({"tp": (2, _tp_rank, ()), "pipeline": (2, _pipeline_rank, ())})


def _tp_rank(rank, world_size):
    import deepspeed

    from parallel.train.data import DiffusionBatches
    from models.diffusion import Objective
    from parallel.distributed import accelerator
    from parallel.distributed.comm import count_comm, gather_shards
    from parallel.model.build import build_model
    from parallel.distributed.replicas import replica_mismatches
    from parallel.train.run import build_dataset
    from parallel.distributed.topology import ParallelContext, ParallelDims

    cfg = load_config("debug-stdit", [f"train.micro_batch_size={B}"])
    inputs, target = next(DiffusionBatches(build_dataset(cfg), Objective("v_prediction"), seed=0, micro_batch=B,
                                           grad_accum=1, dp_rank=0, dp_size=1))
    ctx = ParallelContext.build(ParallelDims(tp_size=2, pp_size=1, dp_size=1))
    deepspeed.init_distributed(dist_backend=accelerator.backend())
    deepspeed.checkpointing.configure(ctx, partition_activations=True)
    ds = {"activation_checkpointing": {"partition_activations": True}}
    runs = {"tp1": (ParallelContext.single(), {}, None), "tp2": (ctx, {}, None),
            "tp2 recompute": (ctx, ds, deepspeed.checkpointing.checkpoint)}
    out = {}
    for name, (c, spec, fn) in runs.items():
        model = build_model(cfg, spec, c, fn)
        with count_comm() as fwd:
            loss = model(inputs, target)
        with count_comm() as bwd:
            loss.backward()
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad
            if getattr(p, "tensor_model_parallel", False) and c.tp_size > 1:
                g = gather_shards(g, c, p.partition_dim, getattr(p, "tp_parts", None))
            grads[n] = g.clone()
        out[name] = {"fwd": fwd.calls, "bwd": bwd.calls, "loss": loss.item(), "grads": grads}
    out["mismatches"] = replica_mismatches(model, ctx)
    return out


def test_tp2_equals_tp1_and_counts_its_all_reduces(spawned):
    """tp = 2 gives the one-process loss and (gathered) gradients, with and without recomputation.
    Per layer (a spatial and a temporal block), forward: 3 row-parallel outputs per block (self-attention,
    cross-attention, MLP) reduce b x S x H; backward: the inputs of the 4 column-parallel layers (QKV,
    cross Q and MLP-in on x, cross KV on the text y, b x L x H) and the q/k RMSNorm weights (2 x head_dim)."""
    results = spawned["tp"]
    layers, hid, d, text = 4, 64, 16, 8
    bsh, blh = B * S * hid, B * text * hid
    per_block_bwd = [("all_reduce", bsh)] * 3 + [("all_reduce", blh), ("all_reduce", 2 * d)]
    for r in results:
        one, two, recompute = r["tp1"], r["tp2"], r["tp2 recompute"]
        assert one["fwd"] == one["bwd"] == []
        assert two["fwd"] == [("all_reduce", bsh)] * (3 * 2 * layers)
        assert sorted(two["bwd"]) == sorted(per_block_bwd * 2 * layers)
        assert recompute["fwd"] == two["fwd"]
        assert sorted(recompute["bwd"]) == sorted(two["bwd"] + two["fwd"])
        torch.testing.assert_close(two["loss"], one["loss"], rtol=1e-6, atol=0)
        assert recompute["loss"] == two["loss"]
        assert two["grads"].keys() == one["grads"].keys()
        for name, grad in one["grads"].items():
            torch.testing.assert_close(two["grads"][name], grad, msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(recompute["grads"][name], two["grads"][name], msg=lambda m: f"{name}: {m}")
        assert r["mismatches"] == []


VAL = ["val.every=1", "val.num_samples=3", "val.timesteps=[50, 950]", "val.num_prompts=2", "val.sample_steps=2"]


def _validate(cfg, engine, ctx):
    from models.diffusion import Objective
    from parallel.train.run import build_val_dataset
    from parallel.validation.validate import StageForward, sample_latents, validation_loss

    forward, dataset, objective = StageForward(engine, ctx), build_val_dataset(cfg), Objective(cfg.model.objective)
    return {"loss": validation_loss(forward, dataset, objective, cfg, ctx),
            "latents": sample_latents(forward, dataset, objective, cfg, ctx)}


def _pipeline_rank(rank, world_size):
    from parallel.train.engine import build_trainer
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from tests.train_utils import experiment, fp32_config

    cfg = experiment(1, 2, 1, VAL, preset="debug-stdit")
    ctx = ParallelContext.build(ParallelDims(tp_size=1, pp_size=2, dp_size=1))
    seed_all(cfg.train.seed)
    return _validate(cfg, build_trainer(cfg, fp32_config(), ctx).engine, ctx)


def test_validation_and_sampling_through_a_pipeline_equal_one_process(spawned):
    """StageForward sends the four stage tensors between pipeline stages: pp = 2 gives the bits of the
    one-process model (built here, same seed), on both stages."""
    from parallel.model.build import layer_specs
    from parallel.distributed.pipeline import SequentialDiT
    from parallel.distributed.topology import ParallelContext
    from tests.train_utils import experiment

    cfg = experiment(1, 1, 1, VAL, preset="debug-stdit")
    model = SequentialDiT(layer_specs(cfg, ParallelContext.single()))
    engine = type("Engine", (), {"module": model, "device": torch.device("cpu")})()
    one = _validate(cfg, engine, ParallelContext.single())
    assert sorted(one["latents"]) == [0, 1] and one["latents"][0].shape == (4, 3, 8, 8)
    for r in spawned["pipeline"]:
        assert r["loss"] == one["loss"]
        for i, latent in one["latents"].items():
            assert torch.equal(r["latents"][i], latent)
