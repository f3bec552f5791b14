"""The HunyuanVideo family against diffusers' HunyuanVideoTransformer3DModel, in one process: a tiny random release
(`released` fixture, written by `save_pretrained` in several shards) loaded into the toolkit predicts what diffusers
predicts; the preset counts diffusers' parameters; the checker lists tp / sp sizes for 24 heads; wrong configs are
refused by key. Every (tp, pp) layout, sp, the export and training equivalence:
tests/distributed/test_hunyuanvideo_layouts.py.
"""
import json

import pytest
import torch
from diffusers import HunyuanVideoTransformer3DModel

from models.__main__ import summary
from models.hunyuanvideo.released import DIFFUSERS
from parallel.experiment.config import load_config
from parallel.distributed.topology import ParallelContext
from parallel.weights.diffusers import check_released
from tests.released_utils import read_release
from tests.helpers.hunyuanvideo import WIDTH, diffusers_forward, inputs, overrides
from tests.helpers.hunyuanvideo import released  # noqa: F401  (fixtures)


def test_forward_equals_diffusers(released):
    folder, model = released
    _, ours, read = read_release("debug-hunyuan", overrides(folder), folder)
    assert read == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        out = ours.predict(inputs())
    torch.testing.assert_close(out, diffusers_forward(model, *inputs()))


def test_reference_and_the_verify_command(released, capsys):
    """The ReleasedFormat's reference (read from the folder) is diffusers' forward; python -m parallel.verify on
    debug-hunyuan passes on the folder in one process."""
    from parallel import verify
    folder, model = released
    torch.testing.assert_close(DIFFUSERS.reference(str(folder), inputs()), diffusers_forward(model, *inputs()))
    assert verify.main(["--config", "debug-hunyuan", *(f"--set={o}" for o in overrides(folder))]) == 0
    assert "equal at --tolerance" in capsys.readouterr().out


def test_preset_counts_the_parameters_diffusers_builds():
    with torch.device("meta"):
        reference = HunyuanVideoTransformer3DModel()           # diffusers' defaults are the 13B release
    want = sum(p.numel() for p in reference.parameters())
    assert f"parameters: {want}" in summary(load_config("hunyuanvideo-t2v")).splitlines()
    # The planner counts each layer's own parameters (a single-stream block is under half a dual-stream one).
    from parallel.plan.search import count_params
    from parallel.plan.trace import ActivationTracer
    assert count_params(ActivationTracer(load_config("hunyuanvideo-t2v"), torch.bfloat16))[0] == want


def test_the_checker_lists_tp_and_sp_sizes_for_24_heads():
    """24 heads: tp and Ulysses 8 divide them, 16 does not (the heads, not the 3072 hidden, decide); sp 16 runs as
    Ulysses 8 x ring 2 (the ring takes the text mask), and all-Ulysses asked for is refused with the pairs."""
    from parallel.check import check
    _, problems = check(load_config("hunyuanvideo-t2v", ["parallel.sp_size=1", "parallel.tp_size=16"]), world_size=16)
    assert problems == ["model.num_heads=24 is not divisible by parallel.tp_size=16; tp sizes that divide every split "
                        "dimension of this model: 1, 2, 3, 4, 6, 8, 12, 24; set --set parallel.tp_size=12"]
    layout, problems = check(load_config("hunyuanvideo-t2v", ["parallel.sp_size=16"]), world_size=16)
    assert problems == [] and (layout.sp_size, layout.ring_size) == (16, 2)
    _, problems = check(load_config("hunyuanvideo-t2v", ["parallel.sp_size=16", "parallel.ring_size=1"]), world_size=16)
    assert problems == ["model.num_heads=24 / parallel.tp_size=1 = 24 heads per tp rank is not divisible by the "
                        "Ulysses degree parallel.sp_size / parallel.ring_size = 16 / 1 = 16; (ulysses, ring) pairs "
                        "that work for sp 16: ulysses 1 x ring 16, ulysses 2 x ring 8, ulysses 4 x ring 4, ulysses 8 "
                        "x ring 2; set --set parallel.ring_size=2"]
    for sizes in (["parallel.sp_size=8"], ["parallel.sp_size=1", "parallel.tp_size=8"]):
        assert check(load_config("hunyuanvideo-t2v", sizes), world_size=8)[1] == []


def test_wrong_config_is_refused_by_key(released, tmp_path):
    folder, _ = released
    cfg = load_config("debug-hunyuan", overrides(folder) + ["model.num_dual_layers=1", "model.text_embed_dim=48",
                                                              "model.ffn_hidden_size=256"])
    config = folder / "config.json"
    assert check_released(cfg.model, folder) == [
        f"{config}: num_layers 2 != model.num_dual_layers 1; set --set model.num_dual_layers=2 or use the matching "
        f"preset",
        f"{config}: num_single_layers 2 != model.num_layers - model.num_dual_layers 3; set --set model.num_layers=4",
        f"{config}: mlp_ratio 2.0 != model.ffn_hidden_size / model.hidden_size 4.0; set --set model.ffn_hidden_size=128",
        f"{config}: text_embed_dim 32 != model.text_embed_dim - model.pooled_projection_dim 40; set --set "
        f"model.text_embed_dim=40"]
    fixed = load_config("debug-hunyuan", overrides(folder) + ["model.num_dual_layers=2", "model.num_layers=4",
                                                              "model.text_embed_dim=40", "model.ffn_hidden_size=128"])
    assert check_released(fixed.model, folder) == []                    # the advice, followed
    i2v = tmp_path / "i2v"
    i2v.mkdir()
    (i2v / "config.json").write_text(json.dumps({**json.loads(config.read_text()),
                                                 "image_condition_type": "token_replace"}))
    assert check_released(load_config("debug-hunyuan", overrides(i2v)).model, i2v)[0] == (
        f"{i2v / 'config.json'}: image_condition_type \"token_replace\" is not supported (the toolkit's HunyuanVideo "
        f"model has null; HunyuanVideo text-to-video (13B) qualifies)")


@pytest.mark.parametrize("granularity", ["attention", "mlp", "block"])
def test_recompute_gives_the_same_gradients(granularity):
    """train.recompute's parts (attn.core; the dual block's FFNs and the single block's MLP activation; the whole
    block) exist in both kinds of block and change no number."""
    from parallel.model.build import build_model
    from parallel.distributed.seed import seed_all

    grads = []
    for extra in ([], [f"train.recompute.granularity={granularity}", "train.recompute.every=1"]):
        cfg = load_config("debug-hunyuan", [f"data.width={WIDTH * 8}", *extra])
        seed_all(0)
        model = build_model(cfg, {}, ParallelContext.single())
        x = inputs()
        model(x, torch.randn(x[0].shape, generator=torch.Generator().manual_seed(3))).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    wrapped = {"attention": lambda b: hasattr(b.attn.core.forward, "__wrapped__"),
               "mlp": lambda b: hasattr(b.ffn if b.dual else b.mlp, "__wrapped__"),
               "block": lambda b: "forward" in vars(b)}[granularity]
    assert all(wrapped(block) for block in model.blocks)                              # dual (0, 1), single (2, 3)
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_the_data_path_takes_the_release_vae_and_refuses_a_t5_style_encode(tmp_path):
    """Latents as the pipeline scales them (z * scaling_factor; decoded / scaling_factor), compression and channels
    read from a tiny AutoencoderKLHunyuanVideo's config; the T5 path refuses the family by name (the release's
    LLaMA-template + CLIP rows are not what a T5-style encode gives), and its own encoder names the subfolders a
    folder lacks (the encoding itself: tests/unit/test_hunyuanvideo_captions.py)."""
    from diffusers import AutoencoderKLHunyuanVideo

    from models.registry import family
    from models.text_encoder import T5TextEncoder, build_text_encoder
    from models.vae import compression
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8),
                                    layers_per_block=1, norm_num_groups=4, spatial_compression_ratio=8,
                                    temporal_compression_ratio=4).eval()
    config = {"_class_name": "AutoencoderKLHunyuanVideo", **vae.config}
    fmt = family(load_config("debug-hunyuan").model).formats.vae
    assert (fmt.channels(config), compression(config)) == (4, (4, 8))
    with torch.no_grad():
        z = vae.encode(torch.rand(1, 3, 5, 16, 16) * 2 - 1).latent_dist.mode()
    assert z.shape == (1, 4, 2, 2, 2)
    torch.testing.assert_close(fmt.normalise(z, vae.config), z * vae.config.scaling_factor, rtol=0, atol=0)
    torch.testing.assert_close(fmt.denormalise(fmt.normalise(z, vae.config), vae.config), z)
    cfg = load_config("debug-hunyuan")
    with pytest.raises(ValueError, match="not a T5 encoder's"):
        T5TextEncoder(tmp_path, cfg.model.max_text_len, expected=family(cfg.model).formats.text_encoder)
    with pytest.raises(FileNotFoundError, match="missing: text_encoder, tokenizer, text_encoder_2, tokenizer_2"):
        build_text_encoder(tmp_path, cfg.model.max_text_len, expected=family(cfg.model).formats.text_encoder)
