"""A clip's sound track -> the packed audio latents LTX-2 trains on (data preparation's "audio", [A, C_audio]).

As Lightricks' ltx-trainer prepares it (packages/ltx-trainer/scripts/process_videos.py `_encode_audio`, ltx-core's
`AudioProcessor`) and LTX2Pipeline packs and normalises it (diffusers 0.42 `_pack_audio_latents`,
`_normalize_audio_latents`):

    w      the waveform at the audio VAE's sample_rate, num_frames / model.frame_rate seconds from the track's start,
           zero-padded where the track is shorter; to stereo (mono duplicated; 5.1 and 7.1 downmixed with
           ltx-trainer's weights; other layouts averaged)                                            [2, N]
    mel    log(max(MelSpectrogram(w), 1e-5)): torchaudio's MelSpectrogram with ltx-core's settings, n_fft 1024
           (ltx-core's default `filter_length`: diffusers' config has no key for it), Hann window of n_fft, hop
           mel_hop_length, centred with reflect padding, magnitude (power 1), mel_bins Slaney-scale filters from
           0 to sample_rate / 2 with Slaney area normalisation                                      [1, 2, T, M]
    z      AutoencoderKLLTX2Audio.encode(mel): a posterior draw or its mode                          [1, C, T', M']
    a      (pack(z) - latents_mean) / latents_std, pack: [C, T', M'] -> [T', C M']; the first A rows, A =
           LTX2Config.audio_tokens_of(num_frames) (the pipeline's audio_num_frames)                   [A, C M']

The mel filterbank is written here (torchaudio is not a dependency): torchaudio.functional.melscale_fbanks's
formula, which is librosa.filters.mel's (htk=False, norm="slaney"): triangles between neighbouring points of
n_mels + 2 equally spaced on the Slaney mel scale (linear below 1 kHz, 200/3 Hz a mel; logarithmic above, 27 mels
an octave of 6.4), each scaled to unit area, 2 / (f[i + 2] - f[i]).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

N_FFT = 1024                    # ltx-core AudioEncoder's n_fft (the release's stft filter_length)
LOG_FLOOR = 1e-5                # ltx-core AudioProcessor.waveform_to_mel: log(clamp(mel, min=1e-5))
CHANNELS = 2                    # the release's audio VAE takes stereo (in_channels)
CLASS_NAME = "AutoencoderKLLTX2Audio"
# ltx-trainer's downmix of 5.1 [L, R, C, LFE, Ls, Rs] and 7.1 [.., Lb, Rb]: weights of (left, right) summing to 1
_DOWNMIX = {6: ((0, 2, 4), (1, 2, 5), 2.414), 8: ((0, 2, 4, 6), (1, 2, 5, 7), 3.121)}

_F_SP, _MIN_LOG_HZ = 200.0 / 3, 1000.0
_MIN_LOG_MEL, _LOGSTEP = _MIN_LOG_HZ / _F_SP, math.log(6.4) / 27.0


def hz_to_mel(f: torch.Tensor) -> torch.Tensor:
    """Slaney's mel scale: f / (200/3) below 1 kHz (15 mels there), 15 + ln(f / 1000) / (ln 6.4 / 27) above."""
    f = torch.as_tensor(f, dtype=torch.float64)
    return torch.where(f >= _MIN_LOG_HZ, _MIN_LOG_MEL + torch.log(f.clamp(min=1e-10) / _MIN_LOG_HZ) / _LOGSTEP,
                       f / _F_SP)


def mel_to_hz(m: torch.Tensor) -> torch.Tensor:
    m = torch.as_tensor(m, dtype=torch.float64)
    return torch.where(m >= _MIN_LOG_MEL, _MIN_LOG_HZ * torch.exp(_LOGSTEP * (m - _MIN_LOG_MEL)), m * _F_SP)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """[n_fft // 2 + 1, n_mels] fp32: filter j of FFT bin k (at k sample_rate / n_fft Hz), for f_min 0 and f_max
    sample_rate / 2; torchaudio's melscale_fbanks(norm="slaney", mel_scale="slaney")."""
    freqs = torch.linspace(0, sample_rate // 2, n_fft // 2 + 1, dtype=torch.float64)          # the bins' Hz
    f = mel_to_hz(torch.linspace(0.0, float(hz_to_mel(sample_rate / 2.0)), n_mels + 2, dtype=torch.float64))
    slopes = f[None] - freqs[:, None]                                                          # (bins, n_mels + 2)
    down, up = -slopes[:, :-2] / (f[1:-1] - f[:-2]), slopes[:, 2:] / (f[2:] - f[1:-1])
    return (torch.clamp(torch.minimum(down, up), min=0) * (2.0 / (f[2:] - f[:-2]))).float()


def log_mel(waveform: torch.Tensor, sample_rate: int, hop: int, n_mels: int, n_fft: int = N_FFT) -> torch.Tensor:
    """waveform [C, N] fp32 -> log-mel [C, 1 + N // hop, n_mels] (ltx-core's AudioProcessor without resampling)."""
    spec = torch.stft(waveform, n_fft, hop_length=hop, win_length=n_fft, window=torch.hann_window(n_fft),
                      center=True, pad_mode="reflect", normalized=False, onesided=True, return_complex=True).abs()
    mel = torch.einsum("cft,fm->ctm", spec, mel_filterbank(sample_rate, n_fft, n_mels))      # (C, T, n_mels)
    return torch.log(mel.clamp(min=LOG_FLOOR))


def stereo(waveform: torch.Tensor) -> torch.Tensor:
    """[C, N] -> [2, N] as ltx-trainer: mono duplicated, 5.1 and 7.1 downmixed, another layout of more than two
    channels averaged (then duplicated)."""
    channels = waveform.shape[0]
    if channels == 1 or channels > 2 and channels not in _DOWNMIX:
        return waveform.mean(0, keepdim=True).expand(2, -1).contiguous()
    if channels == 2:
        return waveform
    left, right, total = _DOWNMIX[channels]
    mix = [sum(waveform[i] * (1.0 if i in (0, 1) else 0.707) for i in side) / total for side in (left, right)]
    return torch.stack(mix)


def audio_vae_problems(path: Path, model, key: str = "--audio-vae") -> list[str]:
    """What keeps the folder's AutoencoderKLLTX2Audio from the model section's audio stream (config.json only)."""
    what = f"the audio_vae/ folder of an LTX-2 diffusers release ({CLASS_NAME}.save_pretrained)"
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        return [f"{key}={path}: cannot read config.json ({e}); expected {what}"]
    if config.get("_class_name") != CLASS_NAME:
        return [f"{key}={path}: config.json is a {config.get('_class_name')!r}; expected {what}"]
    mel_bins, stages = config.get("mel_bins", 64), len(config.get("ch_mult", (1, 2, 4)))
    packed = config.get("latent_channels", 8) * mel_bins // 2 ** (stages - 1)
    pairs = [("sample_rate", config.get("sample_rate", 16000), "audio_sampling_rate"),
             ("mel_hop_length", config.get("mel_hop_length", 160), "audio_hop_length"),
             ("latent_channels x mel_bins / 2^(len(ch_mult) - 1)", packed, "audio_in_channels"),
             ("temporal compression 2^(len(ch_mult) - 1)", 2 ** (stages - 1), "audio_scale_factor")]
    problems = [f"{key}={path}: {name} {theirs} != model.{ours}={getattr(model, ours)} (use the release's audio VAE, "
                f"or --set model.{ours}={theirs})" for name, theirs, ours in pairs if theirs != getattr(model, ours)]
    if config.get("in_channels", 2) != CHANNELS:
        problems.append(f"{key}={path}: in_channels {config.get('in_channels')}: the toolkit feeds it stereo mel "
                        f"spectrograms (the release's {CHANNELS})")
    if config.get("base_channels", 128) != packed:
        problems.append(f"{key}={path}: base_channels {config.get('base_channels', 128)} (its latents_mean / "
                        f"latents_std) != the packed latent width {packed}: the pipeline cannot normalise with them")
    return problems


class AudioEncoder:
    """The audio VAE of one folder, fp32 (ltx-trainer encodes audio in fp32): `encode(waveform, tokens, generator)`
    -> the packed, normalised latents [tokens, C_audio] fp32 on the CPU."""

    def __init__(self, path: str | Path, device="cpu"):
        from diffusers import AutoencoderKLLTX2Audio

        self.vae = AutoencoderKLLTX2Audio.from_pretrained(str(path), torch_dtype=torch.float32,
                                                          local_files_only=True).to(device).eval()
        self.sample_rate = self.vae.config.sample_rate

    @torch.no_grad()
    def encode(self, waveform: torch.Tensor, tokens: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """waveform [C, N] at `sample_rate` -> [tokens, C_audio]; a posterior draw with a generator, else its mode.
        A track too short for `tokens` latent frames is refused (RuntimeError naming both counts)."""
        config, device = self.vae.config, self.vae.latents_mean.device
        mel = log_mel(stereo(waveform.float()), config.sample_rate, config.mel_hop_length, config.mel_bins)
        dist = self.vae.encode(mel[None].to(device)).latent_dist
        z = dist.sample(generator) if generator is not None else dist.mode()                 # (1, C, T', M')
        packed = z[0].transpose(0, 1).flatten(1)                                                # (T', C M')
        if packed.shape[0] < tokens:
            raise RuntimeError(f"the audio VAE gave {packed.shape[0]} latent frames, the clip needs {tokens}")
        return ((packed[:tokens] - self.vae.latents_mean) / self.vae.latents_std).float().cpu()
