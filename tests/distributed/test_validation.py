"""Validation equals serial validation: 7 samples at world sizes 1, 2 and 3, with a pipeline and under
ZeRO-3, give the same bits; fewer samples than replicas finishes; the EMA weights are the ones used.
Every rank function of this module runs in one spawn per world size (1 to 4 ranks: the `spawned` fixture)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.dist_utils import spawn_all
from tests.train_utils import fp32_config
from tests.helpers.validation import VAL, _check_reads, _sample_rank, _validate_rank

FEWER = ["val.num_samples=2", "train.micro_batch_size=1"]      # 2 samples on 4 ranks


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """Validation at 1, 2, 3 and 4 ranks (7 samples, and 2), with the EMA at tp 2 x pp 2, and sample videos at 1
    and 2 ranks (written under `folder`)."""
    folder = tmp_path_factory.mktemp("samples")
    return {"folder": folder, **spawn_all({
        "serial": (1, _validate_rank, ([((1, 1, 1), 0)], [])),
        "world 2": (2, _validate_rank, ([((1, 1, 2), 0), ((1, 2, 1), 0), ((1, 1, 2), 3)], [])),
        "world 3": (3, _validate_rank, ([((1, 1, 3), 1)], ["train.micro_batch_size=1"])),
        "fewer one": (1, _validate_rank, ([((1, 1, 1), 0)], FEWER)),
        "fewer four": (4, _validate_rank, ([((1, 2, 2), 0), ((1, 1, 4), 0)], FEWER)),
        "ema": (4, _ema_rank, (2, 2, 1, 1)),                  # tp, pp, dp, ZeRO stage
        "sample one": (1, _sample_rank, ([((1, 1, 1), 0)], str(folder))),
        "sample two": (2, _sample_rank, ([((1, 1, 2), 0), ((1, 1, 2), 3)], str(folder)))})}


@pytest.fixture(scope="module")
def serial(spawned):
    return spawned["serial"][0][0]["result"]


def _check(results, serial, n, lockstep=False):
    """Same bits as one process; every sample read by exactly one replica (its first pipeline stage).
    Under ZeRO-3 (lockstep) replicas with fewer samples run discarded forwards of sample 0."""
    for r in results:
        assert r["result"] == serial
    _check_reads(results, n, lockstep)


def test_world_sizes_2_and_3_pipeline_and_zero3_equal_one_process(spawned, serial):
    assert set(serial) == {"val_loss", "val_loss_t50", "val_loss_t400", "val_loss_t950"}
    assert serial["val_loss"] == pytest.approx(sum(serial[f"val_loss_t{t}"] for t in (50, 400, 950)) / 3, rel=1e-12)
    by_rank = spawned["world 2"]
    for k in range(3):                  # dp 2 ZeRO-0, pp 2, dp 2 ZeRO-3
        _check([r[k] for r in by_rank], serial, 7, lockstep=k == 2)
    by_rank = spawned["world 3"]
    _check([r[0] for r in by_rank], serial, 7)
    assert sorted(len(r[0]["read"]) for r in by_rank) == [2, 2, 3]       # 7 over 3: no padding


def test_fewer_samples_than_replicas_finishes(spawned):
    """2 samples on 4 ranks (pp 2 x dp 2, and dp 4): replicas without a sample still join the gathers."""
    (one,), by_rank = spawned["fewer one"], spawned["fewer four"]
    for k in range(2):
        _check([r[k] for r in by_rank], one[0]["result"], 2)


def _ema_rank(rank, world_size, tp, pp, dp, stage):
    """Two training steps with FusedEmaAdam, then validation with the EMA weights; the raw weights after."""
    import os
    import sys
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    from parallel.weights.ema import full_ema
    from parallel.train.engine import build_trainer
    from parallel.weights.gather import full_state
    from parallel.train.run import build_val_dataset, training_batches
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.validation.validate import Validator
    from tests.train_utils import experiment

    cfg = experiment(tp, pp, dp, VAL + ["val.use_ema=true"])
    ctx = ParallelContext.build(ParallelDims(tp_size=tp, pp_size=pp, dp_size=dp))
    seed_all(cfg.train.seed)
    trainer = build_trainer(cfg, fp32_config(stage, optimizer="FusedEmaAdam"), ctx)
    batches = training_batches(cfg, ctx)
    for _ in range(2):
        trainer.train_step(batches)
    module, n = trainer.engine.module, cfg.model.num_layers
    before = full_state(module, ctx, n)
    ema = full_state(module, ctx, n, full_ema(trainer.optimizer, trainer.engine.optimizer))
    with_ema = Validator(cfg, trainer, ctx, build_val_dataset(cfg)).run(2)
    after = full_state(module, ctx, n)
    return {"with_ema": with_ema, "raw_kept": all(torch.equal(before[k], after[k]) for k in before),
            "ema": ema, "raw": before}


def _serial_from_weights(weights: dict) -> dict:
    """Validation of the one-process model loaded with `weights` (canonical names), in this process."""
    from models.diffusion import Objective
    from parallel.model.build import layer_specs
    from parallel.distributed.pipeline import SequentialDiT
    from parallel.train.run import build_val_dataset
    from parallel.distributed.topology import ParallelContext
    from parallel.validation.validate import StageForward, validation_loss
    from tests.train_utils import experiment

    cfg = experiment(1, 1, 1, VAL)
    model = SequentialDiT(layer_specs(cfg, ParallelContext.single()))
    model.load_state_dict(weights)
    engine = type("Engine", (), {"module": model, "device": torch.device("cpu")})()
    return validation_loss(StageForward(engine, ParallelContext.single()), build_val_dataset(cfg),
                           Objective(cfg.model.objective), cfg, ParallelContext.single())


def test_validation_with_ema_weights(spawned):
    """val.use_ema at tp 2 x pp 2 (ZeRO-1): the loss is the one-process model's loss with the consolidated EMA
    loaded (which differs from the raw weights' loss), and the raw weights are back in place afterwards."""
    results = spawned["ema"]
    assert all(r["raw_kept"] for r in results)
    merged = {key: {k: v for r in results for k, v in r[key].items()} for key in ("ema", "raw")}   # all stages
    expected, raw = _serial_from_weights(merged["ema"]), _serial_from_weights(merged["raw"])
    assert expected != raw
    for other in results:
        torch.testing.assert_close(other["with_ema"]["val_loss"], expected["val_loss"], rtol=1e-5, atol=0)
    print(json.dumps({"ema": expected["val_loss"], "raw": raw["val_loss"]}))


def test_sample_videos_equal_across_world_sizes(spawned):
    """3 prompts, 4 DDIM steps: the decoded videos of 1 process, dp 2 (prompts split 1 + 2) and dp 2
    under ZeRO-3 are identical arrays; GIF, MP4, labels and index.html are written."""
    from PIL import Image

    (one,), two, tmp_path = spawned["sample one"], spawned["sample two"], spawned["folder"]
    reference = one[0]
    assert sorted(reference) == [0, 1, 2] and two[1] == [{}, {}]       # only the logging rank decodes
    for frames in two[0]:
        assert sorted(frames) == [0, 1, 2]
        for i in frames:
            assert frames[i].dtype == reference[i].dtype and (frames[i] == reference[i]).all()
    assert not (reference[0] == reference[1]).all()              # different prompts, different videos
    for folder in ("tp1pp1dp1z0", "tp1pp1dp2z0", "tp1pp1dp2z3"):
        step = tmp_path / folder / "samples" / "step1"
        for i in range(3):
            with Image.open(step / f"prompt{i}.gif") as gif:
                assert gif.n_frames == reference[i].shape[0] == 3           # 3 latent frames
                assert gif.size == (reference[i].shape[2], reference[i].shape[1])
            assert (step / f"prompt{i}.mp4").stat().st_size > 0
            assert (step / f"prompt{i}.txt").read_text().startswith("class ")
        page = (tmp_path / folder / "index.html").read_text()
        assert all(f"samples/step1/prompt{i}.{ext}" in page for i in range(3) for ext in ("gif", "mp4"))
