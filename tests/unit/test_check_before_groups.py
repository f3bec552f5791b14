"""The refusals train.py's run made after its process groups existed, now the checker's (parallel/check.py),
made before any: validation sampling's needs (sampler, decoder, MP4 encoder) and a checkpoint in ckpt.dir
this run cannot continue. Each names the key and what would work, and doing that passes. The bf16 one is
tests/unit/test_ds_precision.py's (the checker had it already; the run's copy is gone)."""
import json
import re
import sys

import pytest

from parallel.check import check_resume, load_and_check
from parallel.experiment.config import ConfigError
from parallel.checkpoints import checkpoint

SAMPLING = ["val.every=2", "val.num_prompts=1"]


def refusal(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_and_check("debug", list(overrides), "ds_configs/zero0_fp32.json", 1)
    return str(e.value)


@pytest.mark.parametrize("bad, expected, fix", [
    ("val.sampler=euler", "val.sampler=euler: sampler 'euler' does not fit objective 'v_prediction': v_prediction "
     "samples with 'ddim' or 'dpm' (or leave sampler unset)", "val.sampler=dpm"),
    ("val.decoder=no_such_module:decode", "val.decoder: decoder 'no_such_module:decode' cannot be loaded "
     "(No module named 'no_such_module'); expected \"package.module:function\"", "val.decoder=null"),
    ("val.formats=[gif,mp4]", "val.formats has mp4, which needs imageio-ffmpeg: pip install imageio-ffmpeg, or use "
     "val.formats=[gif]", "val.formats=[gif]"),
])
def test_validation_sampling_needs_are_the_checkers(bad, expected, fix, monkeypatch):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)          # as where it is not installed
    assert refusal(*SAMPLING, bad).startswith(expected)
    load_and_check("debug", [*SAMPLING, fix], "ds_configs/zero0_fp32.json", 1)      # the advice passes


def marked(directory, step, layout, copy=True):
    folder = directory / f"step{step}"
    (folder / "layout_free").mkdir(parents=True)
    files = {}
    if copy:
        (folder / "layout_free" / "state.json").write_text("{}")
        files["layout_free/state.json"] = 2
    (folder / checkpoint.MARKER).write_text(json.dumps({"step": step, "layout": layout, "files": files}))


def test_a_checkpoint_of_another_global_batch_is_refused_by_the_checker(tmp_path):
    """debug at one process: global batch 2 x 2 x 1 = 4; the checkpoint's is 8."""
    marked(tmp_path, 3, {"tp_size": 1, "sp_size": 1, "pp_size": 1, "dp_size": 1, "zero_stage": 0, "global_batch": 8})
    cfg, _, layout = load_and_check("debug", [f"ckpt.dir={tmp_path}"], "ds_configs/zero0_fp32.json", 1)
    with pytest.raises(ConfigError, match=rf"{tmp_path}/step3 was trained with global batch 8, this run's is 4 "
                                          r"\(train.micro_batch_size x train.grad_accum_steps x dp_size\): keep 8"):
        check_resume(cfg, layout)
    cfg, _, layout = load_and_check("debug", [f"ckpt.dir={tmp_path}", "train.grad_accum_steps=4"],
                                    "ds_configs/zero0_fp32.json", 1)
    check_resume(cfg, layout)                                   # keeping 8 resumes


def test_a_checkpoint_at_another_layout_without_its_copy_is_refused_by_the_checker(tmp_path):
    marked(tmp_path, 3, {"tp_size": 2, "pp_size": 1, "dp_size": 1, "zero_stage": 0, "global_batch": 4}, copy=False)
    cfg, _, layout = load_and_check("debug", [f"ckpt.dir={tmp_path}"], "ds_configs/zero0_fp32.json", 1)
    with pytest.raises(ConfigError, match=r"written at tp 2 sp 1 pp 1 dp 1 ZeRO-0 without a layout-free copy .*"
                                          r"Resume it at tp 2 sp 1 pp 1 dp 1 ZeRO-0"):
        check_resume(cfg, layout)
    cfg, _, layout = load_and_check("debug", [f"ckpt.dir={tmp_path}", "parallel.tp_size=2"],
                                    "ds_configs/zero0_fp32.json", 2)
    check_resume(cfg, layout)                                   # at its layout it resumes


def test_an_unreadable_marker_is_damage_and_an_only_damaged_checkpoint_is_refused(tmp_path):
    (tmp_path / "step3").mkdir()
    (tmp_path / "step3" / checkpoint.MARKER).write_text('{"step": 3, "layo')       # a copy cut short
    cfg, _, layout = load_and_check("debug", [f"ckpt.dir={tmp_path}"], "ds_configs/zero0_fp32.json", 1)
    with pytest.raises(ConfigError, match=rf"{tmp_path} \(ckpt.dir\) has no checkpoint this run can continue: "
                                          rf"{tmp_path}/step3 is damaged \(complete.json cannot be read "
                                          r"\(JSONDecodeError"):
        check_resume(cfg, layout)


def test_export_and_sampling_are_told_the_model_differs_without_trainings_ways_on(tmp_path):
    """find_resume without a global batch (parallel.export, parallel.sample): the same finding, read-only advice."""
    cfg, _, layout = load_and_check("debug", [], "ds_configs/zero0_fp32.json", 1)
    saved = {**layout.as_dict(), "zero_stage": 0}
    marked(tmp_path, 3, saved)
    marker = json.loads((tmp_path / "step3" / checkpoint.MARKER).read_text())
    marker["model"] = {**checkpoint.model_signature(cfg.model), "num_layers": 2}
    (tmp_path / "step3" / checkpoint.MARKER).write_text(json.dumps(marker))
    with pytest.raises(ValueError) as e:
        checkpoint.find_resume(tmp_path, saved, model=checkpoint.model_signature(cfg.model))
    assert str(e.value) == (f"{tmp_path} (ckpt.dir) has no usable checkpoint: {tmp_path}/step3 was written for "
                            f"another model (model.num_layers=2 there, 4 here). Set those keys back to read it")
    assert checkpoint.find_resume(tmp_path, saved, model={**checkpoint.model_signature(cfg.model), "num_layers": 2}) \
        == "step3"                                              # the advice: num_layers 2 reads it


def test_an_image_to_video_run_does_not_continue_a_text_to_video_checkpoint(tmp_path):
    """Wan 2.1 T2V and I2V share every size key; the first stage's inputs (36 channels, the CLIP states) tell them
    apart. A marker written before those keys were recorded is compared on the keys it has."""
    t2v, _, layout = load_and_check("debug-wan", [], "ds_configs/zero0_fp32.json", 1)
    i2v, _, _ = load_and_check("debug-wan-i2v", [], "ds_configs/zero0_fp32.json", 1)
    saved = {**layout.as_dict(), "zero_stage": 0}
    marked(tmp_path, 3, saved)
    marker = json.loads((tmp_path / "step3" / checkpoint.MARKER).read_text())
    marker["model"] = checkpoint.model_signature(t2v.model)
    (tmp_path / "step3" / checkpoint.MARKER).write_text(json.dumps(marker))
    theirs, ours = t2v.model, i2v.model
    with pytest.raises(ValueError, match=re.escape(
            f"model.transformer_in_channels={theirs.transformer_in_channels} there, {ours.transformer_in_channels} "
            f"here; model.extra_input_shapes=[] there, {json.dumps([list(s) for s in ours.extra_input_shapes()])} "
            f"here")):
        checkpoint.find_resume(tmp_path, saved, model=checkpoint.model_signature(ours))
    for key in ("transformer_in_channels", "extra_input_shapes"):     # an older marker's record
        del marker["model"][key]
    (tmp_path / "step3" / checkpoint.MARKER).write_text(json.dumps(marker))
    assert checkpoint.find_resume(tmp_path, saved, model=checkpoint.model_signature(t2v.model)) == "step3"
