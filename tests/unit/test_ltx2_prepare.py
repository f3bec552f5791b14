"""LTX-2 data preparation against diffusers 0.42 on a tiny random release, in one process:
`python -m parallel.prepare_data --config debug-ltx2 --vae <release>/vae --t5 <release>` (its main) on clips with
sound tracks (one resampled from 22.05 kHz stereo, one 16 kHz mono track shorter than the clip, one silent) stores

  - the video latent LTX2Pipeline normalises from the VAE's posterior draw (its latents_mean / latents_std buffers,
    scaling_factor): `_normalize_latents`;
  - the audio latents the audio VAE encodes from the clip's log-mel spectrogram, packed and normalised by the
    pipeline's `_pack_audio_latents` / `_normalize_audio_latents`, cut to the clip's audio tokens;
  - the caption states of both streams: the pipeline's `encode_prompt` (Gemma-3 hidden states) through its
    `connectors`; uncond.safetensors the empty prompt's;

and skips the silent clip by name. The mel spectrogram equals an independent numpy computation, and its Slaney
filterbank known values. The prepared folder passes train.py's checks (text-to-video and image-to-video: nothing
is stored beside the latents) and its first training batch gives the loss of diffusers' transformer on it.
"""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from models.ltx2.audio import N_FFT, hz_to_mel, log_mel, mel_filterbank, mel_to_hz
from parallel.distributed.seed import derive_seed
from parallel.prepare_data.audio import read_audio
from parallel.prepare_data.prepare import main
from tests.helpers.ltx2_release import (CAPTIONS, FPS, SETS, clips, ltx2_release, prepare_argv,  # noqa: F401  (fixtures)
                                        tone)

AUDIO = 9                      # 9 frames at 24 fps: round(0.375 s x 25) audio tokens


def _prepare(clips, release, out, *extra) -> int:
    return main([*prepare_argv(clips[0], release, out), *extra])


@pytest.fixture(scope="module")
def prepared(clips, ltx2_release, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    assert _prepare(clips, ltx2_release, out, "--set", "model.image_condition=true") == 0   # i2v stores nothing more
    return out


def _pipeline(release):
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2Pipeline
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

    from tests.helpers.ltx2 import release_scheduler

    return LTX2Pipeline(
        scheduler=release_scheduler(), vae=AutoencoderKLLTX2Video.from_pretrained(release / "vae").eval(),
        audio_vae=AutoencoderKLLTX2Audio.from_pretrained(release / "audio_vae").eval(),
        text_encoder=Gemma3ForConditionalGeneration.from_pretrained(release / "text_encoder").eval(),
        tokenizer=AutoTokenizer.from_pretrained(release / "tokenizer"),
        connectors=LTX2TextConnectors.from_pretrained(release / "connectors").eval(), transformer=None, vocoder=None)


def test_prepared_files_are_the_pipelines(clips, ltx2_release, prepared):
    root, frames = clips
    pipe = _pipeline(ltx2_release)
    manifest = [json.loads(line) for line in (prepared / "manifest.jsonl").read_text().splitlines()]
    assert [m["video"] for m in manifest] == ["a.mkv", "b.mkv"]
    skipped = json.loads((prepared / "skipped.jsonl").read_text())
    assert skipped["video"] == "silent.mkv" and skipped["reason"].startswith("no audio track")
    with torch.no_grad():
        for m in manifest:
            stored, text = load_file(prepared / m["latent"]), load_file(prepared / m["text"])
            assert set(stored) == {"latent", "audio"} and set(text) == {"text", "audio_text"}
            # the clip: its first 9 frames (24 fps, --fps defaults to model.frame_rate), in [-1, 1]
            x = torch.from_numpy(frames[m["video"]][:9]).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
            g = torch.Generator().manual_seed(derive_seed(1234, "vae", m["video"]))
            z = pipe.vae.encode(x).latent_dist.sample(g)
            want = pipe._normalize_latents(z, pipe.vae.latents_mean, pipe.vae.latents_std,
                                           pipe.vae.config.scaling_factor)[0]
            torch.testing.assert_close(stored["latent"], want, msg=lambda s: f"{m['video']} video: {s}")
            wave = read_audio(root / m["video"], 9 / FPS, 16000)
            mel = log_mel(wave if len(wave) == 2 else wave.expand(2, -1), 16000, 160, 16)[None]
            g = torch.Generator().manual_seed(derive_seed(1234, "audio", m["video"]))
            a = pipe._pack_audio_latents(pipe.audio_vae.encode(mel).latent_dist.sample(g))
            want = pipe._normalize_audio_latents(a, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)[0, :AUDIO]
            torch.testing.assert_close(stored["audio"], want, msg=lambda s: f"{m['video']} audio: {s}")
            for caption, states in ((m["caption"], text), ("", load_file(prepared / "uncond.safetensors"))):
                embeds, mask, _, _ = pipe.encode_prompt(caption, do_classifier_free_guidance=False,
                                                        max_sequence_length=8, device="cpu")
                video, audio, _ = pipe.connectors(embeds, mask, padding_side=pipe.tokenizer.padding_side)
                torch.testing.assert_close(states["text"], video[0], msg=lambda s: f"{caption!r} video caption: {s}")
                torch.testing.assert_close(states["audio_text"], audio[0], msg=lambda s: f"{caption!r} audio: {s}")


def test_the_sound_track_is_read_resampled_and_padded(clips):
    """16 kHz mono FLAC: its samples exactly, zeros after its 0.2 s; 22.05 kHz stereo resampled to 16 kHz: the tone
    (resampling error < 1e-3 away from the ends)."""
    root, _ = clips
    mono = read_audio(root / "b.mkv", 0.375, 16000)
    assert mono.shape == (1, 6000)
    assert torch.equal(mono[:, :3200], torch.from_numpy(tone(16000, 1, 0.2)).float())
    assert torch.equal(mono[:, 3200:], torch.zeros(1, 2800))
    wave = read_audio(root / "a.mkv", 0.375, 16000)
    want = torch.from_numpy(tone(16000, 2, 0.375)).float()
    assert wave.shape == (2, 6000) and (wave - want)[:, 100:-100].abs().max() < 1e-3


def test_the_mel_spectrogram_is_torchaudios_with_ltx_cores_settings():
    """The Slaney scale's known points (15 mels at 1 kHz, 42 at 6.4 kHz: 27 an octave of 6.4); each filter's area 1
    (Slaney normalisation, on a fine grid); the log-mel equals a numpy STFT (reflect-padded, periodic Hann) through
    filters written from librosa's formula, on a 440 Hz + noise signal."""
    torch.testing.assert_close(hz_to_mel(torch.tensor([200 / 3, 1000.0, 6400.0])),
                               torch.tensor([1.0, 15.0, 42.0], dtype=torch.float64))
    torch.testing.assert_close(mel_to_hz(hz_to_mel(torch.tensor([50.0, 999.0, 1001.0, 7000.0]))),
                               torch.tensor([50.0, 999.0, 1001.0, 7000.0], dtype=torch.float64))
    fine = mel_filterbank(16000, 2 ** 16, 16)
    torch.testing.assert_close(fine.sum(0) * 16000 / 2 ** 16, torch.ones(16), rtol=0, atol=2e-3)

    rng = np.random.default_rng(0)
    t = np.arange(4000) / 16000
    x = (0.5 * np.sin(2 * np.pi * 440 * t) + 0.1 * rng.standard_normal(4000))[None]
    padded = np.pad(x, ((0, 0), (N_FFT // 2, N_FFT // 2)), mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)
    spec = np.abs(np.stack([np.fft.rfft(padded[0, s:s + N_FFT] * window)
                            for s in range(0, padded.shape[1] - N_FFT + 1, 160)]))            # (T, bins)
    hz = np.linspace(0, 8000, N_FFT // 2 + 1)
    mels = np.linspace(0, 15 + 27 * np.log(8000 / 1000) / np.log(6.4), 18)                   # 0 .. 8 kHz in mels
    f = np.array([m * 200 / 3 if m < 15 else 1000 * np.exp(np.log(6.4) / 27 * (m - 15)) for m in mels])
    bank = np.stack([np.maximum(0, np.minimum((hz - f[j]) / (f[j + 1] - f[j]), (f[j + 2] - hz) / (f[j + 2] - f[j + 1])))
                     * 2 / (f[j + 2] - f[j]) for j in range(16)], axis=1)
    want = np.log(np.maximum(spec @ bank, 1e-5))[None]
    got = log_mel(torch.from_numpy(x).float(), 16000, 160, 16)
    assert got.shape == (1, 1 + 4000 // 160, 16)
    torch.testing.assert_close(got, torch.from_numpy(want).float(), rtol=0, atol=1e-4)


def test_the_prepared_folder_trains_as_diffusers_transformer(prepared, tmp_path):
    """train.py's checks take the folder (text-to-video and image-to-video: the first latent frame is the picture's,
    nothing more is stored), and the first batch's loss through the toolkit model is the video MSE plus the audio
    MSE of diffusers' LTX2VideoTransformer3DModel on it (the batch's captions the stored states)."""
    from models.ltx2.released import DIFFUSERS
    from parallel.check import load_and_check
    from parallel.distributed.topology import ParallelContext
    from parallel.model.build import SequenceLoss
    from parallel.train.run import training_batches
    from tests.helpers.ltx2 import overrides, release
    from tests.released_utils import read_release, save_release

    folder, model = save_release(tmp_path, release(), "40KB")
    sets = [*SETS, "data.kind=directory", f"data.path={prepared}", *overrides(folder)]
    for image in ("false", "true"):
        assert load_and_check("debug-ltx2", [*sets, f"model.image_condition={image}"], None, None,
                              device_check=False)[0].data.path == str(prepared)
    cfg, ours, _ = read_release("debug-ltx2", sets, folder)
    batches = training_batches(cfg, ParallelContext.single())
    inputs, target = next(batches)
    stored = [load_file(prepared / f"text/{v}.safetensors") for v in ("a.mkv", "b.mkv")]
    assert any(torch.equal(inputs[2][0], s["text"]) and torch.equal(inputs[4][0], s["audio_text"]) for s in stored)
    assert inputs[3].shape == target[1].shape == (2, AUDIO, 8)
    with torch.no_grad():
        loss = SequenceLoss(cfg, ParallelContext.single())(ours.predict(inputs), target)
        video, audio = DIFFUSERS.reference_call(model, inputs, {})
    want = torch.nn.functional.mse_loss(video, target[0]) + torch.nn.functional.mse_loss(audio, target[1])
    torch.testing.assert_close(loss, want)


def test_what_does_not_fit_is_refused_by_name(clips, ltx2_release, tmp_path, capsys):
    """Before any model loads: a --t5 folder without connectors/, a missing audio VAE, another --fps; a connector
    without registers; training-time caption encoding; normalising from config.json alone."""
    import shutil

    from models.ltx2.captions import config_problems
    from models.ltx2.pipeline import LTX2Latents
    from parallel.check import load_and_check
    from parallel.experiment.config import ConfigError

    wrong = tmp_path / "release"
    for name in ("vae", "text_encoder", "tokenizer"):
        shutil.copytree(ltx2_release / name, wrong / name)
    assert _prepare(clips, wrong, tmp_path / "out", "--fps", "30") == 1
    err = capsys.readouterr().err
    assert (f"--t5={wrong}: LTX-2 captions need a release folder with the subfolders text_encoder, tokenizer, "
            "connectors (Gemma3ForConditionalGeneration, its tokenizer, LTX2TextConnectors); missing: connectors") in err
    assert f"--audio-vae={wrong / 'audio_vae'}: no such folder; model debug-ltx2 trains on the clips' sound" in err
    assert ("--fps=30: model debug-ltx2's audio tokens and video positions count model.frame_rate=24 frames a "
            "second; leave --fps out") in err
    shutil.copytree(ltx2_release / "connectors", wrong / "connectors")
    config = json.loads((wrong / "connectors" / "config.json").read_text())
    (wrong / "connectors" / "config.json").write_text(json.dumps({**config, "audio_connector_num_learnable_registers":
                                                                  None, "video_connector_attention_head_dim": 8}))
    assert config_problems(wrong, "--t5", 8, (16, 16)) == [
        f"--t5={wrong}: the video connector gives 32-wide caption states, the model takes 16 (model.text_embed_dim; "
        f"use the release the transformer was made for)",
        f"--t5={wrong}: the audio connector's None learnable registers: the toolkit needs registers dividing "
        f"model.max_text_len=8 (it trains without caption masks)"]
    with pytest.raises(ConfigError, match="data.text_encoder=t5/ with model.family=ltx2: LTX-2's captions are two"):
        load_and_check("debug-ltx2", ["data.text_encoder=t5/"], None, None, device_check=False)
    with pytest.raises(NotImplementedError, match="latents_mean / latents_std buffers, which its config.json does"):
        LTX2Latents.normalise(torch.zeros(1, 8, 1, 1, 1), json.loads((ltx2_release / "vae/config.json").read_text()))
