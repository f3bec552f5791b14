"""The LTX-2 family against diffusers' LTX2VideoTransformer3DModel, in one process: a tiny random release
(written by `save_pretrained` in several shards) loaded into the toolkit predicts what diffusers predicts, video and
audio, for LTX-2.0 and for the LTX-2.3 flags (gated attention, cross-attention modulation), with split rotary
positions and without the cross timesteps; the preset counts diffusers' parameters; wrong configs are refused by
key; the checker refuses training. tp, pp: tests/distributed/test_ltx2_layouts.py.
"""
import pytest
import torch
from diffusers import LTX2VideoTransformer3DModel

from models.__main__ import summary
from parallel.config import load_config
from parallel.weights.diffusers import check_released
from tests.helpers.ltx2 import (AUDIO, DIFFUSERS_TINY, FRAMES, HEIGHT, LTX23, VARIANTS, WIDTH, B,  # noqa: F401
                               diffusers_forward, inputs, overrides, release, released)
from tests.released_utils import read_release


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_equals_diffusers(released, variant):
    folder, model = released[variant]
    _, ours, read = read_release("debug-ltx2", overrides(folder, variant), folder)
    assert read == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        video, audio = ours.predict(inputs())
    want_video, want_audio = diffusers_forward(model, variant)
    assert video.shape == (B, 8, FRAMES, HEIGHT, WIDTH) and audio.shape == (B, AUDIO, 8)
    torch.testing.assert_close(video, want_video)
    torch.testing.assert_close(audio, want_audio)


def test_reference_reads_the_folder(released):
    """The ReleasedFormat's reference (from_pretrained, then the pipelines' call) is diffusers' forward."""
    from models.ltx2.released import DIFFUSERS
    folder, model = released["ltx2"]
    for got, want in zip(DIFFUSERS.reference(str(folder), inputs()), diffusers_forward(model)):
        torch.testing.assert_close(got, want)


def test_the_preset_counts_the_parameters_diffusers_builds():
    with torch.device("meta"):
        reference = LTX2VideoTransformer3DModel()           # the class defaults: the 19B release
    want = sum(p.numel() for p in reference.parameters())
    assert want == 18_876_174_592
    assert f"parameters: {want}" in summary(load_config("ltx2-t2v")).splitlines()
    with torch.device("meta"):
        tiny = LTX2VideoTransformer3DModel(**DIFFUSERS_TINY, **LTX23)
    cfg = load_config("debug-ltx2", [f"model.{k}=true" for k in LTX23])
    assert f"parameters: {sum(p.numel() for p in tiny.parameters())}" in summary(cfg).splitlines()


def test_audio_tokens_follow_the_pipeline():
    """round(frames / frame_rate x 16000 / 160 / 4), as LTX2Pipeline's audio_num_frames."""
    cfg = load_config("ltx2-t2v")
    assert cfg.model.audio_tokens(cfg.data) == round(121 / 24.0 * 25) == 126
    cfg = load_config("debug-ltx2")
    assert cfg.model.audio_tokens(cfg.data) == AUDIO


def test_wrong_config_is_refused_by_key(released):
    folder, _ = released["ltx2"]
    config = folder / "config.json"
    cfg = load_config("debug-ltx2", overrides(folder) + ["model.audio_num_heads=4", "model.audio_head_dim=4",
                                                         "model.gated_attn=true"])
    assert check_released(cfg.model, folder) == [
        f"{config}: audio_num_attention_heads 2 != model.audio_num_heads 4; set --set model.audio_num_heads=2 or use "
        f"the matching preset",
        f"{config}: audio_attention_head_dim 8 != model.audio_head_dim 4; set --set model.audio_head_dim=8 or use "
        f"the matching preset",
        f"{config}: gated_attn false != model.gated_attn true; set --set model.gated_attn=false or use the "
        f"matching preset"]


def test_the_checker_refuses_training_and_names_what_is_missing():
    from parallel.check import check
    _, problems = check(load_config("debug-ltx2"))
    assert len(problems) == 1 and problems[0].startswith("model.family=ltx2: training is not built yet: the data "
                                                         "path has no audio stream")
