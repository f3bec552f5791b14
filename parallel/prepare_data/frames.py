"""Video file -> the model's clip: `num_frames` frames at `height` x `width`, uint8 [T, H, W, 3] (PyAV).

Which frames: without `fps`, T frames spread evenly over the whole video, frame round(i (n-1) / (T-1))
for i < T (a video with fewer than T frames repeats some); with `fps`, a clip of T frames at that rate
from the start, each the frame nearest in time to t0 + i / fps (a video shorter than (T-1) / fps seconds
is refused). Each frame is resized, keeping its aspect, to the smallest size that covers H x W
(bilinear, antialiased) and centre-cropped to H x W, the resize-and-crop of CogVideoX's training data.
An image file (IMAGE_SUFFIXES) is a clip of one frame, read with PIL as diffusers.utils.load_image reads it
(EXIF orientation applied, then RGB; PyAV's JPEG decoding differs from PIL's), then resized and cropped alike.
PyAV (`av`) is an optional dependency (`pip install .[data]`), imported only here; PIL too is imported lazily.
"""
from __future__ import annotations

import bisect
import contextlib
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")


def is_image(path: str | Path) -> bool:
    return Path(path).suffix.lower() in IMAGE_SUFFIXES


class VideoError(Exception):
    """A video that cannot be used (unreadable, no video stream, too short); the message is the reason."""


def frame_indices(n: int, num_frames: int) -> list[int]:
    """T indices spread evenly over n frames, first and last included."""
    if num_frames == 1:
        return [0]
    return [round(i * (n - 1) / (num_frames - 1)) for i in range(num_frames)]


def clip_indices(times: list[float], num_frames: int, fps: float) -> list[int]:
    """Index of the frame nearest to times[0] + i / fps for i < T; `times` sorted, in seconds."""
    need = times[0] + (num_frames - 1) / fps
    step = (times[-1] - times[0]) / max(len(times) - 1, 1)          # a frame's duration, about
    if times[-1] + step / 2 < need:
        raise VideoError(f"{times[-1] - times[0] + step:.2f} s long; {num_frames} frames at {fps:g} fps need "
                         f"{(num_frames - 1) / fps + step:.2f} s")
    out = []
    for i in range(num_frames):
        t = times[0] + i / fps
        j = bisect.bisect_left(times, t)
        out.append(j if j == 0 or (j < len(times) and times[j] - t < t - times[j - 1]) else j - 1)
    return out


def resize_crop(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [h, w, 3] -> uint8 [height, width, 3]: scale by max(height/h, width/w), then centre-crop."""
    h, w, _ = frame.shape
    scale = max(height / h, width / w)
    rh, rw = max(height, round(h * scale)), max(width, round(w * scale))
    if (rh, rw) != (h, w):
        x = torch.from_numpy(frame).permute(2, 0, 1)[None].float()                       # (1, 3, h, w)
        x = F.interpolate(x, size=(rh, rw), mode="bilinear", antialias=True, align_corners=False)
        frame = x[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()
    top, left = (rh - height) // 2, (rw - width) // 2
    return np.ascontiguousarray(frame[top:top + height, left:left + width])


@contextlib.contextmanager
def _opened_image(path: str | Path):
    """The PIL image of `path`; VideoError (the file skipped with its reason) where PIL cannot read it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            yield image
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise VideoError(f"cannot be decoded as an image ({type(e).__name__}: {e})") from None


def read_image(path: str | Path) -> np.ndarray:
    """uint8 [h, w, 3] of an image file as diffusers.utils.load_image gives it: exif_transpose, then RGB."""
    from PIL import ImageOps

    with _opened_image(path) as image:
        return np.asarray(ImageOps.exif_transpose(image).convert("RGB")).copy()


def probe(path: str | Path, fps: float | None = None) -> tuple[int, int, int]:
    """(frames, height, width) of a video without decoding it: its packets and its stream's size; with
    `fps`, the frames its duration holds at that rate (parallel/experiment/shapes.py choose_bucket picks the bucket).
    An image: (1, height, width) after its EXIF orientation (the header only)."""
    if is_image(path):
        from PIL import ImageOps

        with _opened_image(path) as image:
            w, h = image.size
            turned = (image.getexif().get(ImageOps.ExifTags.Base.Orientation) or 1) in (5, 6, 7, 8)
        return (1, w, h) if turned else (1, h, w)
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise VideoError("no video stream")
            stream = container.streams.video[0]
            height, width = stream.codec_context.height, stream.codec_context.width
            base, rate = float(stream.time_base or 0), float(stream.average_rate or 0)
            pts = [p.pts for p in container.demux(stream) if p.size]
    except VideoError:
        raise
    except (av.error.FFmpegError, OSError, EOFError) as e:
        raise VideoError(f"cannot be decoded ({type(e).__name__}: {e})") from None
    if not pts or not height or not width:
        raise VideoError("no video frames")
    n = len(pts)
    if fps:
        times = sorted(t * base for t in pts) if base and None not in pts else [i / (rate or 1.0) for i in range(n)]
        step = (times[-1] - times[0]) / max(n - 1, 1)
        n = int((times[-1] - times[0] + step) * fps + 1e-6) or 1
    return n, height, width


def read_clip(path: str | Path, num_frames: int, height: int, width: int, fps: float | None = None) -> np.ndarray:
    """The clip of `path` as uint8 [num_frames, height, width, 3]; VideoError names why a file is unusable.

    Two passes: the packets' timestamps (no decoding) give the frame count and times, then only the
    chosen frames are converted and resized while decoding, which stops after the last one. An image is one frame
    (num_frames must be 1: prepare refuses an image into a longer shape before any model loads).
    """
    if is_image(path):
        if num_frames != 1:
            raise VideoError(f"an image fills a 1-frame clip, not {num_frames} frames")
        return resize_crop(read_image(path), height, width)[None]
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise VideoError("no video stream")
            stream = container.streams.video[0]
            base, rate = float(stream.time_base or 0), float(stream.average_rate or 0)
            pts = [p.pts for p in container.demux(stream) if p.size]
        if not pts:
            raise VideoError("no video frames")
        if base and None not in pts:
            times = sorted(t * base for t in pts)
        else:
            times = [i / (rate or 1.0) for i in range(len(pts))]
        picks = clip_indices(times, num_frames, fps) if fps else frame_indices(len(pts), num_frames)
        wanted, frames, n = set(picks), {}, 0
        with av.open(str(path)) as container:
            for frame in container.decode(container.streams.video[0]):
                if n in wanted:
                    frames[n] = resize_crop(frame.to_ndarray(format="rgb24"), height, width)
                n += 1
                if n > picks[-1]:
                    break
    except VideoError:
        raise
    except (av.error.FFmpegError, OSError, EOFError) as e:
        raise VideoError(f"cannot be decoded ({type(e).__name__}: {e})") from None
    if len(frames) < len(wanted):
        raise VideoError(f"decoded {n} frames of the {len(pts)} its packets list (truncated or damaged)")
    return np.stack([frames[i] for i in picks])
