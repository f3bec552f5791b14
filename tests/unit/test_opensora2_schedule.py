"""Open-Sora 2.0's training timesteps and sampler (configs/opensora2.0.yaml: model.train_timesteps opensora,
model.schedule.sigma_min 1e-5, val.sampler opensora), each against a re-statement of hpcaitech/Open-Sora's code
(line numbers at its commit 7ad6a96):

- the draw: scripts/diffusion/train.py:384-390 (sigmoid of a normal draw, then get_res_lin_function x sqrt(T) and
  time_shift) on the same generator gives the same noise levels bit for bit, at several buckets;
- the noising: train.py:433-434 (x_t with sigma_min) and the target of train.py:443/462;
- the sampler: get_schedule (opensora/utils/sampling.py:307-332) sigmas bit for bit, and I2VDenoiser.denoise
  (sampling.py:159-226: three predictions per step, oscillating text and image guidance, text-to-video's zero
  condition) on the tiny checkpoint of tests/unit/test_opensora2.py equal to the toolkit's sampler on the toolkit's
  model read from that checkpoint, over 12 steps (the oscillation starts at step 10).
- the training batches (parallel/train/data.py) carry that draw, x_t and target per sample.
Training through the draw in split layouts needs no test of its own: the draw happens per sample in the data path
before the model, from the sample's generator keyed on its global position, so every layout feeds the model the
tensors the one-process batches hold here (and the layouts' equality to one process is the family's own tests').
"""
import math

import pytest
import torch
from safetensors.torch import load_file

from models.diffusion import Objective, open_sora_shift
from models.hunyuanvideo import SPEC
from models.sampling import open_sora_sigmas, sample, sampling_timesteps
from parallel.experiment.config import load_config
from parallel.distributed.topology import ParallelContext
from parallel.weights.opensora import load_opensora
from tests.helpers.opensora2 import checkpoint, config, inputs, opensora_forward, random_model  # noqa: F401

BUCKETS = [(16, 33, 72, 128), (16, 1, 32, 32), (16, 3, 8, 12), (16, 9, 48, 84)]


def opensora_draw(g, x_0_shape):
    """scripts/diffusion/train.py:384-390, bs = 1 (the generator in place of the global one)."""
    m = (3 - 1) / (4096 - 256)                                       # get_res_lin_function(), sampling.py:299-304
    shift_alpha = m * ((x_0_shape[-1] * x_0_shape[-2]) // 4) + (1 - m * 256)
    shift_alpha *= math.sqrt(x_0_shape[-3])
    t = torch.sigmoid(torch.randn((1,), generator=g))
    return shift_alpha * t / (1 + (shift_alpha - 1) * t)             # time_shift, sampling.py:295-296


def test_the_draw_is_opensoras():
    model = load_config("opensora2.0").model
    assert model.train_timesteps == "opensora" and model.schedule.sigma_min == 1e-5
    assert abs(open_sora_shift(BUCKETS[0]) - model.schedule.shift) < 5e-3        # the preset's 11.87
    for seed, shape in enumerate(BUCKETS):
        for _ in range(3):
            ours = SPEC.timesteps.draw(torch.Generator().manual_seed(seed), shape, model)
            assert ours.dtype == torch.float32 and ours.shape == (1,)
            assert torch.equal(ours, opensora_draw(torch.Generator().manual_seed(seed), shape))
    # its distribution: the median of sigmoid(N(0, 1)) is 1/2, shifted a / (a + 1)
    g, a = torch.Generator().manual_seed(0), open_sora_shift(BUCKETS[0])
    draws = torch.cat([SPEC.timesteps.draw(g, BUCKETS[0], model) for _ in range(2000)])
    assert abs(draws.median().item() - a / (a + 1)) < 0.01
    # HunyuanVideo's own draw is unchanged: uniform integers
    hunyuan = load_config("debug-hunyuan").model
    assert hunyuan.train_timesteps == "uniform"
    t = SPEC.timesteps.draw(torch.Generator().manual_seed(3), BUCKETS[2], hunyuan)
    assert t.dtype == torch.int64 and torch.equal(t, torch.randint(0, 1000, (1,),
                                                                    generator=torch.Generator().manual_seed(3)))


def test_noising_is_opensoras():
    objective = Objective.of(load_config("opensora2.0").model)
    g = torch.Generator().manual_seed(1)
    x_0, x_1 = torch.randn(2, 4, 3, 8, 12, generator=g), torch.randn(2, 4, 3, 8, 12, generator=g)
    t = torch.cat([opensora_draw(g, x_0.shape) for _ in range(2)])
    x_t, target = objective.noised(x_0, x_1, t)
    t_rev, sigma_min = (1 - t)[:, None, None, None, None], 1e-5         # train.py:433-434
    assert torch.equal(x_t, t_rev * x_0 + (1 - (1 - sigma_min) * t_rev) * x_1)
    assert torch.equal(target, (1 - sigma_min) * x_1 - x_0)             # train.py:443, 462
    assert torch.equal(objective.model_timesteps(t), t * 1000)          # layers.py timestep_embedding: 1000 t


@pytest.mark.parametrize("steps,shape", [(1, BUCKETS[2]), (12, BUCKETS[2]), (50, BUCKETS[0])])
def test_sampler_sigmas_are_opensoras(steps, shape):
    m = (3 - 1) / (4096 - 256)
    alpha = (m * ((shape[-1] * shape[-2]) // 4) + (1 - m * 256)) * math.sqrt(shape[-3])   # get_schedule:320-328
    timesteps = torch.linspace(1, 0, steps + 1)
    timesteps = alpha * timesteps / (1 + (alpha - 1) * timesteps)
    assert open_sora_sigmas(steps, open_sora_shift(shape)).tolist() == timesteps.tolist()
    assert sampling_timesteps("flow_matching", steps, "opensora", shift=alpha) == (timesteps[:-1] * 1000).tolist()


def opensora_denoise(model, img, text, neg, timesteps, guidance, guidance_img):
    """I2VDenoiser.denoise (sampling.py:159-226), text-to-video (masks and masked_ref zeros: the three rows' cond
    the same zeros, which opensora_forward feeds), text_osci = image_osci = True, no temporal oscillation."""
    osci = lambda gs, i: gs if i < 10 or (i >= 10 and i % 2 == 0) else 1.0   # noqa: E731  get_oscillation_gs
    txt = torch.cat([text, neg, neg])                                       # prepare_guidance: text + neg + neg
    for i, (t_curr, t_prev) in enumerate(zip(timesteps[:-1], timesteps[1:])):
        t_vec = torch.full((3 * len(img),), t_curr, dtype=img.dtype)
        pred = model(torch.cat([img, img, img]), t_vec, txt)
        text_gs, image_gs = osci(guidance, i), osci(guidance_img, i)
        cond, uncond, uncond_2 = pred.chunk(3, dim=0)
        pred = uncond_2 + image_gs * (uncond - uncond_2) + text_gs * (cond - uncond)
        img = img + (t_prev - t_curr) * pred
    return img


def test_sampler_latents_equal_opensoras_loop(checkpoint):  # noqa: F811
    path, _ = checkpoint
    cfg = config("model.cond_embed=true", "val.sampler=opensora")
    ours = random_model(cfg, 2)
    load_opensora(ours, ParallelContext.single(), cfg.model, path)
    sd = load_file(str(path))
    noise, _, text = inputs()
    noise, text, neg = noise[:1], text[:1], text[1:]
    steps, shape = 12, noise.shape
    m = (3 - 1) / (4096 - 256)
    alpha = (m * ((shape[-1] * shape[-2]) // 4) + (1 - m * 256)) * math.sqrt(shape[-3])
    timesteps = torch.linspace(1, 0, steps + 1)
    timesteps = (alpha * timesteps / (1 + (alpha - 1) * timesteps)).tolist()
    with torch.no_grad():
        want = opensora_denoise(lambda x, t, y: opensora_forward(sd, x, t * 1000, y, heads=4), noise.clone(),
                                text, neg, timesteps, 7.5, 3.0)
        rows = {True: text, False: neg}
        got = sample(lambda x, t, c: ours.predict((x, t, rows[c])), noise, Objective.of(cfg.model), steps,
                     cfg.val.sampler, 7.5)
    torch.testing.assert_close(got, want)


def test_mixes_refused_by_name():
    with pytest.raises(ValueError, match=r"model.schedule.sigma_min=1e-05 is flow matching's .*--set "
                                         r"model.schedule.sigma_min=0"):
        load_config("debug", ["model.schedule.sigma_min=1e-5"])
    with pytest.raises(ValueError, match=r"model.train_timesteps=opensora .* model.patch_size=1"):
        load_config("debug-hunyuan", ["model.train_timesteps=opensora", "model.patch_size=1"])
    with pytest.raises(ValueError, match=r"model.train_timesteps"):
        load_config("debug-wan", ["model.train_timesteps=opensora"])
    with pytest.raises(ValueError, match=r"use_dynamic_cfg"):
        sample(lambda x, t, c: x, torch.zeros(1, 4, 1, 4, 4), Objective("flow_matching"), 2, "opensora", 2.0,
               use_dynamic_cfg=True)
    from models.sampling import check_sampler
    from models.wan import SPEC as WAN
    with pytest.raises(ValueError, match=r"unknown sampler 'opensora'|does not fit"):
        check_sampler("flow_matching", "opensora", WAN.sampling.samplers)


def test_training_batches_draw_opensoras_noise_levels():
    """The data path (parallel/train/data.py DiffusionBatches, the family's draw from each sample's generator after
    its noise) gives the model 1000 s and Open-Sora's x_t and target at each sample's own s."""
    from parallel.train.data import DiffusionBatches, SyntheticLatents, _generator
    model = load_config("opensora2.0").model
    dataset = SyntheticLatents(4, 4, (3, 8, 12), 6, 10, seed=5)
    batches = DiffusionBatches(dataset, Objective.of(model), seed=9, micro_batch=2, grad_accum=1, dp_rank=0,
                               dp_size=1, timesteps=SPEC.timesteps, model=model)
    (x_t, t, _), target = batches.micro_batch(0, 0)
    for j in range(2):
        x_0 = dataset[batches.sample_index(j)][0]
        g = _generator(9, "noise", j)
        x_1 = torch.randn(x_0.shape, generator=g)
        s = opensora_draw(g, x_0.shape)
        assert torch.equal(t[j:j + 1], s * 1000)
        assert torch.equal(x_t[j], (1 - s) * x_0 + (1 - (1 - 1e-5) * (1 - s)) * x_1)
        assert torch.equal(target[j], (1 - 1e-5) * x_1 - x_0)
