"""Buckets in the planner and the presets' bucket lists: each bucket's row is the plan of the experiment fixed at
that shape, the plan sizes the longest bucket, every preset shape makes whole latents and patches, and
`prepare_data --buckets preset` takes the preset's list."""
import json

import pytest

from models.geometry import latent_shape, token_grid
from models.registry import sequence_tokens
from parallel.experiment.config import CONFIG_DIR, load_config
from parallel.distributed.sequence import padded_length
from parallel.plan.memory import EngineSettings
from parallel.plan.search import DEVICES, estimate_step_time
from parallel.plan.trace import ActivationTracer
from parallel.experiment.shapes import bucket_data
from tests.buckets_utils import SHAPES, write_buckets

LONG = ["--config", "configs/cogvideox-5b-long.yaml", "--deepspeed_config", "ds_configs/zero2_bf16_long.json",
        "--world-size", "8", "--device-memory", "80GiB"]
PRESETS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if "buckets:" in p.read_text())


def cli(capsys, *argv):
    from parallel.plan.cli import main
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def fixed_shape(capsys, argv, shape, sets=()):
    """The plan (json) of the experiment fixed at one shape, no buckets."""
    f, h, w = shape
    sets = [*sets, f"data.num_frames={f}", f"data.height={h}", f"data.width={w}", "data.kind=synthetic"]
    code, out, err = cli(capsys, *argv, "--format", "json", *[a for s in sets for a in ("--set", s)])
    assert code in (0, 2), err
    return json.loads(out)


def step_time(cfg, ds_path, dp, shape, device="a100-80gb", per_node=8):
    """estimate_step_time of the experiment fixed at `shape`, as plan.search computes it for a layout."""
    from parallel.experiment import ds_config as dsc
    from parallel.plan.memory import plan_memory
    ds = dsc.read_ds_config(ds_path)
    cfg = cfg.model_copy(update={"data": bucket_data(cfg.data, shape)})
    eng = EngineSettings.from_ds(ds, cfg.model.num_layers)
    tracer = ActivationTracer(cfg, eng.dtype)
    memory = plan_memory(cfg, ds, dp, 80 * 2 ** 30, tracer)
    return estimate_step_time(cfg, eng, dp, DEVICES[device], per_node, 0.4, tracer,
                              max(s.params for s in memory.stages)).total


def test_each_bucket_row_is_the_plan_at_that_shape(capsys):
    """CogVideoX-5B-long's preset buckets at tp 2 x sp 2: the plan is the longest bucket's (49 x 768 x 1360, listed
    last on the command line), and every row's tokens, sp padding, activations, total and step time are those
    of the plan of a config fixed at that shape."""
    shapes = "49x480x720,49x720x480,49x1360x768,49x768x1360"
    code, out, err = cli(capsys, *LONG, "--buckets", shapes, "--format", "json")
    r = json.loads(out)
    assert code == 0 and r["model"]["video"] == "49x768x1360" and r["model"]["tokens"] == 53_266
    rows = r["buckets"]
    assert [row["shape"] for row in rows] == [[49, 768, 1360], [49, 1360, 768], [49, 480, 720], [49, 720, 480]]
    assert rows[0]["total"] == r["total"] and rows[0]["activations"] == r["stages"][0]["lines"]["activations"]
    cfg = load_config("configs/cogvideox-5b-long.yaml")
    for row in rows[::2]:                                # the portrait rows equal the landscape ones: checked below
        alone = fixed_shape(capsys, LONG, row["shape"])
        lines = alone["stages"][0]["lines"]
        assert (row["tokens"], row["activations"], row["recompute"], row["total"]) == \
            (alone["model"]["tokens"], lines["activations"], lines["recompute"], alone["total"])
        assert row["padded_tokens"] == padded_length(row["tokens"], 2) == row["tokens"]
        assert row["step_time"] == pytest.approx(step_time(cfg, "ds_configs/zero2_bf16_long.json", 2, row["shape"]),
                                                 rel=1e-12)
    assert rows[1]["total"] == rows[0]["total"] and rows[3]["total"] == rows[2]["total"]
    assert rows[2]["activations"] < rows[0]["activations"] / 2
    # sp 4 pads 53,266 tokens to 53,268 and leaves 17,776 whole; the text table says so.
    code, text, _ = cli(capsys, *LONG, "--buckets", "preset", "--set", "parallel.sp_size=4")
    table = text[text.index("buckets (this layout"):].splitlines()
    assert code == 0 and table[2].split()[:4] == ["49x768x1360", "-", "53,266", "2"]
    assert table[4].split()[:4] == ["49x480x720", "-", "17,776", "0"]


def test_search_lists_sp4_and_sp8_and_sizes_the_longest_bucket(capsys, tmp_path):
    """`--search` over the preset's buckets: sp 4 and sp 8 layouts fit CogVideoX-5B at 49 x 768 x 1360 on
    8 x 80 GB; the best layout's rows are the plans of that layout at each shape."""
    code, out, _ = cli(capsys, *LONG, "--buckets", "preset", "--search", "--top", "100", "--format", "json",
                       "--ds-out", str(tmp_path / "best.json"))
    r = json.loads(out)
    assert code == 0 and r["model"]["tokens"] == 53_266
    assert {4, 8} <= {c["sp"] for c in r["ranked"]}
    best = r["ranked"][0]
    assert r["buckets"][0]["total"] == best["memory"]["total"]
    planned = tmp_path / "planned.json"
    planned.write_text(json.dumps(best["ds_config"]["json"]))
    argv = [a if a != "ds_configs/zero2_bf16_long.json" else str(planned) for a in LONG]
    alone = fixed_shape(capsys, argv, [49, 480, 720], best["overrides"])
    assert r["buckets"][2]["shape"] == [49, 480, 720] and r["buckets"][2]["total"] == alone["total"]


def test_directory_buckets_plan_the_longest_and_weigh_step_times(tmp_path, capsys):
    """A directory dataset of three shapes (4, 4 and 2 samples): the plan sizes the longest (9 x 64 x 64, 56
    tokens); rows carry the sample counts and the expected step time is their weighted mean."""
    lines = [x for i, x in enumerate(write_buckets(tmp_path)) if i not in (8, 11)]     # two of the 1x48x48 left out
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["--config", "debug", "--deepspeed_config", "ds_configs/zero1_bf16.json", "--world-size", "2",
            "--device-memory", "4GiB", "--device-profile", "cpu"]
    sets = ["--set", "data.kind=directory", "--set", f"data.path={tmp_path}", "--set", "parallel.sp_size=2"]
    code, out, _ = cli(capsys, *argv, *sets, "--format", "json")
    r = json.loads(out)
    cfg = load_config("debug")
    assert code == 0 and [row["shape"] for row in r["buckets"]] == [list(s) for s in SHAPES]
    assert [row["tokens"] for row in r["buckets"]] == [sequence_tokens(cfg.model, bucket_data(cfg.data, s))
                                                        for s in SHAPES] == [56, 38, 17]
    assert r["model"]["video"] == "9x64x64" and r["total"] == r["buckets"][0]["total"]
    assert [row["padded_tokens"] for row in r["buckets"]] == [56, 38, 18]
    assert [row["samples"] for row in r["buckets"]] == [4, 4, 2]
    for row, shape in zip(r["buckets"], SHAPES):
        alone = fixed_shape(capsys, argv, shape, ["parallel.sp_size=2"])
        assert row["total"] == alone["total"] and row["activations"] == alone["stages"][0]["lines"]["activations"]
    from parallel.plan.buckets import expected_step_time, render_buckets_text
    mean = sum(n * row["step_time"] for n, row in zip((4, 4, 2), r["buckets"])) / 10
    assert expected_step_time(r["buckets"]) == pytest.approx(mean, rel=1e-12)
    assert render_buckets_text(r["buckets"], "this layout")[-1].endswith(f"probability n_b / N): {mean:.2f} s")


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_buckets_make_whole_latents_and_patches(preset):
    """Every shape of a preset's data.buckets: 1 + 4k frames, height and width whole VAE latents cut into
    whole patches (the latent frames padded to whole temporal patches, as CogVideoX 1.5's pipeline pads),
    and the checker training uses finds nothing; the preset's own shape is one of its buckets."""
    from parallel.check import check_data_files
    from parallel.experiment.shapes import preset_bucket_problems
    cfg = load_config(preset)
    m, shapes = cfg.model, cfg.data.buckets
    assert len(shapes) >= 4 and (cfg.data.num_frames, cfg.data.height, cfg.data.width) in shapes
    for f, h, w in shapes:
        d = bucket_data(cfg.data, (f, h, w))
        assert (f - 1) % m.vae_scale_temporal == 0
        assert h % (m.vae_scale_spatial * m.patch_size) == 0 and w % (m.vae_scale_spatial * m.patch_size) == 0
        t, lh, lw = latent_shape(m, d)
        gt, gh, gw = token_grid(m, d)
        assert (gt * m.patch_size_t, gh * m.patch_size, gw * m.patch_size) == (t, lh, lw)
        assert t - ((f - 1) // m.vae_scale_temporal + 1) < m.patch_size_t
    assert preset_bucket_problems(cfg) == [] and check_data_files(cfg) == []


def test_checker_refuses_bad_preset_buckets():
    """data.buckets goes through the bucket checker: a shape off the VAE factors, or any other grid for a
    model with learned positions (CogVideoX-5B-I2V), is named."""
    from parallel.check import check_data_files
    bad = load_config("cogvideox-5b", ["data.buckets=[[49, 480, 720], [48, 480, 728]]"])
    assert check_data_files(bad) == [
        "data.buckets: 48x480x728: 48 frames; model.vae_scale_temporal=4 takes 1 + k x 4 frames",
        "data.buckets: 48x480x728: width 728 is not a multiple of model.vae_scale_spatial x model.patch_size = 16"]
    i2v = load_config("cogvideox-5b-i2v", ["data.buckets=[[49, 480, 720], [49, 720, 480]]"])
    (problem,) = check_data_files(i2v)
    assert problem.startswith("data.buckets: 49x720x480: model.learned_positions=true is learned for one token grid")
    with pytest.raises(Exception, match="lists a shape twice"):
        load_config("cogvideox-5b", ["data.buckets=[[49, 480, 720], [49, 480, 720]]"])


def test_buckets_beyond_the_sliced_rotary_table_are_refused():
    """CogVideoX 1.5 slices its rotary table (diffusers' grid_type="slice", max_size = sample size / patch: 150 x
    150 patches): the checker refuses exactly the buckets whose grid the table cannot serve, the ones rope_3d
    would fail on at the first step."""
    from models.embeddings import rope_3d
    from parallel.check import check_data_files
    cfg = load_config("cogvideox1.5-5b", ["data.buckets=[[81, 768, 2400], [81, 768, 2416], [81, 2416, 768]]"])
    problems = check_data_files(cfg)
    assert problems == [f"data.buckets: {s}: a {h} x {w} patch grid exceeds the rotary table's 150 x 150 "
                        f"(model.sample_height=300, model.sample_width=300 / model.patch_size=2); leave this shape "
                        f"out or use a smaller one" for s, h, w in (("81x768x2416", 48, 151), ("81x2416x768", 151, 48))]
    (limit_h, limit_w), _ = cfg.model.largest_position_grid()
    rope_3d(64, 2, limit_h, limit_w, (limit_h, limit_w), grid="slice")            # the largest it serves
    with pytest.raises(ValueError, match="exceeds the rotary table"):
        rope_3d(64, 2, limit_h, limit_w + 1, (limit_h, limit_w), grid="slice")
    assert load_config("cogvideox-5b").model.largest_position_grid() is None   # 1.0 fits any grid in


def test_prepare_data_buckets_preset_is_the_preset_list(tmp_path):
    """`prepare_data --buckets preset` resolves to the config's data.buckets, checked and recorded in
    prepare.json's settings; a config without a list, or a shape its model refuses, is named."""
    from parallel.prepare_data.captions import InputError
    from parallel.prepare_data.prepare import check_inputs, parse_args, settings
    videos, vae = tmp_path / "videos", tmp_path / "vae"
    videos.mkdir(), vae.mkdir()
    (videos / "a.mp4").write_bytes(b"")
    (videos / "captions.csv").write_text("video,caption\na.mp4,a clip\n")
    vae_configs = {"cogvideox": {"_class_name": "AutoencoderKLCogVideoX", "latent_channels": 16,
                                 "down_block_types": ["CogVideoXDownBlock3D"] * 4, "temporal_compression_ratio": 4},
                   "wan": {"_class_name": "AutoencoderKLWan", "z_dim": 16, "dim_mult": [1, 2, 4, 4],
                           "temperal_downsample": [False, True, True]}}

    def inputs(config, buckets):
        vae_config = vae_configs[load_config(config).model.family]
        (vae / "config.json").write_text(json.dumps(vae_config))
        args = parse_args(["--config", config, "--videos", str(videos), "--captions", str(videos / "captions.csv"),
                           "--vae", str(vae), "--out", str(tmp_path / "out"), "--buckets", buckets])
        cfg = load_config(config)
        check_inputs(args, cfg)
        return args, cfg

    for preset in ("cogvideox1.5-5b", "wan2.1-t2v-14b"):
        args, cfg = inputs(preset, "preset")
        assert args.bucket_list == [tuple(b) for b in cfg.data.buckets] and len(args.bucket_list) >= 4
        assert settings(args, cfg, vae_configs[cfg.model.family])["buckets"] == ["x".join(map(str, b)) for b in cfg.data.buckets]
    vae_configs["wan"] = vae_configs["cogvideox"]      # a problem of every bucket is said once, unsuffixed
    with pytest.raises(InputError) as refused:
        inputs("wan2.1-t2v-14b", "preset")
    assert str(refused.value).count("AutoencoderKLCogVideoX folder") == 1 and "(bucket" not in str(refused.value)
    with pytest.raises(InputError, match=r"--buckets preset: --config=cogvideox-5b-i2v has no data.buckets; .*"
                                         r"use a preset that lists them: cogvideox-2b, "):
        inputs("cogvideox-5b-i2v", "preset")
    with pytest.raises(InputError, match="--buckets: 25x480x720: model.learned_positions=true is learned for one"):
        inputs("cogvideox-5b-i2v", "49x480x720,25x480x720")


def test_memory_check_plans_the_step_bucket(tmp_path):
    """train.py's memory check compares step 2 with the plan of step 2's own bucket: run_plan at a bucket's
    token count is the plan of the experiment fixed at that shape (the start-up line plans the longest)."""
    from parallel.check import check
    from parallel.plan.memory import run_plan
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps(x) + "\n" for x in write_buckets(tmp_path)))
    cfg = load_config("debug", ["data.kind=directory", f"data.path={tmp_path}"])
    ds = json.loads((CONFIG_DIR.parent / "ds_configs" / "zero1_bf16.json").read_text())
    layout, problems = check(cfg, ds, world_size=1)
    assert not problems
    totals = {}
    for shape in SHAPES:
        fixed = cfg.model_copy(update={"data": bucket_data(cfg.data, shape)})
        alone = run_plan(fixed.model_copy(update={"data": fixed.data.model_copy(update={"kind": "synthetic"})}),
                         ds, layout, 2 ** 32)
        step = run_plan(cfg, ds, layout, 2 ** 32, tokens=sequence_tokens(fixed.model, fixed.data))
        totals[shape] = step.worst.total
        assert step.worst.total == alone.worst.total and step.worst.lines == alone.worst.lines
    assert run_plan(cfg, ds, layout, 2 ** 32).worst.total == totals[SHAPES[0]] > totals[SHAPES[-1]]
