"""A LoRA run from released weights checkpoints its adapters without the frozen base (parallel/checkpoints/lora_base.py)
and resumes over the base read again from the release: 3 steps, a checkpoint, 3 more, into a model built from another
seed, against steps 4-6 of the run that wrote it (fp32 tolerance, as tests/distributed/test_relayout.py) and its final
full weights (the base bit for bit).

Cases, (before, after) layouts: the same layout through DeepSpeed's files at ZeRO-1, at ZeRO-3 (dp 2) and in the
pipeline engine's per-layer files (pp 2); another layout through the layout-free copy (tp 1 -> tp 2); the fp8 base
(model.lora.base_dtype) at tp 2 (its codes and scales are buffers: left out too) and from there to tp 1 x pp 2. Each
checkpoint holds no tensor of the base (DeepSpeed's module states and the layout-free copy read back), its size is
what predicted_bytes said (within 5 %, or the few KiB of small files it leaves out), and it is a fraction of the one ckpt.lora_base=copy writes. A release whose
bytes changed since the run read it (a flipped byte, the same size) is refused by name before any weight is loaded.
The released model: tests/helpers/released_weights.py's sharded CogVideoX (several files to fingerprint).
"""
import shutil
from pathlib import Path

import pytest
import torch

from tests.dist_utils import spawn_all
from tests.helpers.released_weights import overrides, released  # noqa: F401  (fixture)
from tests.helpers.lora_resume import assert_continues, merged
from tests.train_utils import fp32_config

POS = "sincos"
LORA = ("model.lora.rank=4", "model.lora.targets=[to_q,to_k,to_v,to_out.0]")
FP8 = (*LORA, "model.lora.base_dtype=float8_e4m3fn")
SCHEDULE = ("train.warmup_steps=2", "train.max_steps=6", "train.grad_accum_steps=2")
#          before (tp, pp, dp, ZeRO), after, the model's keys
CASES = {"zero1-same": ((1, 1, 1, 1), (1, 1, 1, 1), LORA),
         "zero3-dp2-same": ((1, 1, 2, 3), (1, 1, 2, 3), LORA),
         "pp2-same": ((1, 2, 1, 0), (1, 2, 1, 0), LORA),
         "tp1_to_tp2": ((1, 1, 1, 1), (2, 1, 1, 1), LORA),
         "fp8-tp2-same": ((2, 1, 1, 1), (2, 1, 1, 1), FP8),
         "fp8-tp2_to_tp1-pp2": ((2, 1, 1, 1), (1, 2, 1, 0), FP8)}


def _config(layout, keys, folder, tmp, extra=()):
    from parallel.experiment.config import load_config
    tp, pp, dp, _ = layout
    return load_config("debug", [*overrides(POS, folder), f"parallel.tp_size={tp}", f"parallel.pp_size={pp}",
                                 f"train.micro_batch_size={2 // dp}", *SCHEDULE, *keys, f"ckpt.dir={tmp}", *extra])


def _train(rank, world_size, layout, keys, folder, tmp, save_at=None, resume=None, extra=()):
    """Train `layout` to step 6 from the release in `folder`, saving after `save_at`, or from checkpoint `resume` in a
    model built from seed 99 (its base from the release again); this rank's losses, full weights, the checkpoint's
    predicted bytes."""
    from parallel.checkpoints import checkpoint, lora_base
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches
    from parallel.weights.gather import full_state

    tp, pp, dp, stage = layout
    cfg = _config(layout, keys, folder, tmp, extra)
    ctx = ParallelContext.build(ParallelDims(tp_size=tp, pp_size=pp, dp_size=dp))
    seed_all(cfg.train.seed)
    built = _config(layout, keys, folder, tmp, (*extra, "train.seed=99")) if resume else cfg
    ds = fp32_config(stage, checkpointing=False, optimizer="FusedEmaAdam")
    if resume:
        layout_now = {**ctx.dims.as_dict(), "zero_stage": stage}
        tag = checkpoint.verified_resume(Path(tmp), layout_now, release=cfg.model.init_from, step=int(resume[4:]))
        trainer = build_trainer(built, ds, ctx, init_from=False, base=lora_base.source(Path(tmp) / tag, folder))
        start = trainer.load(tmp, tag)
    else:
        trainer, start = build_trainer(built, ds, ctx), 0
    batches = training_batches(cfg, ctx, start_step=start)
    losses, record = [], {}
    for step in range(start, 6):
        losses.append(trainer.train_step(batches).loss)
        if step + 1 == save_at:
            if trainer.release:
                record = {lora_base.KEY: lora_base.fingerprint(cfg.model, trainer.release)}
            predicted = _predicted(trainer, ctx, ds)
            checkpoint.save(trainer, Path(tmp), step + 1, keep=1, layout=trainer.layout(), extra=record,
                            predicted=predicted)
    return {"losses": losses, "start": start, "state": full_state(trainer.engine.module, ctx, cfg.model.num_layers)}


def _predicted(trainer, ctx, ds) -> int:
    """The Trainer's predict_checkpoint on this engine."""
    import types

    from parallel.train.trainer import Trainer
    fake = types.SimpleNamespace(engine=trainer, ctx=ctx, ds=ds, cfg=trainer.cfg,
                                 layout=types.SimpleNamespace(precision="fp32"))
    return Trainer.predict_checkpoint(fake)


def _refused(rank, world_size, folder, tmp):
    """The error resuming zero1-same's checkpoint over a release with one flipped byte raises on this rank."""
    try:
        _train(rank, world_size, CASES["zero1-same"][1], LORA, folder, tmp, resume="step3")
    except ValueError as e:
        return str(e)
    return None


def _close(written: int, predicted: int) -> bool:
    """predicted_bytes' tolerance: 5 %, or the small files it leaves out (pickling, the generator states, the
    markers: tens of KiB, most of a checkpoint of the debug model's few adapters)."""
    return abs(written / predicted - 1) < 0.05 or 0 <= written - predicted < 64 << 10


@pytest.fixture(scope="module")
def runs(released, tmp_path_factory):  # noqa: F811  (the fixture)
    root = tmp_path_factory.mktemp("lora_base")
    folder = str(released[POS][0])
    flipped = root / "flipped"
    shutil.copytree(folder, flipped)
    shard = sorted(flipped.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01                                            # a weight's low bits: the same size, other bytes
    shard.write_bytes(bytes(data))
    calls = {}
    for name, (before, after, keys) in CASES.items():
        calls[f"{name}/reference"] = (before[0] * before[1] * before[2], _train,
                                      (before, keys, folder, f"{root}/{name}", 3))
    calls["copy/reference"] = (1, _train, ((1, 1, 1, 1), LORA, folder, f"{root}/copy", 3, None,
                                           ("ckpt.lora_base=copy",)))
    for name, (before, after, keys) in CASES.items():       # after every reference: spawn_all keeps the order
        calls[f"{name}/resumed"] = (after[0] * after[1] * after[2], _train,
                                    (after, keys, folder, f"{root}/{name}", None, "step3"))
    calls["refused"] = (1, _refused, (str(flipped), f"{root}/zero1-same"))
    out = {name: ranks if name == "refused" else merged(ranks)
           for name, ranks in spawn_all(calls, seconds_each=60).items()}
    return out, root, shard


@pytest.mark.parametrize("name", list(CASES))
def test_lora_resumed_over_the_release_continues_the_uninterrupted_run(runs, name):
    runs, _, _ = runs
    assert_continues(runs[f"{name}/reference"], runs[f"{name}/resumed"])


@pytest.mark.parametrize("name", list(CASES))
def test_the_checkpoint_holds_no_tensor_of_the_base(runs, name):
    from safetensors import safe_open

    from parallel.checkpoints.checkpoint import MARKER, folder_bytes
    import json
    _, root, _ = runs
    folder = root / name / "step3"
    marker = json.loads((folder / MARKER).read_text())
    assert marker["lora_base"]["files"] and all(len(v) == 2 for v in marker["lora_base"]["files"].values())
    names = set()
    for path in (folder / "layout_free").glob("rank*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names |= {k.split("::")[0] for k in f.keys()}
    assert names and all(n.endswith(("lora_A", "lora_B")) for n in names), sorted(names)
    for path in folder.glob("*model_states.pt"):
        module = torch.load(path, weights_only=False, map_location="cpu").get("module") or {}
        held = [k for k, v in module.items() if torch.is_tensor(v) and v.numel() and "lora_" not in k]
        assert not held, (path.name, held)
    written, predicted, copy = folder_bytes(folder), marker["predicted_bytes"], folder_bytes(root / "copy" / "step3")
    print(f"\n{name}: predicted {predicted} B, written {written} B ({written / predicted - 1:+.2%}); "
          f"with the base (ckpt.lora_base=copy, tp 1 ZeRO-1) {copy} B")
    assert _close(written, predicted), (predicted, written)
    assert written < copy / 3           # the debug model's adapters are large beside its base: a release's are not


def test_the_copy_policy_checkpoint_holds_the_base_and_its_size_is_predicted(runs):
    import json

    from parallel.checkpoints.checkpoint import MARKER, folder_bytes
    _, root, _ = runs
    folder = root / "copy" / "step3"
    marker = json.loads((folder / MARKER).read_text())
    assert "lora_base" not in marker
    written, predicted = folder_bytes(folder), marker["predicted_bytes"]
    assert _close(written, predicted), (predicted, written)


def test_a_release_with_other_bytes_is_refused_by_name(runs):
    runs, _, shard = runs
    for message in runs["refused"]:
        assert message is not None
        assert "holds a LoRA run's adapters and their optimizer states, not its frozen base" in message
        assert f"{shard} has crc32" in message and "another release" in message, message
        assert "Set model.init_from to that release" in message
