"""parallel/distributed/deepspeed/bf16.py's lighter BF16_Optimizer step changes no number: bf16 ZeRO-1 with fp32
gradient accumulation (two micro-batches), clipping that bites and the EMA, trained with and without it, give
bit-identical losses, weights and EMA shadows: one process (where the one-rank reduction applies) and pp 2 x dp 2
(the pipeline engine's BF16_Optimizer, DeepSpeed's own reduction over two replicas)."""
import json

import torch

from tests.train_utils import Run, _merged, _train_rank, train_all


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
    one, split = Run(1, 1, 1, ds, steps=3), Run(1, 2, 2, ds, steps=3)
    runs = train_all({"one": one, "split": split},
                     {"one unpatched": (1, _train_unpatched, one), "split unpatched": (4, _train_unpatched, split)})
    for name in ("one", "split"):
        got, want = runs[name], _merged(runs[f"{name} unpatched"])
        assert got["losses"] == want["losses"], name
        assert got["state"].keys() == want["state"].keys() and got["ema"].keys() == want["ema"].keys()
        for key in got["state"]:
            assert torch.equal(got["state"][key], want["state"][key]), (name, key)
        for key in got["ema"]:
            assert torch.equal(got["ema"][key], want["ema"][key]), (name, key)
        assert want["losses"][0] != want["losses"][-1]      # it trained
