"""Wan 2.1 image-to-video against diffusers' WanTransformer3DModel with image_dim / added_kv_proj_dim, in one
process: a tiny random I2V release loaded into the toolkit predicts what diffusers predicts (36-style input
channels, the CLIP tokens through the image embedder and the image cross-attention); the 14B presets count
diffusers' parameters; the training input is the pipeline's. Every layout: tests/distributed/test_wan_layouts.py.
"""
import pytest
import torch
from diffusers import WanTransformer3DModel

from models.__main__ import summary
from parallel.model.build import layer_specs
from parallel.experiment.config import load_config
from parallel.distributed.pipeline import SequentialDiT
from parallel.distributed.topology import ParallelContext
from parallel.weights.diffusers import check_released
from tests.released_utils import read_release
from tests.helpers.wan_i2v import DIFFUSERS_TINY, IMAGE, IMAGE_DIM, TEXT, WIDTH, diffusers_forward, inputs, overrides
from tests.helpers.wan_i2v import released_i2v  # noqa: F401  (fixtures)


def test_forward_equals_diffusers(released_i2v):
    folder, model = released_i2v
    cfg, ours, read = read_release("debug-wan-i2v", overrides(folder), folder)
    assert check_released(cfg.model, folder) == []
    assert read == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        out = ours.predict(inputs())
    want = diffusers_forward(model, *inputs())
    torch.testing.assert_close(out, want)
    # the image matters: other CLIP states, another prediction
    other = (*inputs()[:3], inputs()[3] + 1)
    assert not torch.allclose(diffusers_forward(model, *other), want)
    with pytest.raises(ValueError, match=r"3 inputs; \(latents, timesteps, text, CLIP states\) expected"):
        ours.predict(inputs()[:3])


def test_reference_and_the_verify_command(released_i2v, capsys):
    """The ReleasedFormat's reference and example inputs carry the image; python -m parallel.verify passes."""
    from models.wan.released import DIFFUSERS
    from parallel import verify
    folder, model = released_i2v
    torch.testing.assert_close(DIFFUSERS.reference(str(folder), inputs()), diffusers_forward(model, *inputs()))
    cfg = load_config("debug-wan-i2v", overrides(folder))
    example = DIFFUSERS.example_inputs(cfg.model, cfg.data, 1, torch.Generator().manual_seed(0))
    assert [tuple(x.shape) for x in example] == [(1, 12, 3, 8, 12), (1,), (1, TEXT, 32), (1, IMAGE, IMAGE_DIM)]
    assert verify.main(["--config", "debug-wan-i2v", *(f"--set={o}" for o in overrides(folder))]) == 0
    assert "equal at --tolerance" in capsys.readouterr().out


@pytest.mark.parametrize("preset", ["wan2.1-i2v-14b-480p", "wan2.1-i2v-14b-720p"])
def test_presets_count_the_parameters_diffusers_builds(preset):
    with torch.device("meta"):
        reference = WanTransformer3DModel(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824,
                                          num_layers=40, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)
    want = sum(p.numel() for p in reference.parameters())
    assert want == 16_394_878_784          # DESIGN.md's figure for the 14B I2V
    assert f"parameters: {want}" in summary(load_config(preset)).splitlines()


def test_text_and_image_folders_are_refused_by_key(released_i2v, tmp_path):
    """An I2V folder for the text-to-video debug model, and a T2V folder for the I2V one: each key named, with
    the settings that fit; following the advice loads the folder."""
    folder, _ = released_i2v
    config = folder / "config.json"
    t2v_cfg = load_config("debug-wan", ["model.num_layers=2", f"data.width={WIDTH * 8}", "model.max_text_len=512"])
    assert check_released(t2v_cfg.model, folder) == [
        f"{config}: in_channels 12 != 4 (model.image_condition false); set --set model.image_condition=true "
        f"(image-to-video releases take 2 x out_channels + 4: noise, mask, image latents) or use the matching preset",
        f"{config}: image_dim 24 != model.image_dim null; set --set model.image_dim=24 --set model.added_kv_proj_dim=64 "
        f"--set model.image_condition=true --set model.max_text_len=512 or use the matching preset "
        f"(wan2.1-i2v-14b-480p, wan2.1-i2v-14b-720p: image-to-video)"]
    fixed = load_config("debug-wan", ["model.num_layers=2", f"data.width={WIDTH * 8}", "model.image_dim=24",
                                      "model.added_kv_proj_dim=64", "model.image_condition=true",
                                      "model.max_text_len=512", "model.image_len=5"])
    assert check_released(fixed.model, folder) == []
    t2v = tmp_path / "t2v"
    WanTransformer3DModel(**{**DIFFUSERS_TINY, "in_channels": 4, "image_dim": None,
                             "added_kv_proj_dim": None}).save_pretrained(t2v)
    i2v_cfg = load_config("debug-wan-i2v", overrides(t2v))
    assert check_released(i2v_cfg.model, t2v) == [
        f"{t2v / 'config.json'}: in_channels 4 != 12 (model.image_condition true); set --set "
        f"model.image_condition=false (image-to-video releases take 2 x out_channels + 4: noise, mask, image latents) "
        f"or use the matching preset",
        f"{t2v / 'config.json'}: image_dim null != model.image_dim 24; set --set model.image_dim=null --set "
        f"model.added_kv_proj_dim=null or use the matching preset (wan2.1-i2v-14b-480p, wan2.1-i2v-14b-720p: "
        f"image-to-video)"]
    followed = load_config("debug-wan-i2v", overrides(t2v) + ["model.image_condition=false", "model.image_dim=null",
                                                              "model.added_kv_proj_dim=null"])
    assert check_released(followed.model, t2v) == []


def test_wrong_image_settings_are_refused_by_key():
    from parallel.experiment.config import ConfigError
    for sets, words in [(["model.image_dim=24"], "set both"),
                        (["model.added_kv_proj_dim=32"], "must equal model.hidden_size=64"),
                        (["model.image_condition=false"], "needs model.image_condition=true"),
                        (["model.max_text_len=8"], "--set model.max_text_len=512")]:
        with pytest.raises(ConfigError, match=words):
            load_config("debug-wan-i2v", sets + (["model.added_kv_proj_dim=null"] if sets[0].startswith(
                "model.image_dim") else []))


def test_validation_conditions_on_the_first_frame_and_its_clip_states():
    """validation_loss and sample_latents of debug-wan-i2v on synthetic data: the inputs built here from the
    condition's stand-ins ([x_t, mask, z_0, 0, 0] and the CLIP stand-in), the same in the guided call pair."""
    import types

    from models.diffusion import Objective
    from models.sampling import sample
    from models.wan.image import stand_in_embeds
    from parallel.distributed.seed import derive_seed
    from parallel.train.run import build_val_dataset
    from parallel.validation.validate import StageForward, sample_latents, validation_loss, validation_noise

    cfg = load_config("debug-wan-i2v", ["model.num_layers=2", "val.num_samples=2", "val.timesteps=[100,700]",
                                        "val.num_prompts=1", "val.sample_steps=2", "val.guidance_scale=3"])
    ctx = ParallelContext.single()
    torch.manual_seed(0)
    model = SequentialDiT(layer_specs(cfg, ctx)).eval()
    forward = StageForward(types.SimpleNamespace(module=model, device=torch.device("cpu")), ctx)
    dataset, objective = build_val_dataset(cfg), Objective.of(cfg.model)

    def inputs(x, x0):
        image = torch.cat([x0[:, :1], torch.zeros_like(x0[:, 1:])], dim=1).expand(len(x), *x0.shape)
        mask = torch.zeros(len(x), 4, *x0.shape[1:])
        mask[:, :, 0] = 1
        return torch.cat([x, mask, image], dim=1), stand_in_embeds(x0[None], 5, 24).expand(len(x), 5, 24)

    got = validation_loss(forward, dataset, objective, cfg, ctx)["val_loss"]
    losses = []
    for i in range(2):
        x0, text = dataset[i]
        t = torch.tensor(cfg.val.timesteps)
        x_t, target = objective.noised(x0.expand(2, *x0.shape), validation_noise(cfg.train.seed, i, [100, 700],
                                                                                  x0.shape), t)
        latents, states = inputs(x_t, x0)
        with torch.no_grad():
            pred = model.predict((latents, objective.model_timesteps(t), text.expand(2, *text.shape), states))
        losses.append(((pred - target) ** 2).flatten(1).mean(1))
    torch.testing.assert_close(torch.tensor(got), torch.cat(losses).mean())

    x0, text = dataset[0]
    uncond = dataset.unconditional()[None]
    g = torch.Generator().manual_seed(derive_seed(cfg.train.seed, "sample", 0))
    noise = torch.randn((1, *x0.shape), generator=g)

    def predict(x, t, conditional):
        latents, states = inputs(x, x0)
        with torch.no_grad():
            return model.predict((latents, t, text[None] if conditional else uncond, states))
    want = sample(predict, noise, objective, 2, cfg.val.sampler, 3.0, generator=g)
    torch.testing.assert_close(sample_latents(forward, dataset, objective, cfg, ctx)[0], want[0])
