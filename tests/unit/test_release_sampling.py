"""The toolkit's samplers against diffusers' CogVideoX schedulers and pipeline (fp32, one process).

ddim and dpm are driven step by step next to `scheduler.set_timesteps(N)` + `scheduler.step(...)` with the same
model function, noise and generator, for both releases' schedules, with and without guidance and dynamic CFG;
then `CogVideoXPipeline(..., output_type="latent")` on a tiny random transformer against the toolkit's model
loaded from the same folder (model.init_from's loader) and the toolkit's sampler.
"""
import math
import types

import pytest
import torch
from diffusers import CogVideoXDDIMScheduler, CogVideoXDPMScheduler, CogVideoXPipeline

from models.config import NoiseSchedule
from models.diffusion import Objective
from models.sampling import ddpm_timesteps, guidance_at, sample, sampling_timesteps
from parallel.experiment.config import load_config
from tests.helpers.release_sampling import (BATCH, CASES, FRAMES, HEADS, HEAD_DIM, RELEASE, SCHEDULERS, SIZE, TEXT,
                                            _transformer, batch_files, pipeline_latents, sample_argv)

B, C, T, H, W = 2, 4, 3, 4, 4


@pytest.mark.parametrize("spacing", ["trailing", "leading", "linspace"])
def test_timesteps_equal_set_timesteps(spacing):
    scheduler = CogVideoXDDIMScheduler(**{**RELEASE, "timestep_spacing": spacing})
    for steps in (1, 3, 7, 20, 33, 50, 999):
        scheduler.set_timesteps(steps)
        assert ddpm_timesteps(steps, spacing) == scheduler.timesteps.tolist(), steps
    assert sampling_timesteps("v_prediction", 3, "dpm") == [999, 666, 332]


def _model():
    """A fixed nonlinear v(x, t, text) on the toolkit's [B, C, T, H, W] latents."""
    torch.manual_seed(0)
    net = torch.nn.Conv3d(C, C, 3, padding=1)

    def v(x, t, cond: bool):
        with torch.no_grad():
            scale = (t.float() / 1000).view(-1, 1, 1, 1, 1)
            return torch.tanh(net(x)) * (0.5 + scale) + (0.3 if cond else -0.2) * x
    return v


def _diffusers_loop(kind, schedule, v, noise, steps, g, dynamic, generator):
    """The pipeline's denoising loop around scheduler.step, on diffusers' [B, T, C, H, W] latents."""
    scheduler = SCHEDULERS[kind](**RELEASE, snr_shift_scale=schedule.snr_shift_scale)
    scheduler.set_timesteps(steps)
    timesteps = scheduler.timesteps
    latents, old = noise.transpose(1, 2).clone(), None
    for i, t in enumerate(timesteps):
        tt = t.expand(B)
        x = latents.transpose(1, 2)
        scale = 1 + g * (1 - math.cos(math.pi * ((steps - t.item()) / steps) ** 5.0)) / 2 if dynamic else g
        if g > 1:
            u, c = v(x, tt, False), v(x, tt, True)
            pred = u + scale * (c - u)
        else:
            pred = v(x, tt, True)
        pred = pred.transpose(1, 2)
        if kind == "ddim":
            latents = scheduler.step(pred, t, latents, eta=0.0, generator=generator, return_dict=False)[0]
        else:
            latents, old = scheduler.step(pred, old, t, timesteps[i - 1] if i > 0 else None, latents, eta=0.0,
                                          generator=generator, return_dict=False)
    return latents.transpose(1, 2)


@pytest.mark.parametrize("kind", ["ddim", "dpm"])
@pytest.mark.parametrize("shift", [3.0, 1.0])
@pytest.mark.parametrize("steps, g, dynamic", [(1, 1.0, False), (7, 1.0, False), (10, 6.0, False), (50, 6.0, True)])
def test_sampler_equals_the_scheduler_loop(kind, shift, steps, g, dynamic):
    v, schedule = _model(), NoiseSchedule(snr_shift_scale=shift)
    noise = torch.randn(B, C, T, H, W, generator=torch.Generator().manual_seed(1))
    want = _diffusers_loop(kind, schedule, v, noise, steps, g, dynamic, torch.Generator().manual_seed(5))
    got = sample(v, noise, Objective("v_prediction", schedule), steps, kind, g, use_dynamic_cfg=dynamic,
                 generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(got, want)
    assert got.abs().max() < 1e3


def test_dynamic_cfg_scale_is_the_pipelines():
    for t in (999, 500, 49, 0):
        assert guidance_at(6.0, t, 50, True) == 1 + 6.0 * (1 - math.cos(math.pi * ((50 - t) / 50) ** 5.0)) / 2
    assert guidance_at(6.0, 999, 50, False) == 6.0 and guidance_at(1.0, 999, 50, True) == 1.0


def test_dpm_needs_a_generator_and_samplers_fit_their_objective():
    v, noise = _model(), torch.randn(B, C, T, H, W)
    with pytest.raises(ValueError, match="dpm sampler draws noise"):
        sample(v, noise, Objective("v_prediction"), 4, "dpm")
    with pytest.raises(ValueError, match="v_prediction samples with 'ddim' or 'dpm'"):
        sample(v, noise, Objective("v_prediction"), 4, "euler")
    with pytest.raises(ValueError, match="does not fit objective 'flow_matching'"):
        sample(v, noise, Objective("flow_matching"), 4, "dpm")


# --- the pipeline itself, on a tiny random transformer ---------------------------------------------------------


def _toolkit_predictor(pos, folder, shift):
    from parallel.model.build import build_model
    from parallel.distributed.topology import ParallelContext
    from parallel.validation.validate import StageForward
    from parallel.weights.diffusers import load_released

    cfg = load_config("debug", ["model.num_layers=2", f"model.hidden_size={HEADS * HEAD_DIM}",
                                f"model.num_heads={HEADS}", f"model.head_dim={HEAD_DIM}", "model.time_embed_dim=24",
                                f"model.pos_embed={pos}", f"model.sample_height={SIZE}", f"model.sample_width={SIZE}",
                                f"model.schedule.snr_shift_scale={shift}", f"model.init_from={folder}"])
    ctx = ParallelContext.single()
    model = build_model(cfg, {}, ctx)
    load_released(model, ctx, cfg.model, folder)
    model.eval()
    return StageForward(types.SimpleNamespace(module=model, device=torch.device("cpu")), ctx), cfg


@pytest.mark.parametrize("kind, pos, shift, g, dynamic", [("ddim", "sincos", 3.0, 6.0, False),
                                                           ("dpm", "rope3d", 1.0, 6.0, True)])
def test_pipeline_latents_equal_the_toolkit_sampler(tmp_path, kind, pos, shift, g, dynamic):
    """CogVideoXPipeline(transformer, scheduler) with prompt and negative-prompt embeddings against the
    toolkit's model loaded from the same folder, its unconditional input being the negative embedding."""
    transformer = _transformer(pos, tmp_path)
    scheduler = SCHEDULERS[kind](**RELEASE, snr_shift_scale=shift)
    pipe = CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer, scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    gen = torch.Generator().manual_seed(11)
    text, uncond = torch.randn(1, TEXT, 32, generator=gen), torch.randn(1, TEXT, 32, generator=gen)
    noise = torch.randn(1, 4, FRAMES, SIZE, SIZE, generator=gen)
    steps = 6
    with torch.no_grad():
        want = pipe(prompt_embeds=text, negative_prompt_embeds=uncond, latents=noise.transpose(1, 2).clone(),
                    num_frames=(FRAMES - 1) * 4 + 1, height=SIZE * 8, width=SIZE * 8, num_inference_steps=steps,
                    guidance_scale=g, use_dynamic_cfg=dynamic, output_type="latent",
                    generator=torch.Generator().manual_seed(2)).frames
    forward, cfg = _toolkit_predictor(pos, tmp_path, shift)

    def predict(x, t, conditional):
        return forward.predict((x, t, text if conditional else uncond), x)

    got = sample(predict, noise, Objective.of(cfg.model), steps, kind, g, use_dynamic_cfg=dynamic,
                 generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(got, want.transpose(1, 2))


# --- python -m parallel.sample ---------------------------------------------------------------------------------

def test_sample_command_writes_the_pipelines_latents(tmp_path, capsys):
    """The command (5B-like: rope3d, dpm, dynamic CFG) from a transformer folder and embedding files: its latent
    equals CogVideoXPipeline's from the same noise and generator, and the video files are written."""
    from safetensors.torch import load_file, save_file

    from parallel.distributed.seed import derive_seed
    from parallel.sample import main

    folder = tmp_path / "transformer"
    transformer = _transformer("rope3d", folder)
    gen = torch.Generator().manual_seed(11)
    text, uncond = torch.randn(TEXT, 32, generator=gen), torch.randn(TEXT, 32, generator=gen)
    save_file({"text": text}, str(tmp_path / "prompt.safetensors"))
    save_file({"text": uncond}, str(tmp_path / "negative.safetensors"))
    sets = ["model.num_layers=2", f"model.hidden_size={HEADS * HEAD_DIM}", f"model.num_heads={HEADS}",
            f"model.head_dim={HEAD_DIM}", "model.time_embed_dim=24", "model.pos_embed=rope3d",
            f"model.sample_height={SIZE}", f"model.sample_width={SIZE}", f"model.init_from={folder}",
            f"data.num_frames={(FRAMES - 1) * 4 + 1}", f"data.height={SIZE * 8}", f"data.width={SIZE * 8}",
            "val.sampler=dpm", "val.guidance_scale=6", "val.use_dynamic_cfg=true"]
    out = tmp_path / "out"
    argv = ["--config", "debug", *[a for s in sets for a in ("--set", s)], "--prompt-embeds",
            str(tmp_path / "prompt.safetensors"), "--negative-embeds", str(tmp_path / "negative.safetensors"),
            "--steps", "5", "--seed", "3", "--out", str(out)]
    assert main(argv) == 0
    got = load_file(str(out / "latents.safetensors"))["prompt0"]
    assert (out / "prompt0.gif").is_file() and (out / "prompt0.txt").read_text().strip().endswith("prompt.safetensors")

    g = torch.Generator().manual_seed(derive_seed(3, "sample", 0))
    noise = torch.randn(1, 4, FRAMES, SIZE, SIZE, generator=g)
    pipe = CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                             scheduler=CogVideoXDPMScheduler(**RELEASE, snr_shift_scale=1.0))
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        want = pipe(prompt_embeds=text[None], negative_prompt_embeds=uncond[None], latents=noise.transpose(1, 2),
                    num_frames=(FRAMES - 1) * 4 + 1, height=SIZE * 8, width=SIZE * 8, num_inference_steps=5,
                    guidance_scale=6, use_dynamic_cfg=True, output_type="latent", generator=g).frames
    torch.testing.assert_close(got, want[0].transpose(0, 1))

    # Refused before any model loads, every problem at once.
    capsys.readouterr()
    assert main(["--config", "debug", "--set", "val.guidance_scale=6", "--prompt", "a cat", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "model.init_from is not set" in err and "--prompt needs a T5 encoder" in err
    assert "val.guidance_scale=6.0 needs the unconditional embedding" in err


# --- a batch from --noise: the pipeline's batch, one process here (tp 2 x pp 2: tests/distributed) -------------


@pytest.mark.parametrize("kind", ["ddim", "dpm"])
def test_sample_command_batch_from_noise_equals_the_pipeline(tmp_path, kind):
    """--prompt-embeds/--negative-embeds [2, L, D], --noise [2, C, T, H, W], --out FILE.safetensors: the file's
    `latents` equal the pipeline's batch (one generator for both rows); no videos without a decoder."""
    from safetensors.torch import load_file

    from parallel.sample import main

    transformer = _transformer(CASES[kind][0], tmp_path / "transformer")
    tensors = batch_files(tmp_path)
    out = tmp_path / "latents.safetensors"
    assert main(sample_argv(kind, tmp_path / "transformer", tmp_path, out)) == 0
    got = load_file(str(out))
    assert list(got) == ["latents"] and not (tmp_path / "latents").exists()
    torch.testing.assert_close(got["latents"], pipeline_latents(kind, transformer, tensors))


def test_sample_command_refuses_mismatched_batches(tmp_path, capsys):
    """Noise of the wrong batch and size, negative embeddings of the wrong batch, no weights: one message each."""
    from safetensors.torch import save_file

    from parallel.sample import main

    _transformer("sincos", tmp_path / "transformer")
    batch_files(tmp_path)
    save_file({"noise": torch.randn(3, 4, FRAMES, SIZE + 2, SIZE)}, str(tmp_path / "noise.safetensors"))
    save_file({"negative": torch.randn(3, TEXT, 32)}, str(tmp_path / "negative.safetensors"))
    save_file({"prompt": torch.randn(BATCH, TEXT + 1, 32)}, str(tmp_path / "prompt.safetensors"))
    argv = sample_argv("ddim", tmp_path / "transformer", tmp_path, tmp_path / "x.safetensors")
    assert main(argv + ["--ema", "--sampler", "euler"]) == 1
    err = capsys.readouterr().err
    want = f"[2, 4, {FRAMES}, {SIZE}, {SIZE}]"
    assert f"shape [3, 4, {FRAMES}, {SIZE + 2}, {SIZE}], expected [B, C, T, H, W] = {want}" in err
    assert "3 rows for 2 prompts; give 1 or 2" in err
    assert f"[.., L, D] = [2, {TEXT + 1}, 32], the model takes [L, D] = [{TEXT}, 32]" in err
    assert "--ema reads a checkpoint's EMA" in err and "sampler 'euler' does not fit objective 'v_prediction'" in err
