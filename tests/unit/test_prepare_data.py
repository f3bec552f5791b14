"""Data preparation: generated videos -> tiny random CogVideoX VAE (+ tiny T5) -> the manifest training reads.
In-process here; the CLI as two rank processes, and imports without the [data] extra:
tests/cli/test_prepare_data_cli.py (which takes its fixtures from this module)."""
import json

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLCogVideoX
from safetensors.torch import load_file

from parallel.train.data import DirectoryLatents
from models.diffusion import Objective
from parallel.experiment.config import load_config
from parallel.prepare_data.frames import VideoError, clip_indices, frame_indices, read_clip, resize_crop
from parallel.validation.media import load_decoder, to_uint8
from parallel.distributed.seed import derive_seed
from tests.helpers.text_encoder import t5_dir  # noqa: F401  (fixture: tiny T5, d_model 32, 8 words)
from tests.helpers.prepare_data import CAPTIONS, SETS, lines, run, write_video
from tests.helpers.prepare_data import prepared, vae_dir, videos  # noqa: F401  (fixtures)


def test_latents_and_text_are_what_the_vae_and_t5_give(videos, vae_dir, t5_dir, prepared): 
    root, frames = videos
    manifest = lines(prepared / "manifest.jsonl")
    assert [m["video"] for m in manifest] == ["a0.mkv", "a1.mkv", "sub/b.mp4"]       # captions order, bad left out
    assert manifest[0] == {"latent": "latents/a0.mkv.safetensors", "text": "text/a0.mkv.safetensors",
                           "caption": CAPTIONS["a0.mkv"], "video": "a0.mkv"}
    skipped = lines(prepared / "skipped.jsonl")
    assert [s["video"] for s in skipped] == ["bad.mp4"] and "cannot be decoded" in skipped[0]["reason"]

    vae = AutoencoderKLCogVideoX.from_pretrained(vae_dir).eval()
    sf = vae.config.scaling_factor
    for name in ("a0.mkv", "a1.mkv"):
        # Lossless videos at 32 x 48: 9 frames spread over the video, the middle 32 columns, in [-1, 1].
        clip = frames[name][frame_indices(len(frames[name]), 9)][:, :, 8:40]
        x = torch.from_numpy(clip).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
        g = torch.Generator().manual_seed(derive_seed(1234, "vae", name))
        with torch.no_grad():
            expected = vae.encode(x).latent_dist.sample(g)[0] * sf
        latent = load_file(prepared / f"latents/{name}.safetensors")["latent"]
        assert latent.shape == (4, 5, 16, 16) and latent.dtype == torch.float32
        torch.testing.assert_close(latent, expected)
    assert load_file(prepared / "latents/sub/b.mp4.safetensors")["latent"].shape == (4, 5, 16, 16)

    from models.text_encoder import T5TextEncoder
    encoder = T5TextEncoder(t5_dir, max_len=8)
    for m in manifest:
        torch.testing.assert_close(load_file(prepared / m["text"])["text"], encoder.encode(m["caption"]))
    # Written once beside the manifest: the empty prompt's embedding, caption dropout's and guidance's input.
    torch.testing.assert_close(load_file(prepared / "uncond.safetensors")["text"], encoder.encode(""))
    assert json.loads((prepared / "prepare.json").read_text())["scaling_factor"] == sf


def test_training_reads_the_prepared_folder(prepared):
    from parallel.model.build import build_model
    from parallel.train.run import build_dataset, training_batches
    from parallel.distributed.topology import ParallelContext

    cfg = load_config("debug", SETS + ["data.kind=directory", f"data.path={prepared}", "train.micro_batch_size=2",
                                       "train.grad_accum_steps=1"])
    # The start-up check reads every file's header: the folder fits the config it was prepared with, not another.
    from parallel.check import check_data_files
    assert check_data_files(cfg) == []
    other = check_data_files(load_config("debug", SETS + ["data.kind=directory", f"data.path={prepared}",
                                                          "data.width=16"]))
    assert len(other) == 3 and all("latent shape [4, 5, 16, 16] != expected [4, 5, 16, 8]" in p for p in other)
    dataset = build_dataset(cfg)
    assert isinstance(dataset, DirectoryLatents) and len(dataset) == 3
    latent, text = dataset[2]
    assert torch.equal(latent, load_file(prepared / "latents/sub/b.mp4.safetensors")["latent"])
    assert torch.equal(text, load_file(prepared / "text/sub/b.mp4.safetensors")["text"])
    # Validation pages and sample labels show the manifest's caption.
    captions = [json.loads(line)["caption"] for line in (prepared / "manifest.jsonl").read_text().splitlines()]
    assert [dataset.label(i) for i in range(3)] == captions and all(captions)

    ctx = ParallelContext.single()
    batches = training_batches(cfg, ctx, dataset)
    (x_t, t, texts), target = next(batches)
    assert x_t.shape == (2, 4, 5, 16, 16) and texts.shape == (2, 8, 32)
    # Position p's sample, noise and timestep as DiffusionBatches draws them, from the prepared files.
    x0 = torch.stack([dataset[batches.sample_index(p)][0] for p in (0, 1)])
    gs = [torch.Generator().manual_seed(derive_seed(cfg.train.seed, "noise", p)) for p in (0, 1)]
    noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in gs])
    steps = torch.cat([torch.randint(0, 1000, (1,), generator=g) for g in gs])
    want_x, want_target = Objective(cfg.model.objective).noised(x0, noise, steps)
    assert torch.equal(t, steps)
    torch.testing.assert_close(x_t, want_x)
    torch.testing.assert_close(target, want_target)

    torch.manual_seed(0)
    model = build_model(cfg, {}, ctx)
    loss = model((x_t, t, texts), target)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_rerun_after_interruption_does_not_redo_finished_files(videos, vae_dir, tmp_path, capsys):
    root, _ = videos
    out = tmp_path / "out"
    assert run(root, vae_dir, out, "--posterior", "mode", "--limit", "1") == 0       # stops after one video
    assert "1 prepared, 0 skipped, 0 done before" in capsys.readouterr().out
    assert lines(out / "manifest.jsonl") == [{"latent": "latents/a0.mkv.safetensors",
                                              "caption": CAPTIONS["a0.mkv"], "video": "a0.mkv"}]
    first = (out / "latents/a0.mkv.safetensors").stat()
    (out / "manifest.jsonl").unlink()
    assert run(root, vae_dir, out, "--posterior", "mode") == 0
    assert "2 prepared, 1 skipped, 1 done before" in capsys.readouterr().out
    again = (out / "latents/a0.mkv.safetensors").stat()
    assert (again.st_mtime_ns, again.st_ino) == (first.st_mtime_ns, first.st_ino)
    assert [m["video"] for m in lines(out / "manifest.jsonl")] == ["a0.mkv", "a1.mkv", "sub/b.mp4"]
    assert run(root, vae_dir, out, "--posterior", "mode") == 0              # nothing left but the bad video
    assert "0 prepared, 1 skipped, 3 done before" in capsys.readouterr().out
    assert not list((out / ".tmp").glob("r0-*"))                          # no temporary files left behind
    # The mode is the posterior mean: what training on it sees is the VAE's encoding without noise.
    vae = AutoencoderKLCogVideoX.from_pretrained(vae_dir).eval()
    with torch.no_grad():
        x = torch.from_numpy(read_clip(root / "a1.mkv", 9, 32, 32)).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
        mean = vae.encode(x).latent_dist.mean[0] * vae.config.scaling_factor
    torch.testing.assert_close(load_file(out / "latents/a1.mkv.safetensors")["latent"], mean)


def test_bad_input_is_refused_before_any_model_loads(videos, vae_dir, tmp_path, capsys, monkeypatch):
    import models.vae
    monkeypatch.setattr(models.vae, "load_vae", lambda *a, **k: pytest.fail("a model was loaded"))
    root, _ = videos

    def refused(*args, sets=SETS) -> str:
        assert run(*args, sets=sets) == 1
        return capsys.readouterr().err

    err = refused(tmp_path / "nowhere", vae_dir, tmp_path / "o")
    assert f"--videos={tmp_path / 'nowhere'}: no such folder" in err
    err = refused(root, tmp_path / "no_vae", tmp_path / "o")
    assert f"--vae={tmp_path / 'no_vae'}: no such folder; expected a folder written by " \
           "AutoencoderKLCogVideoX.save_pretrained" in err
    err = refused(root, vae_dir, tmp_path / "o", sets=SETS[:3])           # debug's own VAE scales are 8 and 4
    assert f"--vae={vae_dir}: the VAE downsamples H and W by 2, model.vae_scale_spatial=8 (use the VAE the model " \
           "was made for, or --set model.vae_scale_spatial=2)" in err
    assert f"--vae={vae_dir}: the VAE downsamples time by 2, model.vae_scale_temporal=4" in err

    bad = tmp_path / "listed"
    bad.mkdir()
    (bad / "captions.csv").write_text("video,caption\nmissing.mp4,a square\nempty.mkv,\n")
    (bad / "empty.mkv").write_bytes(b"")
    err = refused(bad, vae_dir, tmp_path / "o")
    assert f"{bad / 'captions.csv'}:2: video {bad / 'missing.mp4'} does not exist" in err
    assert f"{bad / 'captions.csv'}:3: video 'empty.mkv' has an empty caption" in err
    (bad / "captions.csv").write_text("file,text\n")
    assert "the header must name columns video and caption (it has ['file', 'text'])" in refused(bad, vae_dir, bad)
    (bad / "captions.csv").unlink()
    assert f"--captions={bad / 'captions.csv'}: no such file (a CSV with video,caption columns" in \
        refused(bad, vae_dir, bad)

    t5 = tmp_path / "t5"
    t5.mkdir()
    (t5 / "config.json").write_text(json.dumps({"d_model": 32}))
    assert f"--t5={t5}: no tokenizer_config.json in it; expected a folder written by T5EncoderModel" in \
        refused(root, vae_dir, tmp_path / "o", "--t5", str(t5))

    out = tmp_path / "stamped"
    out.mkdir()
    (out / "prepare.json").write_text(json.dumps({"num_frames": 17}))
    err = refused(root, vae_dir, out)
    assert f"--out={out} holds files prepared with other settings: num_frames=17 (now 9)" in err


def test_captions_from_txt_files_next_to_the_videos(videos, tmp_path):
    from parallel.prepare_data.captions import InputError, read_captions
    root, frames = videos
    write_video(tmp_path / "x.mkv", frames["a1.mkv"], "ffv1")
    with pytest.raises(InputError, match=f"{tmp_path / 'x.txt'}: missing; write the caption of x.mkv there"):
        read_captions(tmp_path, None)
    (tmp_path / "x.txt").write_text("a square moving\n")
    assert read_captions(tmp_path, None) == [("x.mkv", "a square moving")]


def test_frame_choice_and_resize():
    assert frame_indices(11, 9) == [0, 1, 2, 4, 5, 6, 8, 9, 10]
    assert frame_indices(5, 9) == [0, 0, 1, 2, 2, 2, 3, 4, 4]                # short videos repeat frames
    times = [i / 8 for i in range(20)]                                     # 20 frames at 8 fps
    assert clip_indices(times, 5, 4.0) == [0, 2, 4, 6, 8]
    assert clip_indices(times, 5, 3.0) == [0, 3, 5, 8, 11]
    with pytest.raises(VideoError, match="2.50 s long; 9 frames at 3 fps need 2.79 s"):
        clip_indices(times, 9, 3.0)
    frame = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    np.testing.assert_array_equal(resize_crop(frame, 4, 4), frame[:, 1:5])   # same height: centre columns
    small = resize_crop(frame, 2, 2)                                       # 4 x 6 -> 2 x 3 -> 2 x 2
    x = torch.nn.functional.interpolate(torch.from_numpy(frame).permute(2, 0, 1)[None].float(), size=(2, 3),
                                        mode="bilinear", antialias=True)
    np.testing.assert_array_equal(small, x[0].permute(1, 2, 0).round().to(torch.uint8).numpy()[:, 0:2])


def test_validation_decodes_with_the_vae_folder(vae_dir, tmp_path):
    from parallel.validation.validate import write_samples

    vae = AutoencoderKLCogVideoX.from_pretrained(vae_dir).eval()
    latent = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = vae.decode(latent[None] / vae.config.scaling_factor).sample[0]            # (3, T, H, W) in [-1, 1]
    expected = to_uint8(((x.permute(1, 2, 3, 0) + 1) / 2).clamp(0, 1))
    frames = load_decoder(str(vae_dir))(latent)
    assert frames.dtype == np.uint8 and frames.shape == (5, 16, 16, 3)
    np.testing.assert_array_equal(frames, expected)
    # What validation writes with val.decoder set to the folder.
    cfg = load_config("debug", [f"val.decoder={vae_dir}", "val.formats=[gif]"])
    written = write_samples({0: latent}, [], cfg, tmp_path, step=2)
    np.testing.assert_array_equal(written[0], expected)
    assert (tmp_path / "samples/step2/prompt0.gif").is_file()
    with pytest.raises(ValueError, match=f"val.decoder={tmp_path}: cannot read config.json"):
        load_decoder(str(tmp_path))
