"""parallel/distributed/deepspeed/bf16.py's lighter BF16_Optimizer step changes no number: bf16 ZeRO-1 with fp32
gradient accumulation (two micro-batches), clipping that bites and the EMA, trained with and without it in one
spawn of one process each, give bit-identical losses, weights and EMA shadows."""
import json

import torch

from tests.train_utils import Run, _train_rank, train_all


def _train_unpatched(rank, world_size, *args):
    import parallel.train.engine as engine
    patch, engine.lighter_bf16_step = engine.lighter_bf16_step, lambda _: False   # DeepSpeed's own step
    try:
        return _train_rank(rank, world_size, *args)
    finally:
        engine.lighter_bf16_step = patch


def test_lighter_step_is_bit_identical():
    ds = json.load(open("ds_configs/zero1_bf16.json"))
    ds["gradient_clipping"] = 0.05                      # below the debug model's gradient norm: every step clips
    ds["optimizer"]["type"] = "FusedEmaAdam"            # AdamW and the EMA
    run = Run(1, 1, 1, ds, steps=3)
    runs = train_all({"patched": run}, {"unpatched": (1, _train_unpatched, run)})
    got, (want,) = runs["patched"], runs["unpatched"]
    assert got["losses"] == want["losses"]
    assert got["state"].keys() == want["state"].keys() and got["ema"].keys() == want["ema"].keys()
    for name in got["state"]:
        assert torch.equal(got["state"][name], want["state"][name]), name
    for name in got["ema"]:
        assert torch.equal(got["ema"][name], want["ema"][name]), name
    assert want["losses"][0] != want["losses"][-1]      # it trained
