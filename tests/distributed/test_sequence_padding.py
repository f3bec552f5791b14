"""Sequence parallelism on a token count sp does not divide: padded, and equal to one process (fp32).

Both families at 12 heads (divisible by 3 and 4) on 5 frames of 80 x 80 pixels: 2 latent frames of
5 x 5 patches, 50 video tokens. CogVideoX's sequence is 8 text + 50 video = 58 tokens (padded to 60 at
sp 3 and sp 4), STDiT's the 50 video tokens (padded to 51 at sp 3, 52 at sp 4). One spawn per world
size (1, 3 and 4 ranks: the `spawned` fixture) runs every case against the same process's serial model, and
trains through DeepSpeed's engine (the sp ranks as its data axis) to one process's losses and weights.
"""
import pytest
import torch

from tests.helpers.sequence_parallel import sp_config
from tests.train_utils import Run, assert_matches, train_all

B = 2
SHAPE = ("model.num_heads=12", "model.head_dim=16", "model.hidden_size=192",
         "data.num_frames=5", "data.height=80", "data.width=80")
# name -> (preset, extra overrides, sequence tokens)
CASES = {"debug": ("debug", (), 58), "debug rope": ("debug", ("model.pos_embed=rope3d",), 58),
         "debug-stdit": ("debug-stdit", (), 50)}


def _rank(rank, world_size):
    import deepspeed

    from models.diffusion import Objective
    from parallel.model.build import build_model
    from parallel.experiment.config import load_config
    from parallel.distributed import accelerator
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.data import DiffusionBatches
    from parallel.train.run import build_dataset

    sp = world_size
    deepspeed.init_distributed(dist_backend=accelerator.backend())
    ctx = ParallelContext.build(ParallelDims(tp_size=1, sp_size=sp, pp_size=1, dp_size=1))
    deepspeed.checkpointing.configure(ctx, partition_activations=False)
    out = {}
    for name, (preset, extra, _) in CASES.items():
        cfg = load_config(preset, [f"train.micro_batch_size={B}", f"parallel.sp_size={sp}", *SHAPE, *extra])
        inputs, target = next(DiffusionBatches(build_dataset(cfg), Objective("v_prediction"), seed=0, micro_batch=B,
                                               grad_accum=1, dp_rank=0, dp_size=1))
        serial = build_model(cfg, {}, ParallelContext.single())
        serial_loss = serial(inputs, target)
        serial_loss.backward()
        case = {"serial": {"loss": serial_loss.item(), "prediction": serial.predict(inputs).detach(),
                           "grads": {n: p.grad for n, p in serial.named_parameters()}}}
        runs = {"plain": ({}, None), "recompute": ({"activation_checkpointing": {}}, deepspeed.checkpointing.checkpoint)}
        for run, (ds, fn) in runs.items():
            model = build_model(cfg, ds, ctx, fn)
            loss = model(inputs, target)
            loss.backward()
            # DeepSpeed averages the sp ranks' losses and gradients (they are its data axis).
            mean_loss = loss.detach().clone()
            torch.distributed.all_reduce(mean_loss, group=ctx.sp_group)
            grads = {}
            for n, p in model.named_parameters():
                g = p.grad.clone()
                torch.distributed.all_reduce(g, group=ctx.sp_group)
                grads[n] = g / sp
            with torch.no_grad():
                local = model.predict(inputs)
            case[run] = {"loss": mean_loss.item() / sp, "grads": grads, "local_rows": local.shape[1],
                         "prediction": model.final.assemble(local)}
        out[name] = case
    return out


# (preset, sp, ZeRO stage): DeepSpeed averages the padded ranks' losses and gradients (ZeRO-2 shards over them).
TRAINED = [("debug", 3, 0), ("debug-stdit", 4, 2)]


@pytest.fixture(scope="module")
def spawned():
    """Every case at sp 3 and sp 4; each TRAINED run and its one-process reference."""
    return train_all({**{(preset, sp, stage): Run(1, 1, 1, sp_config(stage), sp=sp, extra=SHAPE, preset=preset)
                         for preset, sp, stage in TRAINED},
                      **{preset: Run(1, 1, 1, sp_config(), extra=SHAPE, preset=preset) for preset, _, _ in TRAINED}},
                     {("cases", sp): (sp, _rank, ()) for sp in (3, 4)})


@pytest.mark.parametrize("sp", [3, 4])
def test_padded_sequence_matches_one_process(spawned, sp):
    """sp 3 and sp 4 on 58 (CogVideoX, with and without 3D RoPE) and 50 (STDiT) tokens: each rank holds
    S_pad / sp rows; the assembled prediction, the sp ranks' mean loss and mean parameter gradients equal
    one process's, with and without activation recomputation."""
    results = spawned["cases", sp]
    for name, (_, _, tokens) in CASES.items():
        assert tokens % sp, "the case must need padding"
        for r in results:
            case = r[name]
            serial = case["serial"]
            for run in ("plain", "recompute"):
                got = case[run]
                assert got["local_rows"] == -(-tokens // sp), (name, run)
                torch.testing.assert_close(got["prediction"], serial["prediction"], msg=lambda m: f"{name} {run}: {m}")
                torch.testing.assert_close(got["loss"], serial["loss"], msg=lambda m: f"{name} {run}: {m}")
                assert got["grads"].keys() == serial["grads"].keys()
                for n, grad in serial["grads"].items():
                    torch.testing.assert_close(got["grads"][n], grad, msg=lambda m: f"{name} {run} {n}: {m}")


@pytest.mark.parametrize("preset, sp, stage", TRAINED, ids=[f"{p}-sp{s}-zero{z}" for p, s, z in TRAINED])
def test_padded_sequence_trains_like_one_process(spawned, preset, sp, stage):
    assert_matches(spawned[preset, sp, stage], spawned[preset])
