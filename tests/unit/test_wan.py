"""The Wan 2.1 family against diffusers' WanTransformer3DModel, in one process: a tiny random release (`released`
fixture, written by `save_pretrained` in several shards) loaded into the toolkit predicts what diffusers
predicts; the presets count diffusers' parameters; wrong configs and folders are refused by key. Every
(tp, pp) layout, sp, the exports and training equivalence: tests/distributed/test_wan_layouts.py.
"""
import json

import pytest
import torch
from diffusers import WanTransformer3DModel

from models.__main__ import summary
from parallel.experiment.config import load_config
from parallel.weights.diffusers import check_released
from tests.released_utils import read_release
from tests.helpers.wan import FRAMES, HEIGHT, WIDTH, diffusers_forward, inputs, overrides
from tests.helpers.wan import released  # noqa: F401  (fixtures)


def test_forward_equals_diffusers(released):
    folder, model = released
    _, ours, read = read_release("debug-wan", overrides(folder), folder)
    assert read == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        out = ours.predict(inputs())
    torch.testing.assert_close(out, diffusers_forward(model, *inputs()))


def test_reference_and_the_verify_command(released, capsys):
    """The ReleasedFormat's reference (read from the folder, called as the pipeline does) is diffusers' forward;
    python -m parallel.verify on debug-wan passes on the folder in one process."""
    from models.wan.released import DIFFUSERS
    from parallel import verify
    folder, model = released
    torch.testing.assert_close(DIFFUSERS.reference(str(folder), inputs()), diffusers_forward(model, *inputs()))
    assert verify.main(["--config", "debug-wan", *(f"--set={o}" for o in overrides(folder))]) == 0
    assert "equal at --tolerance" in capsys.readouterr().out


def test_the_reference_computes_where_verify_places_it(released, monkeypatch, capsys):
    """parallel.verify's oracle on the device its free memory allows (the model, a quarter more and 4 GiB), else on
    the host: the loaded model goes to `place(model)` with the inputs, and the prediction comes back to the host."""
    from models.wan.released import DIFFUSERS
    from parallel import verify
    from parallel.distributed import accelerator
    folder, model = released
    seen = []

    def place(m):
        seen.append(sum(p.numel() for p in m.parameters()))
        return torch.device("cpu")

    torch.testing.assert_close(DIFFUSERS.reference(str(folder), inputs(), place), diffusers_forward(model, *inputs()))
    assert seen == [sum(p.numel() for p in model.parameters())]
    need = seen[0] * 4 * 5 // 4 + 4 * 2**30                       # fp32
    monkeypatch.setattr(accelerator, "device", lambda local_rank=0: torch.device("meta"))   # a stand-in device
    monkeypatch.setattr(accelerator, "free_memory", lambda local_rank=0: need)
    assert verify.reference_place(0)(model) == torch.device("meta")
    monkeypatch.setattr(accelerator, "free_memory", lambda local_rank=0: need - 1)
    assert verify.reference_place(0)(model) == torch.device("cpu")
    assert "the released model's prediction on the host: it needs about" in capsys.readouterr().out
    monkeypatch.setattr(accelerator, "free_memory", lambda local_rank=0: None)              # CPU
    assert verify.reference_place(0)(model) == torch.device("cpu")


@pytest.mark.parametrize("preset, heads, ffn, layers", [("wan2.1-t2v-1.3b", 12, 8960, 30),
                                                        ("wan2.1-t2v-14b", 40, 13824, 40)])
def test_presets_count_the_parameters_diffusers_builds(preset, heads, ffn, layers):
    with torch.device("meta"):
        reference = WanTransformer3DModel(num_attention_heads=heads, attention_head_dim=128, ffn_dim=ffn,
                                          num_layers=layers)
    want = sum(p.numel() for p in reference.parameters())
    assert f"parameters: {want}" in summary(load_config(preset)).splitlines()


def test_wrong_config_is_refused_by_key(released, tmp_path):
    folder, _ = released
    cfg = load_config("debug-wan", overrides(folder) + ["model.ffn_hidden_size=128", "model.time_embed_dim=16"])
    config = folder / "config.json"
    assert check_released(cfg.model, folder) == [
        f"{config}: ffn_dim 96 != model.ffn_hidden_size 128; set --set model.ffn_hidden_size=96 or use the matching "
        f"preset",
        f"{config}: freq_dim 32 != model.time_embed_dim 16; set --set model.time_embed_dim=32 or use the matching "
        f"preset"]
    # An image-to-video transformer (added K/V projections) is not this model: refused by its key.
    i2v = tmp_path / "i2v"
    i2v.mkdir()
    (i2v / "config.json").write_text(json.dumps({**json.loads(config.read_text()), "added_kv_proj_dim": 1280,
                                                 "patch_size": [1, 4, 4]}))
    problems = check_released(load_config("debug-wan", overrides(i2v)).model, i2v)
    assert problems == [
        f"{i2v / 'config.json'}: patch_size [1, 4, 4] != (model.patch_size_t, model.patch_size) [1, 2, 2]; set "
        f"--set model.patch_size_t=1 --set model.patch_size=4",
        f"{i2v / 'config.json'}: added_kv_proj_dim 1280 with image_dim null is not supported (the toolkit's Wan "
        f"model has null: the image cross-attention's k/v take the image tokens the image embedder projects to "
        f"hidden_size, or none without image_dim)"]


def test_training_noise_levels_are_the_schedulers():
    """Integer timestep t trains at FlowMatchEulerDiscreteScheduler(shift)'s training sigma for r = t / 1000, and
    the model sees that scheduler's (fractional) timestep, bit for bit."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from models.diffusion import Objective
    cfg = load_config("debug-wan")
    objective, scheduler = Objective.of(cfg.model), FlowMatchEulerDiscreteScheduler(shift=cfg.model.schedule.shift)
    assert cfg.model.objective == "flow_matching" and cfg.model.schedule.shift == 3.0
    t = torch.arange(1, 1000)
    assert torch.equal(objective.flow_sigmas(t), scheduler.sigmas[1000 - t])
    assert torch.equal(objective.model_timesteps(t), scheduler.timesteps[1000 - t])
    x0, noise = torch.randn(2, 4, 3, 8, 8), torch.randn(2, 4, 3, 8, 8)
    x_t, target = objective.noised(x0, noise, torch.tensor([250, 900]))
    sigma = scheduler.sigmas[[750, 100]].view(-1, 1, 1, 1, 1)
    torch.testing.assert_close(x_t, (1 - sigma) * x0 + sigma * noise, rtol=0, atol=0)
    assert torch.equal(target, noise - x0)


@pytest.mark.parametrize("sampler", ["unipc", "flow_euler"])
def test_sampling_equals_the_pipeline(released, sampler):
    """With classifier-free guidance, 4 steps from the same noise: unipc gives WanPipeline(..., output_type="latent")'s
    latents with the release's UniPCMultistepScheduler (flow sigmas, flow_shift = model.schedule.shift: both solver
    orders, the corrector and the lower-order last step), flow_euler with FlowMatchEulerDiscreteScheduler(shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline

    from models.diffusion import Objective
    from models.sampling import sample
    folder, model = released
    cfg, ours, _ = read_release("debug-wan", overrides(folder), folder)
    g = torch.Generator().manual_seed(11)
    noise, text, negative = (torch.randn(1, 4, FRAMES, HEIGHT, WIDTH, generator=g), torch.randn(1, 8, 32, generator=g),
                             torch.randn(1, 8, 32, generator=g))
    shift = cfg.model.schedule.shift
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift) \
        if sampler == "unipc" else FlowMatchEulerDiscreteScheduler(shift=shift)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=model, scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(prompt_embeds=text, negative_prompt_embeds=negative, latents=noise.clone(), height=HEIGHT * 8,
                width=WIDTH * 8, num_frames=(FRAMES - 1) * 4 + 1, num_inference_steps=4, guidance_scale=2.0,
                output_type="latent").frames
    seen = []

    def predict(x, t, conditional):
        seen.append(t)
        with torch.no_grad():
            return ours.predict((x, t, text if conditional else negative))
    got = sample(predict, noise, Objective.of(cfg.model), 4, sampler, 2.0)
    torch.testing.assert_close(got, want)
    assert [float(t[0]) for t in seen[::2]] == pipe.scheduler.timesteps.tolist()


def test_a_pipelines_flow_scheduler_is_checked_by_objective(released, tmp_path):
    """A release's transformer/ beside its scheduler/ (UniPC with flow sigmas): fits flow_matching, whatever its
    flow_shift; refused by key for v_prediction."""
    import shutil

    from diffusers import UniPCMultistepScheduler

    from parallel.weights.scheduler import check_scheduler
    folder, _ = released
    shutil.copytree(folder, tmp_path / "transformer")
    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0).save_pretrained(
        tmp_path / "scheduler")
    transformer = tmp_path / "transformer"
    assert check_released(load_config("debug-wan", overrides(transformer)).model, transformer) == []
    assert check_scheduler(load_config("debug-wan", overrides(transformer)).model, transformer) == []
    wrong = load_config("debug-wan", overrides(transformer) + ["model.objective=v_prediction"]).model
    assert check_scheduler(wrong, transformer) == [
        f"{tmp_path / 'scheduler' / 'scheduler_config.json'}: a flow-matching scheduler (UniPCMultistepScheduler) != "
        f"model.objective v_prediction; set --set model.objective=flow_matching or use the matching preset"]
