"""Samplers against oracle models, and the media validation writes: GIF/MP4 round trips, previews, plots, index."""
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from models.diffusion import Objective
from models.sampling import sample, sampling_timesteps
from parallel.validation.media import (Sample, latent_preview, load_decoder, plot_losses, to_uint8, write_gif,
                                       write_index, write_mp4)

SHAPE = (2, 4, 3, 4, 4)     # B, C, T, H, W


def _pair(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)


def test_timesteps():
    assert sampling_timesteps("v_prediction", 4) == [999, 749, 499, 249]
    assert sampling_timesteps("v_prediction", 3) == [999, 666, 332]
    assert sampling_timesteps("v_prediction", 50)[-3:] == [59, 39, 19]
    assert sampling_timesteps("flow_matching", 4) == [999, 750, 500, 250]
    assert sampling_timesteps("flow_matching", 1000)[-1] == 1


@pytest.mark.parametrize("steps", [1, 10, 50])
def test_ddim_with_oracle_v_recovers_x0_along_the_training_path(steps):
    """v computed exactly from x_t for a fixed x0*: the sampler visits x_t = sqrt(a) x0* + sqrt(1-a) noise at
    every timestep (DDIM with eta = 0 keeps the noise) and returns x0*."""
    obj = Objective("v_prediction")
    x0, noise = _pair()
    ab = obj.alphas_cumprod.double()
    seen = []

    def oracle(x_t, t, conditional):
        seen.append((x_t.clone(), t.clone()))
        a = ab[t].view(-1, 1, 1, 1, 1)
        e = (x_t.double() - a.sqrt() * x0) / (1 - a).sqrt()       # a < 1 at every t; a = 0 at t = 999 gives e = x_t
        return (a.sqrt() * e - (1 - a).sqrt() * x0).float()

    out = sample(oracle, noise, obj, steps)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x0, rtol=1e-5, atol=1e-5)
    assert [int(t[0]) for _, t in seen] == sampling_timesteps("v_prediction", steps)
    for x_t, t in seen:
        torch.testing.assert_close(x_t, obj.noised(x0, noise, t)[0], rtol=1e-5, atol=1e-5)


def _flow_oracle(x0: torch.Tensor, seen: list):
    """u = e - x0* with e solved from x_t = (1 - s) x0* + s e, s = t / 1000 (t the integer the model gets)."""
    def oracle(x_t, t, conditional):
        seen.append(int(t[0]))
        s = (t.double() / 1000).view(-1, 1, 1, 1, 1)
        e = (x_t.double() - (1 - s) * x0) / s
        return (e - x0).float()
    return oracle


@pytest.mark.parametrize("steps", [2, 8, 10])
def test_euler_with_oracle_u_recovers_x0(steps):
    """The first step feeds t = 999 at s = 1; the last step (s = 1/steps, t exact as 1000/steps is whole)
    then lands on x0* exactly: x - x0* shrinks by 1 - s / (t/1000) = 0 there."""
    obj = Objective("flow_matching")
    x0, noise = _pair(1)
    seen = []
    torch.testing.assert_close(sample(_flow_oracle(x0, seen), noise, obj, steps), x0, rtol=1e-5, atol=1e-5)
    assert seen == sampling_timesteps("flow_matching", steps) == [min(999, 1000 - 1000 * i // steps)
                                                                  for i in range(steps)]


def test_euler_updates_with_exact_s_not_the_model_timestep():
    """One step: the model sees t = 999 but x moves by the whole s = 1 -> 0:
    x = noise - u, u = (noise - 0.001 x0*) / 0.999 - x0*."""
    x0, noise = _pair(1)
    seen = []
    out = sample(_flow_oracle(x0, seen), noise, Objective("flow_matching"), 1)
    expected = noise.double() - ((noise.double() - 0.001 * x0) / 0.999 - x0)
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-6)
    assert seen == [999]
    assert (out - x0).abs().max() > 1e-4             # and so not x0* itself


@pytest.mark.parametrize("kind", ["v_prediction", "flow_matching"])
@pytest.mark.parametrize("g", [1.0, 3.0])
def test_guidance_mixes_predictions_and_counts_calls(kind, g):
    """One step from noise: euler gives noise - out (s: 1 -> 0); ddim at a = 0 gives x0 = -out (v = -x0)."""
    _, noise = _pair(2)
    cond, uncond = torch.full(SHAPE, 2.0), torch.full(SHAPE, -0.5)
    calls = []

    def predict(x_t, t, conditional):
        calls.append(conditional)
        return cond if conditional else uncond

    out = sample(predict, noise, Objective(kind), 1, guidance_scale=g)
    mixed = torch.full(SHAPE, -0.5 + g * 2.5)
    torch.testing.assert_close(out, noise - mixed if kind == "flow_matching" else -mixed, rtol=1e-6, atol=1e-6)
    assert calls == ([True] if g == 1.0 else [True, False])
    calls.clear()
    sample(predict, noise, Objective(kind), 5, guidance_scale=g)
    assert calls == ([True] * 5 if g == 1.0 else [True, False] * 5)


@pytest.mark.parametrize("kind", ["v_prediction", "flow_matching"])
def test_same_noise_same_sample_bit_for_bit(kind):
    torch.manual_seed(0)
    net = torch.nn.Conv3d(4, 4, 3, padding=1)

    def predict(x_t, t, conditional):
        with torch.no_grad():
            return net(x_t) * (t.float().view(-1, 1, 1, 1, 1) / 1000) + (0.1 if conditional else 0.0)

    _, noise = _pair(3)
    first = sample(predict, noise.clone(), Objective(kind), 6, guidance_scale=4.0)
    assert torch.equal(first, sample(predict, noise.clone(), Objective(kind), 6, guidance_scale=4.0))
    assert not torch.equal(first, sample(predict, noise + 1e-3, Objective(kind), 6, guidance_scale=4.0))


def test_bad_sampler_or_steps():
    zero = lambda x, t, c: torch.zeros_like(x)
    _, noise = _pair()
    with pytest.raises(ValueError, match="sampler 'ddim' does not fit objective 'flow_matching'"):
        sample(zero, noise, Objective("flow_matching"), 4, sampler="ddim")
    with pytest.raises(ValueError, match="sampler 'euler' does not fit objective 'v_prediction'"):
        sample(zero, noise, Objective("v_prediction"), 4, sampler="euler")
    with pytest.raises(ValueError, match="unknown sampler 'heun'"):
        sample(zero, noise, Objective("v_prediction"), 4, sampler="heun")
    with pytest.raises(ValueError, match="steps must be in"):
        sample(zero, noise, Objective("v_prediction"), 0)


def _pattern(t: int, h: int, w: int) -> np.ndarray:
    """Few colours, frames 0 and 1 identical (a GIF writer must not merge them)."""
    colours = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 255], [0, 0, 0], [40, 80, 120]], np.uint8)
    idx = (np.arange(h)[:, None] // 4 + np.arange(w)[None, :] // 4 + np.maximum(np.arange(t) - 1, 0)[:, None, None])
    return colours[idx % len(colours)]


def test_gif_round_trip(tmp_path):
    frames = _pattern(5, 13, 20)
    path = write_gif(frames, tmp_path / "a" / "v.gif", fps=8)
    with Image.open(path) as im:
        assert (im.n_frames, im.size, im.info["loop"]) == (5, (20, 13), 0)
        read = []
        for i in range(im.n_frames):
            im.seek(i)
            assert im.info["duration"] == 120       # 1/8 s in GIF's 1/100 s units
            read.append(np.asarray(im.convert("RGB")))
    np.testing.assert_array_equal(np.stack(read), frames)


def test_mp4_round_trip(tmp_path):
    import imageio_ffmpeg
    frames = _pattern(6, 33, 48)                    # odd height: padded to 34
    path = write_mp4(frames, tmp_path / "v.mp4", fps=8)
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    assert tuple(meta["size"]) == (48, 34) and meta["fps"] == 8
    read = np.stack([np.frombuffer(f, np.uint8).reshape(34, 48, 3) for f in reader])
    assert read.shape[0] == 6
    err = np.abs(read[:, :33].astype(int) - frames.astype(int))
    assert err.mean() < 8, err.mean()               # lossy H.264 with 4:2:0 chroma


def test_mp4_without_imageio_ffmpeg(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    with pytest.raises(RuntimeError, match="pip install imageio-ffmpeg"):
        write_mp4(_pattern(2, 4, 4), tmp_path / "v.mp4")


def test_latent_preview():
    latent = torch.randn(16, 3, 5, 7, generator=torch.Generator().manual_seed(0))
    p = latent_preview(latent, scale=4)
    assert p.shape == (3, 20, 28, 3) and p.dtype == np.uint8
    np.testing.assert_array_equal(p, latent_preview(latent.clone(), scale=4))
    np.testing.assert_array_equal(p, p[:, ::4, ::4].repeat(4, axis=1).repeat(4, axis=2))
    assert p.reshape(-1, 3).min(0).tolist() == [0, 0, 0] and p.reshape(-1, 3).max(0).tolist() == [255] * 3
    # A linear map and a per-video normalisation: an affine change of the latent changes nothing.
    assert np.abs(p.astype(int) - latent_preview(3 * latent + 1, scale=4).astype(int)).max() <= 1


def test_to_uint8_and_load_decoder(tmp_path, monkeypatch):
    assert load_decoder(None) is latent_preview
    floats = torch.tensor([0.0, 0.5, 1.0, 1.5, -1.0]).view(5, 1, 1, 1).expand(5, 1, 1, 3)
    np.testing.assert_array_equal(to_uint8(floats), np.array([0, 128, 255, 255, 0], np.uint8).reshape(5, 1, 1, 1)
                                  .repeat(3, -1))
    (tmp_path / "my_vae.py").write_text(
        "import torch\nNOT_A_FUNCTION = 3\n"
        "def decode(latent):\n    return torch.full((latent.shape[1], 2, 3, 3), 0.25)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    frames = load_decoder("my_vae:decode")(torch.zeros(4, 5, 1, 1))
    assert frames.dtype == np.uint8 and frames.shape == (5, 2, 3, 3) and (frames == 64).all()
    for spec, why in [("my_vae.decode", "expected \"package.module:function\""),
                      ("no_such_module_xyz:decode", "cannot be loaded"), ("my_vae:missing", "cannot be loaded"),
                      ("my_vae:NOT_A_FUNCTION", "not a function")]:
        with pytest.raises(ValueError, match=f"decoder '{spec}'.*{why}"):
            load_decoder(spec)


def _is_png(path, size=(800, 450)) -> bool:
    with Image.open(path) as im:
        return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and im.size == size


def test_plot_losses(tmp_path):
    lines = ['{"step": 0, "note": "earlier run"}', ""]
    for step in range(1, 31):
        record = {"step": step, "loss": 1.0 / step}
        if step % 10 == 0:
            record.update(val_loss=0.5 / step, val_loss_t100=0.2 / step, val_loss_t900=0.9 / step)
        lines.append(str(record).replace("'", '"'))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(lines) + "\n")
    written = plot_losses(metrics, tmp_path / "plots")
    assert written == [tmp_path / "plots" / "loss_train.png", tmp_path / "plots" / "loss_val.png"]
    assert all(_is_png(p) for p in written)

    metrics.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n')
    assert plot_losses(metrics, tmp_path / "train_only") == [tmp_path / "train_only" / "loss_train.png"]
    assert not (tmp_path / "train_only" / "loss_val.png").exists()
    metrics.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    with pytest.raises(ValueError, match="metrics.jsonl:2: not a JSON object"):
        plot_losses(metrics, tmp_path / "bad")


def test_write_index(tmp_path):
    entries = [Sample(10, 0, "a cat", ["samples/step10/prompt 0.gif"]),
               {"step": 20, "prompt": 1, "label": "x < y & z", "files": ["samples/step20/prompt1.mp4"]},
               Sample(20, 0, "a dog", ["samples/step20/prompt0.gif", "samples/step20/prompt0.mp4"])]
    path = write_index(tmp_path, "run <debug>", entries, [tmp_path / "loss_train.png", "loss_val.png"])
    assert path == tmp_path / "index.html"
    page = path.read_text()
    for f in ["samples/step10/prompt%200.gif", "samples/step20/prompt0.gif"]:
        assert f'<img src="{f}"' in page
    for f in ["samples/step20/prompt1.mp4", "samples/step20/prompt0.mp4"]:
        assert f'<video src="{f}" controls loop autoplay muted>' in page
    assert page.count('class="plot" src="loss_train.png"') == 1 and 'src="loss_val.png"' in page
    assert "x &lt; y &amp; z" in page and "x < y" not in page and "run &lt;debug&gt;" in page
    assert page.index("step 20") < page.index("a dog") < page.index("x &lt; y") < page.index("step 10")
    assert "http" not in page and str(tmp_path) not in page
