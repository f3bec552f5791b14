"""The LTX-2 family against diffusers' LTX2VideoTransformer3DModel, in one process: a tiny random release
(written by `save_pretrained` in several shards) loaded into the toolkit predicts what diffusers predicts, video and
audio, for LTX-2.0 and for the LTX-2.3 flags (gated attention, cross-attention modulation), with split rotary
positions and without the cross timesteps; python -m parallel.verify compares both and names the one apart; the
preset counts diffusers' parameters; wrong configs are refused by key; the checker lets training, export, verify
and sampling through and refuses what is not built by name, and the planner counts both streams (parameters,
activations, a tp that does not divide the audio heads refused). tp, pp, sp: tests/distributed/test_ltx2_layouts.py.
"""
import re

import pytest
import torch
from diffusers import LTX2VideoTransformer3DModel

from models.__main__ import summary
from parallel.experiment.config import load_config
from parallel.plan.search import count_params
from parallel.plan.trace import ActivationTracer
from parallel.experiment.splits import valid_tp_sizes
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
    # image-to-video: the video timesteps per latent position, frame 0's at 0 (LTX2ImageToVideoPipeline's [B, S]
    # timestep, sigma its t): each frame's tokens modulated by their own, the later frames' prediction changed
    from models.ltx2.image import token_timesteps
    x = inputs()
    x = (x[0], token_timesteps(x[1], (FRAMES, HEIGHT, WIDTH)), *x[2:])
    with torch.no_grad():
        per_token = ours.predict(x)
    for got, want, before in zip(per_token, diffusers_forward(model, variant, x), (video, audio)):
        torch.testing.assert_close(got, want)
        assert not torch.allclose(got[:, :, 1:], before[:, :, 1:], atol=1e-3)


def test_reference_reads_the_folder(released):
    """The ReleasedFormat's reference (from_pretrained, then the pipelines' call) is diffusers' forward."""
    from models.ltx2.released import DIFFUSERS
    folder, model = released["ltx2"]
    for got, want in zip(DIFFUSERS.reference(str(folder), inputs()), diffusers_forward(model)):
        torch.testing.assert_close(got, want)


def test_verify_compares_both_streams_and_names_the_one_apart(released, monkeypatch, capsys):
    """python -m parallel.verify in one process (tp, pp, sp: tests/distributed/test_ltx2_layouts.py): video and
    audio each equal diffusers'; a loader that misreads one audio tensor (what a wrong name map or slice would do;
    perturbing the folder would change both sides alike) leaves the video equal and the audio NOT, named."""
    from parallel import verify
    from parallel.train import sampling

    folder, _ = released["ltx2.3"]
    argv = ["--config", "debug-ltx2", *(f"--set={o}" for o in overrides(folder, "ltx2.3"))]
    assert verify.main(argv) == 0
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(rf"{folder} in tp 1 x pp 1 x sp 1: video max relative difference \S+ \(max abs \S+\); audio "
                        rf"max relative difference \S+ \(max abs \S+\); equal at --tolerance 0.0001", line), line
    load = sampling.load_released

    def misread(module, ctx, m, folder):
        read = load(module, ctx, m, folder)
        with torch.no_grad():
            module.final.audio_proj_out.bias.add_(1e-2)               # one audio tensor, a small change
        return read

    monkeypatch.setattr(sampling, "load_released", misread)
    assert verify.main(argv) == 2                                        # ran, found them apart
    line = capsys.readouterr().out.strip()
    video, audio = (float(x) for x in re.findall(r"max relative difference (\S+)", line))
    assert video < 1e-5 and 1e-4 < audio < 1 and line.endswith("NOT equal at --tolerance 0.0001 (audio)"), line


def test_the_preset_and_the_planner_count_the_parameters_diffusers_builds():
    """`python -m models` and the memory plan (its tracer's stages on the meta device: both streams' weights)."""
    with torch.device("meta"):
        reference = LTX2VideoTransformer3DModel()           # the class defaults: the 19B release
    want = sum(p.numel() for p in reference.parameters())
    assert want == 18_876_174_592
    cfg = load_config("ltx2-t2v")
    assert f"parameters: {want}" in summary(cfg).splitlines()
    assert count_params(ActivationTracer(cfg, torch.bfloat16)) == (want, sum(
        p.numel() for p in reference.transformer_blocks.parameters()))
    for flags in ({}, LTX23):
        with torch.device("meta"):
            tiny = LTX2VideoTransformer3DModel(**DIFFUSERS_TINY, **flags)
        cfg = load_config("debug-ltx2", [f"model.{k}=true" for k in flags])
        want = sum(p.numel() for p in tiny.parameters())
        assert f"parameters: {want}" in summary(cfg).splitlines()
        assert count_params(ActivationTracer(cfg, torch.float32))[0] == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_plan_traces_both_streams_as_a_real_block_saves_them(dtype):
    """The planner's traced block (meta device) against a real debug-ltx2 block on CPU fed the real embed
    stage's outputs: the bytes it saves, video and audio, exactly (its rotary tables are the plan's position
    tables line), and what a checkpoint of the block keeps (both streams' inputs; the modulation rows and
    captions as views), whose outputs equal the plain block's; under sp a rank's video share and the whole audio."""
    import deepspeed

    from parallel.model.build import layer_specs
    from parallel.distributed.pipeline import checkpoint_x_only
    from parallel.distributed.topology import ParallelContext
    from parallel.plan.trace import table_storages
    from parallel.model.recompute import checkpointed_block
    from tests.helpers.plan import saved_bytes

    cfg = load_config("debug-ltx2")
    trace = ActivationTracer(cfg, dtype).trace("block", 1, B)
    specs = layer_specs(cfg, ParallelContext.single())
    embed, block = specs[0].build().to(dtype), specs[1].build().to(dtype)
    with torch.no_grad():
        h = tuple(t.requires_grad_(t.is_floating_point()) for t in embed(inputs()))
    assert trace.input_bytes == (h[0].numel() + h[1].numel()) * h[0].element_size()      # x and a
    # sp: one rank's share of the 48 video tokens (padded: 48 -> 50 at sp 5, a ring of 5) and the whole audio
    size = h[0].element_size()
    for sp, share in ((2, 24), (5, 10)):
        assert ActivationTracer(cfg, dtype).trace("block", 1, B, sp).input_bytes == B * (share * 32 + 9 * 16) * size
    full, want = saved_bytes(lambda: block(h), block)
    tables = sum(table_storages(block).values())         # rotary tables: the plan's position tables line
    assert trace.activations + trace.side_saved_bytes == full - tables
    for run in (lambda: checkpoint_x_only(deepspeed.checkpointing.checkpoint, 2)(lambda *z: block(z), *h),
                lambda: checkpointed_block(block.forward, streams=2)(h)):
        kept, out = saved_bytes(run, block)
        assert kept == trace.input_bytes + trace.side_total
        for got, expected in zip(out, want):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_checker_refuses_a_tp_that_does_not_divide_the_audio_heads():
    """debug-ltx2: 4 video heads, 2 audio heads; tp 4 divides the first, not the second. The advice works."""
    from parallel.check import check
    _, problems = check(load_config("debug-ltx2", ["parallel.tp_size=4"]))
    assert problems == ["model.audio_num_heads=2 is not divisible by parallel.tp_size=4; tp sizes that divide every "
                        "split dimension of this model: 1, 2; set --set parallel.tp_size=2"]
    assert check(load_config("debug-ltx2", ["parallel.tp_size=2"]))[1] == []
    assert valid_tp_sizes(load_config("ltx2-t2v").model) == [1, 2, 4, 8, 16, 32]


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


def test_what_is_not_built_is_refused_by_name_and_the_planner_plans_it(capsys):
    """train.py's checks (load_and_check) let debug-ltx2 train, export, verify and sample and refuse, by name, what is
    not built: validation (tests/unit/test_ltx2_training.py trains; caption dropout trains too); python -m
    parallel.plan sizes the model with diffusers' parameter count."""
    from parallel.check import check, load_and_check
    from parallel.experiment.config import ConfigError
    from tests.helpers.plan import cli

    for purpose in ("train", "export", "verify", "sample"):
        assert load_and_check("debug-ltx2", [], None, None, device_check=False, purpose=purpose)[0].model.family \
            == "ltx2"
    with pytest.raises(ConfigError) as refused:
        load_and_check("debug-ltx2", ["data.caption_dropout=0.1", "val.every=2"], None, None, device_check=False)
    assert str(refused.value).splitlines() == [
        "val.every=2 with model.family=ltx2: validation sees the video stream only; set --set val.every=0 "
        "(docs/models.md#ltx-2)"]
    assert check(load_config("debug-ltx2"))[1] == []
    code, out, _ = cli(capsys, "--config", "debug-ltx2", "--deepspeed-config", "ds_configs/zero1_bf16.json",
                       "--world-size", "4", "--device-memory", "80GiB", "--set", "parallel.tp_size=2")
    assert code == 0 and out.startswith("model: debug-ltx2 (108,880 parameters)") and "tp=2 sp=1 pp=1 dp=2" in out
