"""The HunyuanVideo 1.5 family against diffusers' HunyuanVideo15Transformer3DModel, in one process: a tiny random
release (`released` fixture, written by `save_pretrained` in several shards) loaded into the toolkit predicts what
diffusers predicts on text-to-video and image-to-video inputs; the preset counts diffusers' parameters; the
checker lists tp / sp sizes for 16 heads; wrong configs are refused by key. Every (tp, pp) layout, sp, the export
and training equivalence: tests/distributed/test_hunyuanvideo15_layouts.py.
"""
import json

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel

from models.__main__ import summary
from models.hunyuanvideo15.released import DIFFUSERS
from parallel.experiment.config import load_config
from parallel.weights.diffusers import check_released
from tests.released_utils import read_release
from tests.helpers.hunyuanvideo15 import C, diffusers_forward, inputs, overrides
from tests.helpers.hunyuanvideo15 import released  # noqa: F401  (fixtures)


def test_forward_equals_diffusers(released):
    """T2V and I2V inputs; T2V also from latents without the condition channels (training: zeros appended)."""
    folder, model = released
    _, ours, read = read_release("debug-hunyuan15", overrides(folder), folder)
    assert read == sum(p.numel() for p in model.parameters())
    for i2v in (False, True):
        want = diffusers_forward(model, inputs(i2v))
        with torch.no_grad():
            torch.testing.assert_close(ours.predict(inputs(i2v)), want, msg=lambda m: f"i2v={i2v}: {m}")
    latents, t, text = inputs()
    with torch.no_grad():
        torch.testing.assert_close(ours.predict((latents[:, :C], t, text)), diffusers_forward(model, inputs()))


def test_reference_and_the_verify_command(released, capsys):
    """The ReleasedFormat's reference (read from the folder) is diffusers' forward; python -m parallel.verify on
    debug-hunyuan15 passes on the folder in one process."""
    from parallel import verify
    folder, model = released
    fmt = DIFFUSERS.bind(load_config("debug-hunyuan15").model)
    torch.testing.assert_close(fmt.reference(str(folder), inputs(True)), diffusers_forward(model, inputs(True)))
    assert verify.main(["--config", "debug-hunyuan15", *(f"--set={o}" for o in overrides(folder))]) == 0
    assert "equal at --tolerance" in capsys.readouterr().out


def test_presets_count_the_parameters_diffusers_builds():
    with torch.device("meta"):
        reference = HunyuanVideo15Transformer3DModel()         # diffusers' defaults are the 8.3B release
    want = sum(p.numel() for p in reference.parameters())
    for preset in ("hunyuanvideo1.5-t2v-480p", "hunyuanvideo1.5-t2v-720p", "hunyuanvideo1.5-i2v-720p"):
        assert f"parameters: {want}" in summary(load_config(preset)).splitlines(), preset
    from parallel.plan.search import count_params
    from parallel.plan.trace import ActivationTracer
    assert count_params(ActivationTracer(load_config("hunyuanvideo1.5-t2v-720p"), torch.bfloat16))[0] == want


def test_the_checker_lists_tp_sizes_and_ulysses_ring_pairs_for_16_heads():
    """16 heads: tp 8 divides them, 32 does not (the heads decide); sp 32 is Ulysses 16 x ring 2 (the joint attention
    rings with its text mask), and Ulysses alone at 32 is refused with the pairs that work."""
    from parallel.check import check
    preset = "hunyuanvideo1.5-t2v-720p"
    _, problems = check(load_config(preset, ["parallel.sp_size=1", "parallel.tp_size=32"]), world_size=32)
    assert problems == ["model.num_heads=16 is not divisible by parallel.tp_size=32; tp sizes that divide every split "
                        "dimension of this model: 1, 2, 4, 8, 16; set --set parallel.tp_size=16"]
    layout, problems = check(load_config(preset, ["parallel.sp_size=32"]), world_size=32)
    assert (layout.ring_size, problems) == (2, [])
    _, problems = check(load_config(preset, ["parallel.sp_size=32", "parallel.ring_size=1"]), world_size=32)
    assert problems == ["model.num_heads=16 / parallel.tp_size=1 = 16 heads per tp rank is not divisible by the "
                        "Ulysses degree parallel.sp_size / parallel.ring_size = 32 / 1 = 32; (ulysses, ring) pairs "
                        "that work for sp 32: ulysses 1 x ring 32, ulysses 2 x ring 16, ulysses 4 x ring 8, ulysses "
                        "8 x ring 4, ulysses 16 x ring 2; set --set parallel.ring_size=2"]
    for sizes, world in ((["parallel.sp_size=8"], 8), (["parallel.sp_size=1", "parallel.tp_size=8"], 8),
                         (["parallel.sp_size=16", "parallel.ring_size=4"], 16)):
        assert check(load_config(preset, sizes), world_size=world)[1] == [], sizes


def test_wrong_config_is_refused_by_key(released, tmp_path):
    folder, _ = released
    cfg = load_config("debug-hunyuan15", overrides(folder) + ["model.in_channels=8", "model.glyph_dim=8",
                                                              "model.ffn_hidden_size=256"])
    config = folder / "config.json"
    assert check_released(cfg.model, folder) == [
        f"{config}: in_channels 9 != 2 x model.in_channels + 1 = 17 (noisy latents, condition latents, mask); set "
        f"--set model.in_channels=4",
        f"{config}: out_channels 4 != model.in_channels 8; set --set model.in_channels=4 or use the matching preset",
        f"{config}: mlp_ratio 2.0 != model.ffn_hidden_size / model.hidden_size 4.0; set --set model.ffn_hidden_size=128",
        f"{config}: text_embed_2_dim 16 != model.glyph_dim 8; set --set model.glyph_dim=16 or use the matching preset"]
    assert check_released(load_config("debug-hunyuan15", overrides(folder)).model, folder) == []
    sr = tmp_path / "sr"
    sr.mkdir()
    (sr / "config.json").write_text(json.dumps({**json.loads(config.read_text()), "use_meanflow": True}))
    assert check_released(load_config("debug-hunyuan15", overrides(sr)).model, sr) == [
        f"{sr / 'config.json'}: use_meanflow true is not supported (the toolkit's HunyuanVideo 1.5 model has false; "
        f"the 480p and 720p T2V and I2V releases qualify)"]


def test_the_data_path_takes_the_release_vae_and_refuses_to_encode_captions_it_cannot(tmp_path):
    """Latents as the pipelines scale them (z * scaling_factor, as HunyuanVideo15ImageToVideoPipeline scales its
    image latents; decoded / scaling_factor), compression and channels read from a tiny
    AutoencoderKLHunyuanVideo15's config; a text encoder folder is refused by name (the release's Qwen2.5-VL +
    byT5 rows are not what a T5-style encode gives)."""
    from diffusers import AutoencoderKLHunyuanVideo15

    from models.registry import family
    from models.text_encoder import T5TextEncoder
    from models.vae import compression
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
                                      spatial_compression_ratio=16, temporal_compression_ratio=4).eval()
    config = {"_class_name": "AutoencoderKLHunyuanVideo15", **vae.config}
    fmt = family(load_config("debug-hunyuan15").model).formats.vae
    assert (fmt.class_name, fmt.channels(config), compression(config)) == ("AutoencoderKLHunyuanVideo15", 4, (4, 16))
    with torch.no_grad():
        z = vae.encode(torch.rand(1, 3, 5, 32, 32) * 2 - 1).latent_dist.mode()
    assert z.shape == (1, 4, 2, 2, 2)
    torch.testing.assert_close(fmt.normalise(z, vae.config), z * vae.config.scaling_factor, rtol=0, atol=0)
    torch.testing.assert_close(fmt.denormalise(fmt.normalise(z, vae.config), vae.config), z)
    cfg = load_config("debug-hunyuan15")
    with pytest.raises(ValueError, match="not a T5 encoder.s, and the toolkit does not encode them yet"):
        T5TextEncoder(tmp_path, cfg.model.max_text_len, expected=family(cfg.model).formats.text_encoder)
