"""A video file's sound track -> the waveform a second stream encodes (LTX-2's audio), and the checks before it.

The track is decoded and resampled with PyAV (libswresample, to float samples at the stream's rate, channels kept),
from its start for `seconds`, as Lightricks' ltx-trainer takes it (torchaudio.load, cut to the clip's duration
num_frames / fps, zero-padded where shorter). A video without a sound track is a VideoError (the clip is skipped and
named in skipped.jsonl): ltx-trainer leaves such a clip out of audio-video training too.
PyAV (`av`) is an optional dependency (`pip install .[data]`), imported only here and in frames.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from parallel.prepare_data.frames import VideoError


def read_audio(path: str | Path, seconds: float, rate: int) -> torch.Tensor:
    """fp32 [channels, int(seconds x rate)]: the track's first `seconds` at `rate` Hz, zeros after its end."""
    import av

    want = int(seconds * rate)
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise VideoError("no audio track (model with an audio stream: LTX-2 trains on the clip's sound, "
                                 "and ltx-trainer leaves such clips out too)")
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="fltp", layout=stream.layout, rate=rate)
            chunks, have = [], 0
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray())
                    have += chunks[-1].shape[1]
                if have >= want:
                    break
            else:
                chunks += [out.to_ndarray() for out in resampler.resample(None)]
    except VideoError:
        raise
    except (av.error.FFmpegError, OSError, EOFError, ValueError) as e:
        raise VideoError(f"its audio track cannot be decoded ({type(e).__name__}: {e})") from None
    if not chunks:
        raise VideoError("its audio track holds no samples")
    wave = np.concatenate(chunks, axis=1)[:, :want].astype(np.float32)
    return torch.from_numpy(np.pad(wave, ((0, 0), (0, want - wave.shape[1]))))


def stream_problems(args, cfg) -> list[str]:
    """A model with a second stream that follows the clip in time (LTX-2's audio: `stream.frame_rate`): the clip is
    taken at that rate (--fps defaults to it; another is refused) and its source folder (--audio-vae, default
    audio_vae/ beside --vae) fits the model; a model without one refuses --audio-vae. Sets args.fps and
    args.audio_vae."""
    from models.registry import family

    stream = family(cfg.model).training_stream(cfg.model, cfg.data)
    given = getattr(args, "audio_vae", None)
    if stream is None:
        return [f"--audio-vae={given}: model {cfg.model.name} has no audio stream; leave --audio-vae out"] if given \
            else []
    problems, rate = [], stream.frame_rate
    if args.fps is not None and args.fps != rate:
        problems.append(f"--fps={args.fps:g}: model {cfg.model.name}'s audio tokens and video positions count "
                        f"model.frame_rate={rate:g} frames a second; leave --fps out (it is then {rate:g}), or set "
                        f"--set model.frame_rate={args.fps:g} here and for training")
    args.fps = rate
    args.audio_vae = given or Path(args.vae).resolve().parent / "audio_vae"
    if not Path(args.audio_vae).is_dir():
        return problems + [f"--audio-vae={args.audio_vae}: no such folder; model {cfg.model.name} trains on the clips' "
                           f"sound: give the release's audio VAE folder (audio_vae/ of an LTX-2 diffusers release; "
                           f"the default is audio_vae/ beside --vae)"]
    return problems + stream.source_problems(Path(args.audio_vae), cfg.model)
