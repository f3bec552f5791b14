"""What validation writes: videos (GIF, MP4), loss plots and a static index.html that shows them.

Frames everywhere are uint8 numpy arrays [T, H, W, 3]. A sampled latent [C, T, H, W] becomes frames
through a decoder: `load_decoder(VAE folder or "package.module:function")` plugs a real VAE, and without one
`latent_preview` maps the latent channels to RGB so training progress is still visible.
"""
from __future__ import annotations

import html
import importlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping
from urllib.parse import quote

import matplotlib
import numpy as np
import torch
from PIL import GifImagePlugin, Image

matplotlib.use("Agg")
import matplotlib.pyplot as plt

Decoder = Callable[[torch.Tensor], np.ndarray]     # latent [C, T, H, W] fp32 -> frames uint8 [T, H, W, 3]


def to_uint8(frames: Any) -> np.ndarray:
    """Frames as uint8 [T, H, W, 3]: a uint8 array as is, floats (tensor or array) in [0, 1] scaled by 255."""
    if isinstance(frames, torch.Tensor):
        frames = frames.detach().cpu()
        frames = frames.numpy() if frames.dtype == torch.uint8 else frames.float().numpy()
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be [T, H, W, 3], got shape {list(frames.shape)}")
    if frames.dtype == np.uint8:
        return frames
    if not np.issubdtype(frames.dtype, np.floating):
        raise ValueError(f"frames must be uint8 or floats in [0, 1], got {frames.dtype}")
    return (np.clip(frames, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def latent_preview(latent: torch.Tensor, scale: int = 4) -> np.ndarray:
    """A VAE-free look at a latent [C, T, H, W]: uint8 frames [T, H * scale, W * scale, 3].

    rgb = M x over channels, with M [3, C] a fixed Gaussian matrix seeded by C (the same colours for every
    video of a run); each RGB channel is then stretched so its 1st..99th percentile over the whole video
    spans 0..255, and pixels are repeated `scale` times in H and W.
    """
    if latent.dim() != 4 or scale < 1:
        raise ValueError(f"latent_preview needs a latent [C, T, H, W] and scale >= 1, "
                         f"got shape {list(latent.shape)}, scale {scale}")
    c = latent.shape[0]
    m = torch.randn(3, c, generator=torch.Generator().manual_seed(c), dtype=torch.float64)
    rgb = torch.einsum("kc,cthw->thwk", m, latent.detach().cpu().double()).numpy()   # [T, H, W, 3]
    lo, hi = np.percentile(rgb.reshape(-1, 3), [1, 99], axis=0)
    rgb = np.clip((rgb - lo) / np.maximum(hi - lo, 1e-12), 0.0, 1.0)
    frames = (rgb * 255.0 + 0.5).astype(np.uint8)
    return frames.repeat(scale, axis=1).repeat(scale, axis=2)


def load_decoder(spec: str | None) -> Decoder:
    """The decoder `spec` names, wrapped to return uint8 frames; None -> preview.

    `spec` is a VAE folder of a class some family trains on (`diffusers`; decoded as the family's
    FamilySpec.formats.vae says, see models.vae) or "package.module:function", a callable taking a latent
    [C, T, H, W] fp32 tensor and returning frames [T, H, W, 3], uint8 or floats in [0, 1]. It runs on every process that decodes,
    so it should load its VAE once (e.g. functools.cache).
    """
    if spec is None:
        return latent_preview
    if Path(spec).is_dir():
        from models.vae import vae_decoder
        try:
            fn = vae_decoder(spec)
        except (FileNotFoundError, ImportError, ValueError) as e:
            raise ValueError(str(e)) from None
        return lambda latent: to_uint8(fn(latent))
    form = ('expected "package.module:function", a callable taking a latent [C, T, H, W] and returning frames, '
            "or a VAE folder of the model's family (its diffusers save_pretrained folder, e.g. a release's vae/)")
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"decoder {spec!r}: not a folder; {form}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"decoder {spec!r} cannot be loaded ({e}); {form}") from e
    if not callable(fn):
        raise ValueError(f"decoder {spec!r} is a {type(fn).__name__}, not a function; {form}")
    return lambda latent: to_uint8(fn(latent))


def write_gif(frames: np.ndarray, path: str | Path, fps: float = 8) -> Path:
    """An endlessly looping GIF with exactly T frames.

    One 256-colour palette is fitted to the whole video (GIF's limit; videos with at most 256 colours are
    exact). Pillow's `save(save_all=True)` merges identical consecutive frames, so the frames are written
    with its frame-level GifImagePlugin.getheader/getdata instead. GIF stores delays in 1/100 s, so the
    frame time is 1/fps rounded down to that.
    """
    frames, path = to_uint8(frames), Path(path)
    t, h, w, _ = frames.shape
    strip = Image.fromarray(frames.reshape(t * h, w, 3)).quantize(
        256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    images = [strip.crop((0, i * h, w, (i + 1) * h)) for i in range(t)]
    ms = int(1000 / fps)
    header, _ = GifImagePlugin.getheader(images[0], info={"loop": 0, "duration": ms})
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.writelines(header)
        for image in images:
            f.writelines(GifImagePlugin.getdata(image, duration=ms))
        f.write(b";")                                       # GIF trailer
    return path


def write_mp4(frames: np.ndarray, path: str | Path, fps: float = 8) -> Path:
    """An H.264 MP4 through the ffmpeg binary that the `imageio-ffmpeg` package ships.

    yuv420p needs even sizes: an odd H or W gets one more row or column, a copy of the last.
    """
    try:
        import imageio_ffmpeg
    except ImportError as e:
        raise RuntimeError("writing MP4 needs the imageio-ffmpeg package: pip install imageio-ffmpeg "
                           "(or write GIFs only)") from e
    frames, path = to_uint8(frames), Path(path)
    _, h, w, _ = frames.shape
    frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = imageio_ffmpeg.write_frames(str(path), (frames.shape[2], frames.shape[1]), fps=fps, codec="libx264",
                                         pix_fmt_out="yuv420p", macro_block_size=1, ffmpeg_log_level="error")
    writer.send(None)                                       # starts ffmpeg
    try:
        for frame in frames:
            writer.send(np.ascontiguousarray(frame))
    finally:
        writer.close()                                      # waits for ffmpeg to finish the file
    return path


def _read_metrics(path: Path) -> list[dict]:
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON object ({e})") from e
    return records


def latest_rows(records: list[dict]) -> list[dict]:
    """metrics.jsonl's rows as the run finally went, each step once, in step order. A resumed run's first
    row carries `resumed_from`: rows of earlier runs after that step were lost with their checkpoint and
    are dropped; a step logged again replaces its earlier row."""
    by_step: dict[int, dict] = {}
    for r in records:
        if "step" not in r:
            continue
        if "resumed_from" in r:
            by_step = {s: row for s, row in by_step.items() if s <= r["resumed_from"]}
        by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over latest_rows(records)."""
    by_step = {r["step"]: r[key] for r in latest_rows(records) if r.get(key) is not None}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot_losses(metrics_path: str | Path, out_dir: str | Path) -> list[Path]:
    """loss_train.png (loss and its moving average vs step) and loss_val.png (val_loss and one line per
    val_loss_t{timestep}) from metrics.jsonl; a plot without data is not written. Returns the files written."""
    records, out_dir = _read_metrics(Path(metrics_path)), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    steps, loss = _series(records, "loss")
    if steps:
        window = max(1, min(100, len(loss) // 10))
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")    # mean of the last `window`
        fig, ax = plt.subplots(figsize=(8, 4.5))
        ax.plot(steps, loss, alpha=0.35, linewidth=1, label="loss")
        ax.plot(steps[window - 1:], smooth, linewidth=2, label=f"moving average ({window})")
        written.append(_save(fig, ax, "training loss", out_dir / "loss_train.png"))
    timesteps = sorted({int(m.group(1)) for r in records for k in r if (m := re.fullmatch(r"val_loss_t(\d+)", k))})
    val = [("val_loss", "val_loss")] + [(f"val_loss_t{t}", f"t = {t}") for t in timesteps]
    if any(_series(records, key)[0] for key, _ in val):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for key, label in val:
            steps, values = _series(records, key)
            if steps:
                ax.plot(steps, values, marker="o", linewidth=2 if key == "val_loss" else 1, label=label)
        written.append(_save(fig, ax, "validation loss", out_dir / "loss_val.png"))
    return written


def _save(fig, ax, title: str, path: Path) -> Path:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


@dataclass
class Sample:
    """One validation video: `files` are its renderings (.gif shown as <img>, .mp4 as <video>), as paths
    relative to the index's directory (absolute paths are made relative)."""
    step: int
    prompt: int
    label: str
    files: list[str] = field(default_factory=list)


def _href(path: str | Path, out_dir: Path) -> str:
    rel = os.path.relpath(path, out_dir) if Path(path).is_absolute() else str(path)
    return html.escape(quote(Path(rel).as_posix()))


def _media(href: str) -> str:
    if href.lower().endswith((".mp4", ".webm")):
        return f'<video src="{href}" controls loop autoplay muted></video>'
    if href.lower().endswith((".gif", ".png", ".jpg", ".jpeg", ".webp")):
        return f'<img src="{href}" alt="">'
    return f'<a href="{href}">{href}</a>'


def write_index(out_dir: str | Path, title: str, entries: Iterable[Sample | Mapping[str, Any]],
                plots: Iterable[str | Path] = ()) -> Path:
    """out_dir/index.html: the loss plots, then each validation step (newest first) with its prompts' videos.

    The page has no external assets and links its files relatively, so out_dir can be copied anywhere.
    `entries` are Samples or dicts with the same keys.
    """
    out_dir = Path(out_dir)
    samples = [e if isinstance(e, Sample) else Sample(**e) for e in entries]
    body = [f"<h1>{html.escape(title)}</h1>"]
    body += [f'<img class="plot" src="{_href(p, out_dir)}" alt="loss plot">' for p in plots]
    for step in sorted({s.step for s in samples}, reverse=True):
        body.append(f"<h2>step {step}</h2>\n<div class=\"row\">")
        for s in sorted((s for s in samples if s.step == step), key=lambda s: s.prompt):
            media = "".join(_media(_href(f, out_dir)) for f in s.files)
            body.append(f"<figure>{media}<figcaption>{s.prompt}: {html.escape(s.label)}</figcaption></figure>")
        body.append("</div>")
    style = ("body{font-family:sans-serif;margin:1em}.plot{max-width:48%;margin-right:1%}"
             ".row{display:flex;flex-wrap:wrap;gap:1em}figure{margin:0;max-width:24em}"
             "figure img,figure video{max-width:100%;display:block}")
    page = (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "index.html"
    path.write_text(page, encoding="utf-8")
    return path
