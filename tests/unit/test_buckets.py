"""Buckets in one process: the step -> bucket schedule, the model at a step's shape, `prepare_data --buckets`.

The layouts against one process: tests/distributed/test_bucket_layouts.py.
"""
import json
from collections import Counter

import pytest
import torch

from models.geometry import token_grid
from parallel.model.build import build_model
from parallel.experiment.config import load_config
from parallel.distributed.topology import ParallelContext
from parallel.experiment.shapes import choose_bucket, parse_shapes
from parallel.train.buckets import BucketSchedule
from parallel.train.data import DiffusionBatches, DirectoryLatents, check_shapes
from models.diffusion import Objective
from tests.buckets_utils import PER_BUCKET, SHAPES, write_buckets
from tests.helpers.prepare_data import run, squares, vae_dir, write_video  # noqa: F401  (fixture)

SHAPES_OF = [SHAPES[i % 3] for i in range(12)] + [None] * 6       # sizes 4, 4, 4 and 6 (the config's shape)


def test_bucket_of_a_step_is_a_function_of_seed_and_step():
    """Two schedules (two ranks, or a resumed run) agree step by step; another seed gives another sequence;
    bucket frequencies follow the bucket sizes."""
    a, b = BucketSchedule(SHAPES_OF, 18, seed=7, global_batch=4), BucketSchedule(SHAPES_OF, 18, seed=7, global_batch=4)
    seq = [a.bucket(s) for s in range(3000)]
    assert seq == [b.bucket(s) for s in range(3000)]
    assert seq != [BucketSchedule(SHAPES_OF, 18, seed=8, global_batch=4).bucket(s) for s in range(3000)]
    counts = Counter(a.keys[k] for k in seq)
    for key, n in counts.items():
        share = (6 if key is None else 4) / 18
        assert abs(n / 3000 - share) < 0.03, (key, n)


def test_each_bucket_walks_its_own_samples_and_resume_needs_only_the_step():
    """A step's samples all have its bucket's shape; each bucket's samples come once per epoch of that
    bucket; a schedule asked first at step 40 (a resume) gives the samples a fresh one gives there."""
    sched = BucketSchedule(SHAPES_OF, 18, seed=3, global_batch=2)
    seen: dict = {}
    for step in range(60):
        key = sched.keys[sched.bucket(step)]
        picks = [sched.sample(step, j) for j in range(2)]
        assert {SHAPES_OF[i] for i in picks} == {key}
        seen.setdefault(key, []).extend(picks)
    for key, picks in seen.items():
        size = SHAPES_OF.count(key)
        for e in range(len(picks) // size):
            assert sorted(picks[e * size:(e + 1) * size]) == sorted(i for i, s in enumerate(SHAPES_OF) if s == key)
    resumed = BucketSchedule(SHAPES_OF, 18, seed=3, global_batch=2)
    assert [resumed.sample(s, j) for s in range(40, 60) for j in range(2)] == \
        [sched.sample(s, j) for s in range(40, 60) for j in range(2)]


def test_one_shape_is_the_plain_walk():
    """Without shapes in the manifest the schedule is the single-bucket walk of every sample, epoch by epoch."""
    sched = BucketSchedule(None, 10, seed=1, global_batch=4)
    picks = [sched.sample(s, j) for s in range(5) for j in range(4)]
    assert sorted(picks[:10]) == list(range(10)) and sorted(picks[10:20]) == list(range(10))


MODEL_CASES = [("debug", (), SHAPES[1]), ("debug", ("model.pos_embed=rope3d",), SHAPES[1]),
               ("debug-stdit", (), SHAPES[2]), ("debug-wan", (), SHAPES[1]), ("debug-hunyuan", (), SHAPES[1])]


@pytest.mark.parametrize("preset, extra, shape", MODEL_CASES, ids=["sincos", "rope3d", "stdit", "wan", "hunyuanvideo"])
def test_model_at_a_step_shape_equals_one_built_for_it(preset, extra, shape):
    """The stages built at the config's shape and set to a bucket's grid predict what stages built for
    that shape predict (position tables, token counts and unpatchify follow the step's grid)."""
    cfg = load_config(preset, list(extra))
    other = load_config(preset, [*extra, f"data.num_frames={shape[0]}", f"data.height={shape[1]}",
                                 f"data.width={shape[2]}"])
    built, native = build_model(cfg, {}, ParallelContext.single()), build_model(other, {}, ParallelContext.single())
    latent = torch.randn(2, cfg.model.in_channels, (shape[0] - 1) // 4 + 1, shape[1] // 8, shape[2] // 8)
    inputs = (latent, torch.tensor([10, 700]), torch.randn(2, cfg.model.max_text_len, cfg.model.text_embed_dim))
    built.step_grid.set_latent(latent.shape[2:])
    assert tuple(built.step_grid) == token_grid(other.model, other.data)
    with torch.no_grad():
        torch.testing.assert_close(built.predict(inputs), native.predict(inputs))


def test_batches_follow_the_step_bucket(tmp_path):
    write_buckets(tmp_path)
    data = DirectoryLatents(tmp_path)
    batches = DiffusionBatches(data, Objective("v_prediction"), seed=5, micro_batch=2, grad_accum=1, dp_rank=0,
                               dp_size=1)
    for step in range(6):
        shape = batches.step_latent_shape()
        (x_t, _, _), target = next(batches)
        assert tuple(x_t.shape[2:]) == shape == tuple(target.shape[2:])
    cfg = load_config("debug", ["data.kind=directory", f"data.path={tmp_path}"])
    assert check_shapes(tmp_path, cfg.model, cfg.data) == []
    lines = [json.loads(x) for x in (tmp_path / "manifest.jsonl").read_text().splitlines()]
    lines[1]["shape"] = list(SHAPES[0])                       # a 5x48x80 latent listed as 9x64x64
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    problems = check_shapes(tmp_path, cfg.model, cfg.data)
    assert len(problems) == 1 and "v1.safetensors: latent shape [4, 2, 6, 10] != expected [4, 3, 8, 8]" in \
        problems[0] and "manifest.jsonl:2" in problems[0] and "9x64x64" in problems[0]
    assert len(DirectoryLatents(tmp_path).shapes) == PER_BUCKET * 3


def test_choose_bucket_keeps_the_most_of_a_video():
    buckets = parse_shapes("9x32x32, 9x32x48,5x32x48,5x48x32")
    assert choose_bucket(buckets, 11, 40, 40) == (9, 32, 32)       # square
    assert choose_bucket(buckets, 9, 32, 48) == (9, 32, 48)        # wide, long enough for 9 frames
    assert choose_bucket(buckets, 6, 40, 64) == (5, 32, 48)        # wide (nearest aspect), 6 frames: 5
    assert choose_bucket(buckets, 3, 40, 64) == (5, 32, 48)        # too short for any: the shortest
    assert choose_bucket(buckets, 7, 48, 30) == (5, 48, 32)        # tall
    with pytest.raises(ValueError, match="'9x32' is not FRAMESxHEIGHTxWIDTH"):
        parse_shapes("9x32,5x32x32")


def test_prepare_data_buckets(tmp_path, vae_dir, capsys):
    """Clips of four sizes land in the expected buckets; the manifest's shapes match the latents, which
    the training check accepts; the summary counts each bucket."""
    videos = tmp_path / "videos"
    videos.mkdir()
    sizes = {"sq.mkv": (11, 40, 40), "wide.mkv": (9, 32, 48), "short.mkv": (6, 40, 64), "tall.mkv": (7, 48, 30)}
    expected = {"sq.mkv": [9, 32, 32], "wide.mkv": [9, 32, 48], "short.mkv": [5, 32, 48], "tall.mkv": [5, 48, 32]}
    for i, (name, size) in enumerate(sizes.items()):
        write_video(videos / name, squares(*size, seed=i), "ffv1")
    (videos / "captions.csv").write_text("video,caption\n" + "".join(f"{v},clip {v}\n" for v in sizes))
    sets = ["model.vae_scale_spatial=2", "model.vae_scale_temporal=2"]
    out = tmp_path / "out"
    assert run(videos, vae_dir, out, "--buckets", "9x32x32,9x32x48,5x32x48,5x48x32", sets=sets) == 0
    lines = {x["video"]: x for x in map(json.loads, (out / "manifest.jsonl").read_text().splitlines())}
    assert {v: x["shape"] for v, x in lines.items()} == expected
    data = DirectoryLatents(out, text_encoder=object())            # captions, no text files
    for i, (latent, _) in enumerate(data.items):
        f, h, w = data.shapes[i]
        assert data.latent_shape(i) == ((f - 1) // 2 + 1, h // 2, w // 2)
    cfg = load_config("debug", sets + ["data.kind=directory", f"data.path={out}"])
    assert check_shapes(out, cfg.model, cfg.data, captions=True) == []
    printed = capsys.readouterr().out
    for bucket in ("9x32x32", "9x32x48", "5x32x48", "5x48x32"):
        assert f"bucket {bucket}: 1 video in the manifest" in printed


def test_checker_names_each_bucket_and_refuses_learned_positions(tmp_path, monkeypatch):
    """python -m parallel.check's report lists every bucket's tokens and sp padding, longest first (the
    memory plan's); a shape the patches do not tile is refused; positions learned for one grid refuse
    every other bucket, naming it."""
    from models.cogvideox.config import CogVideoXConfig
    from parallel.check import check_data_files, load_and_check, summary
    from parallel.experiment.manifest import bucket_configs

    write_buckets(tmp_path)
    sets = ["data.kind=directory", f"data.path={tmp_path}", "parallel.sp_size=2"]
    cfg, _, layout = load_and_check("debug", sets, None, 2, device_check=False)
    assert [s for s, _, _ in bucket_configs(cfg)] == SHAPES          # 56, 38, 17 tokens
    assert ("buckets (longest first, the memory plan's): 9x64x64 x 4 -> 56 tokens, 5x48x80 x 4 -> 38 tokens, "
            "1x48x48 x 4 -> 17 tokens (17 tokens padded to 18 for sp 2)") in summary(cfg, layout)
    lines = [json.loads(x) for x in (tmp_path / "manifest.jsonl").read_text().splitlines()]
    lines[0]["shape"] = [9, 64, 60]
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert any("bucket 9x64x60 (1 sample): width 60 is not a multiple of model.vae_scale_spatial x "
               "model.patch_size = 16" in p for p in check_data_files(cfg))
    write_buckets(tmp_path)
    monkeypatch.setattr(CogVideoXConfig, "FIXED_GRID_POS_EMBEDS", ("sincos",))
    problems = check_data_files(cfg)
    assert len(problems) == 2 and all("model.pos_embed=sincos is learned for one token grid, 3x4x4" in p
                                      for p in problems)
    assert "bucket 5x48x80 (4 samples)" in problems[0] + problems[1]
    monkeypatch.undo()
    learned = load_config("debug", sets + ["model.pos_embed=rope3d", "model.learned_positions=true"])
    problems = check_data_files(learned)                        # CogVideoX-5B-I2V's stored position table
    assert len(problems) == 2 and all("model.learned_positions=true is learned for one token grid, 3x4x4" in p
                                      for p in problems)


def test_validation_keeps_each_sample_shape(tmp_path):
    """Validation over a directory of three shapes: each sample's loss is what a model built for its
    shape gives (the stages take the sample's grid, then the next training step's again)."""
    from types import SimpleNamespace

    from parallel.validation.validate import StageForward, validation_loss, validation_noise

    write_buckets(tmp_path)
    cfg = load_config("debug", ["data.kind=directory", f"data.path={tmp_path}", "val.timesteps=[100,800]"])
    ctx, objective = ParallelContext.single(), Objective.of(cfg.model)
    model = build_model(cfg, {}, ctx)
    data = DirectoryLatents(tmp_path)
    got = validation_loss(StageForward(SimpleNamespace(module=model, device="cpu"), ctx), data, objective, cfg, ctx)
    natives = {s: build_model(load_config("debug", [f"data.num_frames={s[0]}", f"data.height={s[1]}",
                                                    f"data.width={s[2]}"]), {}, ctx) for s in SHAPES}
    losses = []
    for i in range(len(data)):
        x0, text = data[i]
        t = torch.tensor(cfg.val.timesteps)
        x_t, target = objective.noised(x0.expand(2, *x0.shape), validation_noise(cfg.train.seed, i, [100, 800],
                                                                                 x0.shape), t)
        with torch.no_grad():
            prediction = natives[data.shapes[i]].predict((x_t, t, text.expand(2, *text.shape)))
        losses.append(((prediction - target) ** 2).flatten(1).mean(1))
    torch.testing.assert_close(torch.tensor(got["val_loss"]), torch.stack(losses).mean())
