"""Still images as 1-frame clips (data.num_frames=1): the toolkit's prediction on a 1-frame latent equals diffusers'
(fp32 assert_close) for Wan 2.1, HunyuanVideo and HunyuanVideo 1.5 (T2V and I2V inputs): rotary tables with one
temporal position. The multi-frame cases: tests/unit/test_wan.py, test_hunyuanvideo.py, test_hunyuanvideo15.py.
"""
import pytest
import torch

import tests.helpers.hunyuanvideo as hunyuanvideo
import tests.helpers.hunyuanvideo15 as hunyuanvideo15
import tests.helpers.wan as wan
from tests.released_utils import read_release, save_release


@pytest.mark.parametrize("family, preset", [(wan, "debug-wan"), (hunyuanvideo, "debug-hunyuan")])
def test_one_frame_equals_diffusers(family, preset, tmp_path, monkeypatch):
    monkeypatch.setattr(family, "FRAMES", 1)                   # the helpers' inputs: latents [B, C, 1, H, W]
    folder, model = save_release(tmp_path, family.released_model(), "100KB")
    _, ours, _ = read_release(preset, family.overrides(folder) + ["data.num_frames=1"], folder)
    with torch.no_grad():
        out = ours.predict(family.inputs())
    assert out.shape[2] == 1
    torch.testing.assert_close(out, family.diffusers_forward(model, *family.inputs()))


def test_hunyuanvideo15_one_frame_equals_diffusers(tmp_path, monkeypatch):
    monkeypatch.setattr(hunyuanvideo15, "FRAMES", 1)
    folder, model = save_release(tmp_path, hunyuanvideo15.released_model(), "100KB")
    _, ours, _ = read_release("debug-hunyuan15", hunyuanvideo15.overrides(folder) + ["data.num_frames=1"], folder)
    for i2v in (False, True):
        x = hunyuanvideo15.inputs(i2v)
        assert x[0].shape[2] == 1
        with torch.no_grad():
            torch.testing.assert_close(ours.predict(x), hunyuanvideo15.diffusers_forward(model, x),
                                       msg=lambda m: f"i2v={i2v}: {m}")
