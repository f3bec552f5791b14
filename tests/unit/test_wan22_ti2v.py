"""Wan 2.2 TI2V-5B (model.expand_timesteps, models/wan/ti2v.py) against diffusers 0.42 in one process, fp32, on a
tiny random WanTransformer3DModel (48 -> 8 latent channels) and a tiny AutoencoderKLWan of the 2.2 kind
(`is_residual`, `patch_size` 2: 16 x 16 spatial, 4 x temporal compression):

  - predictions with a timestep per token ([B, S] as diffusers takes it, [B, T, H, W] as training draws it, [B]
    as the samplers give it: the first frame's tokens at 0 for image-to-video) equal diffusers';
  - training keeps the first latent frame clean (t = 0) and leaves it out of the loss;
  - the picture latents (data preparation, sampling) equal the pipeline's prepare_latents;
  - sampling equals WanPipeline / WanImageToVideoPipeline(expand_timesteps=True, output_type="latent"), through
    models.sampling and through `python -m parallel.sample`;
  - the preset counts diffusers' parameters of the 5B model (meta device).
Every (tp, pp) layout, sp 2, the export and training equivalence: tests/distributed/test_wan_layouts.py.
"""
import numpy as np
import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline
from diffusers import WanTransformer3DModel

from parallel.model.build import layer_specs
from parallel.experiment.config import load_config
from parallel.distributed.pipeline import SequentialDiT
from parallel.distributed.topology import ParallelContext
from tests.released_utils import read_release
from tests.helpers.wan22_ti2v import (B, C, DIFFUSERS_TINY, FRAMES, HEIGHT, PIXELS, PRESET, TOKENS, WIDTH,
                                      diffusers_forward, inputs, overrides)
from tests.helpers.wan22_ti2v import released_ti2v, vae_and_picture  # noqa: F401  (fixtures)

SHIFT, STEPS, GUIDANCE = 5.0, 4, 2.0


def toolkit(folder, *extra):
    cfg, ours, read = read_release(PRESET, overrides(folder) + list(extra), folder)
    return cfg, ours.eval(), read


def test_forward_equals_diffusers_with_a_timestep_per_token(released_ti2v):
    folder, model = released_ti2v
    _, ours, read = toolkit(folder)
    assert read == sum(p.numel() for p in model.parameters())
    latents, per_token, text = inputs()
    with torch.no_grad():
        torch.testing.assert_close(ours.predict((latents, per_token, text)), diffusers_forward(model, *inputs()))
        # training's [B, T, H, W] (constant within a patch) is read at each patch's first position
        grid = per_token.view(B, FRAMES, HEIGHT // 2, WIDTH // 2).repeat_interleave(2, 2).repeat_interleave(2, 3)
        torch.testing.assert_close(ours.predict((latents, grid, text)), diffusers_forward(model, *inputs()))
        # the samplers' [B]: image-to-video, the pipeline's first_frame_mask * t
        t = torch.tensor([3.0, 811.0])
        mask = torch.ones(FRAMES, TOKENS // FRAMES)
        mask[0] = 0
        want = diffusers_forward(model, latents, mask.flatten()[None] * t[:, None], text)
        torch.testing.assert_close(ours.predict((latents, t, text)), want)
    # text-to-video (image_condition false): every token at t, as WanPipeline's all-ones mask
    _, t2v, _ = toolkit(folder, "model.image_condition=false")
    with torch.no_grad():
        torch.testing.assert_close(t2v.predict((latents, t, text)),
                                   diffusers_forward(model, latents, t[:, None].expand(B, TOKENS), text))


def test_reference_and_the_verify_command(released_ti2v, capsys):
    """The released format's example batch has a timestep per token; its reference is diffusers' forward on it
    and python -m parallel.verify passes on the folder."""
    from models.wan.released import DIFFUSERS
    from parallel import verify
    folder, model = released_ti2v
    cfg = load_config(PRESET, overrides(folder))
    x = DIFFUSERS.example_inputs(cfg.model, cfg.data, 2, torch.Generator().manual_seed(1))
    assert x[1].shape == (2, FRAMES, HEIGHT, WIDTH) and not torch.equal(x[1][0, 1], x[1][0, 2])
    tokens = x[1][:, :, ::2, ::2].flatten(1)
    torch.testing.assert_close(DIFFUSERS.reference(str(folder), x), diffusers_forward(model, x[0], tokens, x[2]))
    assert verify.main(["--config", PRESET, *(f"--set={o}" for o in overrides(folder))]) == 0
    assert "equal at --tolerance" in capsys.readouterr().out


def test_preset_counts_the_parameters_diffusers_builds():
    """wan2.2-ti2v-5b: python -m models' count equals WanTransformer3DModel's at the release's config (meta)."""
    from models.__main__ import summary
    with torch.device("meta"):
        reference = WanTransformer3DModel(num_attention_heads=24, attention_head_dim=128, ffn_dim=14336, num_layers=30,
                                          in_channels=48, out_channels=48, text_dim=4096)
    want = sum(p.numel() for p in reference.parameters())
    assert want == 4_999_787_712
    assert f"parameters: {want}" in summary(load_config("wan2.2-ti2v-5b")).splitlines()


def test_training_keeps_the_first_frame_clean_and_out_of_the_loss():
    from models.diffusion import Objective
    from parallel.model.build import SequenceLoss
    from parallel.train.run import training_batches
    cfg = load_config(PRESET)
    (x_t, t, _), target = next(training_batches(cfg, ParallelContext.single()))
    assert t.shape == (2, 3, 8, 8) and (t[:, 0] == 0).all() and (t[:, 1:] > 0).all()
    assert all(len(set(row[1:].flatten().tolist())) == 1 for row in t)     # one timestep per sample after frame 0
    # x_t = (1 - s) x0 + s e with s = 0 on frame 0: x0's latent, exactly; the target there is e - x0 anyway
    torch.testing.assert_close(x_t[:, :, 0], (x_t - Objective.of(cfg.model).flow_sigmas(t)[:, None] * target)[:, :, 0],
                               rtol=0, atol=0)
    loss = SequenceLoss(cfg, ParallelContext.single())
    prediction = torch.randn(target.shape, generator=torch.Generator().manual_seed(2))
    want = torch.nn.functional.mse_loss(prediction[:, :, 1:], target[:, :, 1:])
    torch.testing.assert_close(loss(prediction, target), want, rtol=0, atol=0)
    prediction[:, :, 0] += 100
    torch.testing.assert_close(loss(prediction, target), want, rtol=0, atol=0)
    t2v = load_config(PRESET, ["model.image_condition=false"])
    (_, t, _), _ = next(training_batches(t2v, ParallelContext.single()))
    assert all(len(set(row.flatten().tolist())) == 1 for row in t)


def test_picture_latents_are_the_pipelines(released_ti2v, vae_and_picture):
    """The VAE's compression read from its config; data preparation's stored first frame and sampling's picture
    latents equal WanImageToVideoPipeline(expand_timesteps=True).prepare_latents' condition; a clip's training
    latent and its decoding are the pipelines' normalisation and its inverse."""
    from models.vae import check_vae, decode, encode
    from models.wan.ti2v import TI2VCondition, encode_pictures
    vae, picture = vae_and_picture
    cfg = load_config(PRESET, [f"data.num_frames={PIXELS[0]}", f"data.height={PIXELS[1]}", f"data.width={PIXELS[2]}"])
    assert check_vae(dict(vae.config, _class_name="AutoencoderKLWan"), cfg.model, cfg.data) == []
    pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=released_ti2v[1],
                                   scheduler=UniPCMultistepScheduler(), expand_timesteps=True)
    image = pipe.video_processor.preprocess(picture, height=PIXELS[1], width=PIXELS[2]).float()
    with torch.no_grad():
        _, condition, mask = pipe.prepare_latents(image, 1, C, *PIXELS[1:], PIXELS[0], torch.float32, "cpu")
    assert condition.shape == (1, C, 1, 4, 6) and mask[0, 0, 0].sum() == 0
    torch.testing.assert_close(encode_pictures(vae, [picture], *PIXELS[1:]), condition)
    clip = np.stack([np.asarray(picture)] + [np.full((*PIXELS[1:], 3), 17, np.uint8)] * (PIXELS[0] - 1))
    stored = TI2VCondition(cfg.model, cfg.data).stored_tensors(encode, vae, clip, None, None)
    assert list(stored["image"].shape) == TI2VCondition(cfg.model, cfg.data).stored_shapes([C, 3, 4, 6])["image"]
    torch.testing.assert_close(stored["image"][None], condition, atol=1e-5, rtol=1e-4)   # /127.5 - 1 vs /255 * 2 - 1
    # the clip's training latent (data preparation, the posterior's mode) and its decoding, in the pipelines'
    # arithmetic: (z - latents_mean) * (1 / latents_std); WanPipeline decodes z / (1 / latents_std) + latents_mean
    mean, inv_std = (torch.tensor(v).view(1, C, 1, 1, 1) for v in (vae.config.latents_mean,
                                                                   [1 / s for s in vae.config.latents_std]))
    pixels = torch.from_numpy(clip).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
    with torch.no_grad():
        want = (vae.encode(pixels).latent_dist.mode() - mean) * inv_std
        latent = encode(vae, clip)
        torch.testing.assert_close(latent[None], want)
        video = vae.decode(latent[None] / inv_std + mean).sample[0]
    torch.testing.assert_close(decode(vae, latent), ((video.permute(1, 2, 3, 0) + 1) / 2).clamp(0, 1))


def test_sampling_equals_the_pipelines(released_ti2v, vae_and_picture, tmp_path):
    """UniPC (flow_shift 5), 4 steps, guidance 2 from the same noise: text-to-video equals WanPipeline's latents,
    image-to-video WanImageToVideoPipeline's (frame 0 the picture's latent), both with expand_timesteps, through
    models.sampling, and image-to-video through python -m parallel.sample --image-latents."""
    from safetensors.torch import load_file, save_file

    from models.diffusion import Objective
    from models.sampling import sample
    from models.wan.ti2v import TI2VCondition, encode_pictures
    from parallel.sample import main

    folder, model = released_ti2v
    vae, picture = vae_and_picture
    g = torch.Generator().manual_seed(11)
    tensors = {"noise": torch.randn(1, C, 3, 4, 6, generator=g), "prompt": torch.randn(1, 8, 32, generator=g),
               "negative": torch.randn(1, 8, 32, generator=g)}
    common = dict(prompt_embeds=tensors["prompt"], negative_prompt_embeds=tensors["negative"],
                  num_frames=PIXELS[0], height=PIXELS[1], width=PIXELS[2], num_inference_steps=STEPS,
                  guidance_scale=GUIDANCE, output_type="latent")

    def scheduler():
        return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=SHIFT)
    with torch.no_grad():
        want = {"t2v": WanPipeline(None, None, vae, scheduler(), model, expand_timesteps=True)(
                    latents=tensors["noise"].clone(), **common).frames,
                "i2v": WanImageToVideoPipeline(None, None, vae, scheduler(), transformer=model, expand_timesteps=True)(
                    image=picture, latents=tensors["noise"].clone(), **common).frames}
    sizes = [f"data.num_frames={PIXELS[0]}", f"data.height={PIXELS[1]}", f"data.width={PIXELS[2]}"]
    for name, value in tensors.items():
        save_file({name: value.contiguous()}, str(tmp_path / f"{name}.safetensors"))
    for case, image in (("t2v", "false"), ("i2v", "true")):
        cfg, ours, _ = toolkit(folder, *sizes, f"model.image_condition={image}")
        condition = TI2VCondition(cfg.model, cfg.data)
        first = encode_pictures(vae, [picture], *PIXELS[1:])

        def predict(x, t, conditional):
            x = condition.sampling_input(x, first) if case == "i2v" else x
            with torch.no_grad():
                return ours.predict((x, t, tensors["prompt" if conditional else "negative"]))
        got = sample(predict, tensors["noise"], Objective.of(cfg.model), STEPS, "unipc", GUIDANCE)
        got = condition.sampled(got, first) if case == "i2v" else got
        torch.testing.assert_close(got, want[case], msg=lambda m: f"{case}: {m}")
    # the command (image-to-video: the picture's latents [C, 1, H, W], put back in frame 0 after the last step)
    save_file({"first": first[0].contiguous()}, str(tmp_path / "first.safetensors"))
    args = ["--config", PRESET, *[a for s in overrides(folder) + sizes for a in ("--set", s)],
            "--prompt-embeds", str(tmp_path / "prompt.safetensors"), "--negative-embeds",
            str(tmp_path / "negative.safetensors"), "--noise", str(tmp_path / "noise.safetensors"),
            "--steps", str(STEPS), "--guidance", str(GUIDANCE), "--sampler", "unipc",
            "--image-latents", str(tmp_path / "first.safetensors"), "--out", str(tmp_path / "i2v.safetensors")]
    assert main(args) == 0
    torch.testing.assert_close(load_file(str(tmp_path / "i2v.safetensors"))["latents"], want["i2v"])


def test_validation_conditions_on_the_clean_first_frame():
    """validation_loss of debug-wan22-ti2v on synthetic data: x_t with x0's first frame, its tokens at t = 0, the
    loss over the later frames (inputs built here with explicit per-position timesteps); sample_latents returns
    x0's first frame in frame 0."""
    import types

    from models.diffusion import Objective
    from parallel.train.run import build_val_dataset
    from parallel.validation.validate import StageForward, sample_latents, validation_loss, validation_noise

    cfg = load_config(PRESET, ["val.num_samples=2", "val.timesteps=[100,700]", "val.num_prompts=1",
                               "val.sample_steps=2", "val.guidance_scale=1"])
    ctx = ParallelContext.single()
    torch.manual_seed(0)
    model = SequentialDiT(layer_specs(cfg, ctx)).eval()
    forward = StageForward(types.SimpleNamespace(module=model, device=torch.device("cpu")), ctx)
    dataset, objective = build_val_dataset(cfg), Objective.of(cfg.model)
    got = validation_loss(forward, dataset, objective, cfg, ctx)["val_loss"]
    losses, t = [], torch.tensor(cfg.val.timesteps)
    for i in range(2):
        x0, text = dataset[i]
        x_t, target = objective.noised(x0.expand(2, *x0.shape), validation_noise(cfg.train.seed, i, [100, 700],
                                                                                  x0.shape), t)
        x_t[:, :, 0] = x0[:, 0]
        grid = objective.model_timesteps(t)[:, None, None, None].repeat(1, *x0.shape[1:])
        grid[:, 0] = 0
        with torch.no_grad():
            pred = model.predict((x_t, grid, text.expand(2, *text.shape)))
        losses.append(((pred - target)[:, :, 1:] ** 2).flatten(1).mean(1))
    torch.testing.assert_close(torch.tensor(got), torch.cat(losses).mean())
    latent = sample_latents(forward, dataset, objective, cfg, ctx)[0]
    assert torch.equal(latent[:, 0], dataset[0][0][:, 0])


def test_wrong_settings_and_folders_are_refused_by_key(released_ti2v, tmp_path):
    """expand_timesteps with an image cross-attention, experts or temporal patches is refused by key; a Wan 2.1
    image-to-video transformer folder (36 channels in, 16 out) read as TI2V names the keys."""
    from parallel.experiment.config import ConfigError
    from parallel.weights.diffusers import check_released
    for extra, message in ((["model.image_dim=24", "model.added_kv_proj_dim=64", "model.max_text_len=512"],
                            "model.expand_timesteps=true with model.image_dim: "),
                           (["model.experts={boundary_ratio: 0.9}"], "model.expand_timesteps=true with model.experts: "),
                           (["model.patch_size_t=2"], "model.patch_size_t=2 with model.expand_timesteps=true: ")):
        with pytest.raises(ConfigError, match=message):
            load_config(PRESET, extra)
    folder, _ = released_ti2v
    WanTransformer3DModel(**{**DIFFUSERS_TINY, "in_channels": 36, "out_channels": 16}).save_pretrained(tmp_path / "i2v")
    cfg = load_config(PRESET, overrides(tmp_path / "i2v"))
    problems = check_released(cfg.model, tmp_path / "i2v")
    assert any("in_channels 36 != out_channels 16: model.expand_timesteps" in p for p in problems), problems
    assert any("out_channels 16 != model.in_channels 8; set --set model.in_channels=16" in p for p in problems)
    assert check_released(load_config(PRESET, overrides(folder)).model, folder) == []
