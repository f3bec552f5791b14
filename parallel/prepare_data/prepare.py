"""Videos + captions -> the latent folder that `data.kind: directory` trains from.

    python -m parallel.prepare_data --config configs/cogvideox-2b.yaml --videos clips/ --captions clips.csv \\
        --vae CogVideoX-2b/vae --t5 t5/ --out data/clips
    torchrun --nproc_per_node 8 -m parallel.prepare_data ...        # each rank takes every 8th video

Each video becomes the clip training expects (data.num_frames x data.height x data.width, parallel.prepare_data.frames),
then a VAE latent [C, T, H, W] (models.vae: the VAE class the model's family names) in
latents/<video>.safetensors and, with --t5, its caption's embedding by the family's T5 or UMT5 encoder
(models.text_encoder) [model.max_text_len, model.text_embed_dim] in text/<video>.safetensors, and once the empty
prompt's, uncond.safetensors (caption dropout's and guidance's unconditional input); without --t5 the
manifest keeps the caption for training to encode (data.text_encoder). A model with an audio stream (LTX-2) also
stores, in the same two files, the clip's sound track encoded by its audio VAE (--audio-vae, parallel.prepare_data.
audio) and the caption's audio states (its encoder's "audio_text"). manifest.jsonl lists the prepared
videos in captions order, skipped.jsonl the unusable ones with the reason, prepare.json the settings.

Rank r of WORLD_SIZE takes videos r, r + WORLD_SIZE, ... . A video is done when its latent file exists
(files are written to .tmp/ and renamed into place, text first), so a rerun after an interruption goes on
with the rest. Every rank rebuilds the manifest from the files on disk when it finishes, one rank at a
time (a file lock), so the last rank to finish writes the complete one.
"""
from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import sys
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from models.geometry import latent_shape, pad_frames
from models.registry import family, text_encoder_formats, vae_formats
from models.text_encoder import check_encoder_folder, encoder_class
from parallel.experiment.cli import CONFIG_HELP, REFUSED, Parser, add_experiment_args, refused
from parallel.experiment.units import DTYPES
from parallel.prepare_data.audio import read_audio, stream_problems
from parallel.prepare_data.captions import InputError, read_captions, video_files
from parallel.experiment.config import UNCOND_FILE, ConfigError, load_config
from parallel.experiment.manifest import STREAM_KEYS
from parallel.experiment.shapes import choose_bucket, format_shape, resolve_buckets, shape_problems
from parallel.prepare_data.frames import VideoError, is_image, probe, read_clip
from parallel.distributed.seed import derive_seed
from parallel.distributed.topology import read_launch_env
from models.vae import check_vae, default_dtype, encode, load_vae, read_vae_config



def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="python -m parallel.prepare_data", description=__doc__.splitlines()[0])
    add_experiment_args(ap, deepspeed=False, config_help=CONFIG_HELP + " (data.num_frames, data.height, "
                        "data.width; model.in_channels, vae scales, max_text_len, text_embed_dim)")
    ap.add_argument("--videos", required=True, type=Path, help="folder of video files (searched recursively)")
    ap.add_argument("--captions", type=Path, help="CSV with video,caption columns or JSONL of "
                    '{"video": ..., "caption": ...}; video paths relative to --videos. '
                    "Default: a .txt file next to each video")
    ap.add_argument("--vae", required=True, type=Path, help="the VAE folder (save_pretrained) of the model's family: "
                    + " or ".join(f"{name} ({f.release})" for name, f in vae_formats().items()))
    ap.add_argument("--t5", type=Path, help="text encoder + tokenizer folder of the model's family ("
                    + " or ".join(text_encoder_formats()) + "); without it the manifest keeps captions")
    ap.add_argument("--image-encoder", type=Path, help="image-to-video with image states (model.image_dim): Wan 2.1 "
                    "I2V's CLIP vision encoder folder (CLIPVisionModel with preprocessor_config.json; for a release: "
                    "image_encoder/ with the files of image_processor/ copied in); HunyuanVideo 1.5 I2V's SigLIP: "
                    "the pipeline folder (image_encoder/, feature_extractor/)")
    ap.add_argument("--audio-vae", type=Path, help="a model with an audio stream (LTX-2): the release's audio VAE "
                    "folder (AutoencoderKLLTX2Audio); default: audio_vae/ beside --vae")
    ap.add_argument("--out", required=True, type=Path, help="output folder (data.path for training)")
    ap.add_argument("--fps", type=float, help="take a clip at this frame rate from the start of each video; "
                    "default: data.num_frames frames spread over the whole video (a model with an audio stream, "
                    "LTX-2: model.frame_rate)")
    ap.add_argument("--posterior", choices=["sample", "mode"], default="sample",
                    help="sample: a draw from the VAE posterior seeded by (train.seed, video), as CogVideoX "
                    "and finetrainers' Wan train; mode: its mean")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the stored tensors")
    ap.add_argument("--vae-dtype", choices=sorted(DTYPES), help="default: bf16 on accelerators with it, else fp32")
    ap.add_argument("--tiling", action="store_true", help="encode in tiles (less device memory, large videos)")
    ap.add_argument("--buckets", help="several clip shapes, 'FxHxW,FxHxW,...' in pixels (frames x height x "
                    "width), or 'preset': the config's data.buckets; each video goes to the one that keeps the most "
                    "of it (nearest aspect ratio, then the most frames it has); default: data.num_frames x "
                    "data.height x data.width")
    ap.add_argument("--limit", type=int, help="prepare at most this many more videos on each rank (a trial run)")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    return parser().parse_args(argv)


def settings(args, cfg, vae_config: dict) -> dict:
    """What the files in --out depend on; a rerun with different settings is refused."""
    return {"num_frames": cfg.data.num_frames, "height": cfg.data.height, "width": cfg.data.width,
            "fps": args.fps, "vae": str(args.vae.resolve()), "scaling_factor": vae_config.get("scaling_factor"),
            "posterior": args.posterior, "seed": cfg.train.seed, "dtype": args.dtype,
            "t5": str(args.t5.resolve()) if args.t5 else None, "max_text_len": cfg.model.max_text_len,
            **({"image_encoder": str(args.image_encoder.resolve())} if getattr(args, "image_encoder", None) else {}),
            **({"audio_vae": str(Path(args.audio_vae).resolve())} if getattr(args, "audio_vae", None) else {}),
            "buckets": [format_shape(b) for b in args.bucket_list] or None}


def bucket_config(cfg, bucket):
    """The experiment with one bucket's frames x height x width as its data section."""
    frames, height, width = bucket
    return cfg.model_copy(update={"data": cfg.data.model_copy(
        update={"num_frames": frames, "height": height, "width": width})})


def check_inputs(args, cfg) -> tuple[list[tuple[str, str]], dict]:
    """Everything checked before a model loads: captions and videos, VAE, T5, --out's earlier settings."""
    problems, entries, vae_config = [], [], {}
    args.bucket_list = []
    if getattr(args, "buckets", None):
        try:
            args.bucket_list = resolve_buckets(args.buckets, cfg, f"--config={args.config}")
        except ValueError as e:
            problems.append(str(e))
        for b in args.bucket_list:       # as training checks a bucket: whole latents, whole patches, positions
            problems += shape_problems(cfg, b, f"--buckets: {format_shape(b)}")
    for module, role in (("diffusers", "the VAE"), ("av", "reading video files (PyAV)")):
        if importlib.util.find_spec(module) is None:
            problems.append(f"{module} is not installed, needed for {role}: pip install '.[data]'")
    try:
        entries = read_captions(args.videos, args.captions)
    except InputError as e:
        problems.append(str(e))
    try:
        vae_config = read_vae_config(args.vae)
    except (FileNotFoundError, ValueError) as e:
        problems.append(str(e))
    if vae_config:
        per_bucket = []                  # [(problem, where)]; one said of every bucket is said once
        for b in args.bucket_list or [None]:
            c, where = (bucket_config(cfg, b), f" (bucket {format_shape(b)})") if b else (cfg, "")
            per_bucket += [(p, where) for p in check_vae(vae_config, c.model, c.data, key=f"--vae={args.vae}")]
        count = {p: sum(q == p for q, _ in per_bucket) for p, _ in per_bucket}
        everywhere = {p for p, n in count.items() if n == len(args.bucket_list or [None])}
        problems += list(dict.fromkeys(p if p in everywhere else p + where for p, where in per_bucket))
    own = check_encoder_folder(args.t5, family(cfg.model).formats.text_encoder, "--t5") if args.t5 else None
    if own is not None:                                 # the family's own encoder (HunyuanVideo: LLaMA + CLIP)
        problems += own
    elif args.t5:
        wanted = family(cfg.model).formats.text_encoder.class_name
        what = (f"expected a folder written by {wanted}.save_pretrained with its tokenizer beside it "
                "(for a release: text_encoder/ with the files of tokenizer/ copied in)")
        try:
            t5_config = json.loads((args.t5 / "config.json").read_text())
            d_model, name = t5_config.get("d_model"), encoder_class(t5_config)
            if name != wanted:
                problems.append(f"--t5={args.t5}: a {name or 'model of unknown class'}, but model.family="
                                f"{cfg.model.family} trains on {wanted} embeddings; {what}")
            if d_model != cfg.model.text_embed_dim:
                problems.append(f"--t5={args.t5}: d_model {d_model} != model.text_embed_dim "
                                f"{cfg.model.text_embed_dim}")
            if not (args.t5 / "tokenizer_config.json").is_file():
                problems.append(f"--t5={args.t5}: no tokenizer_config.json in it; {what}")
        except (OSError, json.JSONDecodeError) as e:
            problems.append(f"--t5={args.t5}: cannot read config.json ({e}); {what}")
    condition = family(cfg.model).training_condition(cfg.model, cfg.data)
    # the first frame's image states: Wan 2.1 I2V's CLIP (an image cross-attention), HunyuanVideo 1.5's SigLIP rows
    needs_encoder = getattr(condition, "image_encoder", False)
    if needs_encoder and getattr(args, "image_encoder", None) is None:
        problems.append(f"--image-encoder is missing: model {cfg.model.name} (--config={args.config}) trains on the "
                        f"first frame's {condition.states_name}; give the release's image "
                        f"encoder folder")
    elif getattr(args, "image_encoder", None) is not None:
        problems += (condition.image_encoder_problems(args.image_encoder) if needs_encoder else
                     [f"--image-encoder={args.image_encoder}: model {cfg.model.name} has no image cross-attention; "
                      f"leave --image-encoder out"])
    problems += stream_problems(args, cfg)             # LTX-2's audio: the clip at its frame rate, the audio VAE
    problems += image_problems(args, cfg, entries, condition)
    if args.limit is not None and args.limit < 0:
        problems.append(f"--limit={args.limit}: give a number >= 0")
    stamp = args.out / "prepare.json"
    if vae_config and stamp.is_file():
        before, now = json.loads(stamp.read_text()), settings(args, cfg, vae_config)
        changed = [f"{k}={before.get(k)!r} (now {now[k]!r})" for k in now if before.get(k) != now[k]]
        if changed:
            problems.append(f"--out={args.out} holds files prepared with other settings: {', '.join(changed)}; "
                            "use another --out, or delete the folder to start over")
    if problems:
        raise InputError("\n".join(problems))
    return entries, vae_config


def image_problems(args, cfg, entries, condition) -> list[str]:
    """Images are one-frame clips: refused for a model whose samples need more than a picture (a second stream's
    sound track, LTX-2; image-to-video, whose first frame is the condition: it would learn to copy it), and for a
    shape of more than one frame (a picture is not repeated into a still video). Said once for all images."""
    images = [rel for rel, _ in entries if is_image(rel)]
    if not images:
        return []
    first, more = args.videos / images[0], f" (and {len(images) - 1} more)" if len(images) > 1 else ""
    where = f"{first}{more}: an image"
    if family(cfg.model).training_stream(cfg.model, cfg.data) is not None:
        return [f"{where}; model {cfg.model.name} (--config={args.config}) trains on each clip's sound track, "
                f"which an image has not; prepare videos with sound only"]
    if condition is not None:
        return [f"{where}; model {cfg.model.name} (--config={args.config}) is image-to-video (model.image_condition):"
                f" a picture's only frame is its condition, so it would train to copy it; leave images out, or "
                f"train text-to-video (--set model.image_condition=false where the model does both, e.g. "
                f"wan2.2-ti2v-5b)"]
    if not args.bucket_list:
        return [] if cfg.data.num_frames == 1 else [
            f"{where} is a 1-frame clip, and data.num_frames={cfg.data.num_frames} (--config={args.config}); "
            f"add buckets with a 1-frame one (--buckets 1x{cfg.data.height}x{cfg.data.width},"
            f"{cfg.data.num_frames}x{cfg.data.height}x{cfg.data.width}), or --set data.num_frames=1"]
    problems, listed = [], ",".join(format_shape(b) for b in args.bucket_list)
    for rel in images:
        try:
            shape = choose_bucket(args.bucket_list, *probe(args.videos / rel))
        except VideoError:
            continue                                   # unreadable: skipped with its reason when its turn comes
        if shape[0] != 1:
            problems.append(f"{args.videos / rel}: an image is a 1-frame clip, and --buckets={args.buckets} gives "
                            f"it {format_shape(shape)}; add a 1-frame bucket (--buckets 1x{shape[1]}x{shape[2]},"
                            f"{listed})")
            break
    return problems


def outputs(rel: str, t5: bool) -> tuple[str, str | None]:
    """Manifest paths (relative to --out) of a video's latent and text-embedding files."""
    return f"latents/{rel}.safetensors", (f"text/{rel}.safetensors" if t5 else None)


def is_done(out: Path, rel: str, t5: bool) -> bool:
    latent, text = outputs(rel, t5)
    return (out / latent).is_file() and (text is None or (out / text).is_file())


def write_atomic(out: Path, rel_path: str, write, tag: str) -> None:
    """write(tmp_path) into out/.tmp, then rename it to out/rel_path (one filesystem, so atomic)."""
    final = out / rel_path
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = out / ".tmp" / f"{tag}-{uuid.uuid4().hex}{final.suffix}"
    write(tmp)
    os.replace(tmp, final)


def merge(out: Path, entries: list[tuple[str, str]], t5: bool, world_size: int, tag: str) -> tuple[int, int]:
    """manifest.jsonl and skipped.jsonl from the files on disk, in captions order; (prepared, skipped)."""
    (out / ".tmp").mkdir(parents=True, exist_ok=True)
    with open(out / ".tmp" / "merge.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        reasons = {}
        for part in sorted((out / ".tmp").glob(f"skipped.rank*-of-{world_size}.jsonl")):
            for line in part.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                    reasons[record["video"]] = record["reason"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue                        # a line cut short when its rank was killed
        manifest, skipped = [], []
        for rel, caption in entries:
            latent, text = outputs(rel, t5)
            if is_done(out, rel, t5):
                line = {"latent": latent, **({"text": text} if text else {}), "caption": caption, "video": rel,
                        **recorded_shape(out / latent)}
                manifest.append(json.dumps(line, ensure_ascii=False) + "\n")
            elif rel in reasons:
                skipped.append(json.dumps({"video": rel, "reason": reasons[rel]}, ensure_ascii=False) + "\n")
        for name, lines in (("manifest.jsonl", manifest), ("skipped.jsonl", skipped)):
            write_atomic(out, name, lambda p: p.write_text("".join(lines), encoding="utf-8"), tag)
    return len(manifest), len(skipped)


def recorded_shape(latent: Path) -> dict:
    """{"shape": [F, H, W]} from a bucketed latent's metadata (the header only), else {}."""
    from safetensors import safe_open

    with safe_open(str(latent), "pt") as f:
        shape = (f.metadata() or {}).get("shape")
    return {"shape": [int(n) for n in shape.split("x")]} if shape else {}


class ClipEncoder:
    """One video -> its latent file (and text file with a T5): decode, encode, write atomically."""

    def __init__(self, args, cfg, local_rank: int, tag: str):
        from parallel.distributed import accelerator

        device = accelerator.device(local_rank)
        self.vae = load_vae(args.vae, device, DTYPES[args.vae_dtype] if args.vae_dtype
                            else default_dtype())
        if args.tiling:
            self.vae.enable_tiling()
        self.t5 = None
        if args.t5:
            from models.text_encoder import build_text_encoder
            self.t5 = build_text_encoder(args.t5, cfg.model.max_text_len, cfg.model.text_embed_dim, device,
                                         cache_size=0, expected=family(cfg.model).formats.text_encoder, key="--t5",
                                         model=cfg.model)
        self.args, self.data, self.seed, self.tag = args, cfg.data, cfg.train.seed, tag
        self.store, self.model, self.buckets = DTYPES[args.dtype], cfg.model, args.bucket_list
        self.condition = family(cfg.model).training_condition(cfg.model, cfg.data)
        self.stream = None                     # a second stream's source (LTX-2's audio VAE)
        if getattr(args, "audio_vae", None):
            self.stream = family(cfg.model).training_stream(cfg.model, cfg.data).load_source(args.audio_vae, device)
        self.image_encoder = None
        if getattr(args, "image_encoder", None):
            self.image_encoder = self.condition.load_image_encoder(args.image_encoder, device, self.vae.dtype)

    def __call__(self, rel: str, caption: str) -> None:
        """Writes the video's files; raises VideoError for an unusable video."""
        args, data = self.args, self.data
        meta = {"video": rel, "caption": caption}
        if self.buckets:
            bucket = choose_bucket(self.buckets, *probe(args.videos / rel, args.fps))
            data = data.model_copy(update=dict(zip(("num_frames", "height", "width"), bucket)))
            meta["shape"] = format_shape(bucket)
        self.expected = (self.model.in_channels, *latent_shape(self.model, data))
        frames = read_clip(args.videos / rel, data.num_frames, data.height, data.width, args.fps)
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "vae", rel)) \
            if args.posterior == "sample" else None
        latent = pad_frames(encode(self.vae, frames, generator), self.model).to(self.store).contiguous()
        tensors = {"latent": latent}
        if self.condition is not None:        # image-to-video: the first frame's latents (and CLIP states)
            noise = torch.Generator().manual_seed(derive_seed(self.seed, "image", rel))
            stored = self.condition.stored_tensors(encode, self.vae, frames, generator, noise, self.image_encoder)
            tensors.update({name: value.to(self.store).contiguous() for name, value in stored.items()})
        if self.stream is not None:           # the clip's sound track: the second stream's latents
            tensors[STREAM_KEYS[0][1]] = self.stream_latents(rel, data)
        if tuple(latent.shape) != self.expected:
            raise RuntimeError(f"{rel}: the VAE gave a latent of shape {list(latent.shape)}, the model expects "
                               f"{list(self.expected)} (data.num_frames/height/width, model.vae_scale_*)")
        latent_path, text_path = outputs(rel, self.t5 is not None)
        if self.t5 is not None:
            text = text_tensors(self.t5, caption, self.store)
            write_atomic(args.out, text_path, lambda p: save_file(text, str(p), meta), self.tag)
        write_atomic(args.out, latent_path, lambda p: save_file(tensors, str(p), meta), self.tag)

    def stream_latents(self, rel: str, data) -> torch.Tensor:
        """The clip's sound track (its num_frames / fps seconds) as the second stream's latents [A, C], a posterior
        draw seeded by (train.seed, "audio", video) or its mode (--posterior)."""
        stream = family(self.model).training_stream(self.model, data)
        wave = read_audio(self.args.videos / rel, data.num_frames / self.args.fps, self.stream.sample_rate)
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "audio", rel)) \
            if self.args.posterior == "sample" else None
        try:
            return self.stream.encode(wave, stream.tokens(), generator).to(self.store).contiguous()
        except RuntimeError as e:                    # the audio VAE against model.audio_*: every clip alike
            raise RuntimeError(f"{rel}: {e} (model.audio_scale_factor, model.frame_rate)") from None

    def write_unconditional(self) -> None:
        """uncond.safetensors: the text encoder on the empty prompt, the default negative prompt of CogVideoX's
        pipelines and of WanPipeline (encode_prompt: `negative_prompt or ""`)."""
        write_unconditional(self.args.out, self.t5, self.store, self.tag)


def text_tensors(encoder, caption: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{"text": [L, D]} of the caption, and a second stream's caption states beside it where the family's encoder
    gives them by name (LTX-2's {"text", "audio_text"})."""
    out = encoder.encode(caption)
    return {k: v.to(dtype).contiguous() for k, v in (out if isinstance(out, dict) else {"text": out}).items()}


def write_unconditional(out: Path, t5, dtype: torch.dtype, tag: str) -> None:
    text = text_tensors(t5, "", dtype)
    write_atomic(out, UNCOND_FILE, lambda p: save_file(text, str(p), {"caption": ""}), tag)


def prepare(args, cfg, env) -> dict:
    """This rank's share of the videos, then the merged manifest; counts for the summary line."""
    entries, vae_config = check_inputs(args, cfg)
    out, t5, rank, world = args.out, args.t5 is not None, env.rank, env.world_size
    tmp, tag = out / ".tmp", f"r{rank}"
    tmp.mkdir(parents=True, exist_ok=True)
    for leftover in tmp.glob(f"{tag}-*"):              # this rank's writes cut short by an interruption
        leftover.unlink()
    if rank == 0:
        text = json.dumps(settings(args, cfg, vae_config), indent=1) + "\n"
        write_atomic(out, "prepare.json", lambda p: p.write_text(text), tag)
        if args.captions:
            listed = {rel for rel, _ in entries}
            unlisted = [p for p in video_files(args.videos) if p.relative_to(args.videos).as_posix() not in listed]
            if unlisted:
                print(f"note: {len(unlisted)} video(s) in --videos={args.videos} have no line in --captions and "
                      f"are not prepared, e.g. {unlisted[0]}", file=sys.stderr)
    share = entries[rank::world]
    todo = [(rel, caption) for rel, caption in share if not is_done(out, rel, t5)]
    counts = {"share": len(share), "done_before": len(share) - len(todo), "prepared": 0, "skipped": 0}
    todo = todo[:args.limit] if args.limit is not None else todo
    skip_log = tmp / f"skipped.rank{rank}-of-{world}.jsonl"
    skip_log.write_text("")
    need_uncond = t5 and rank == 0 and not (out / UNCOND_FILE).is_file()
    if todo or need_uncond:
        encode_clip = ClipEncoder(args, cfg, env.local_rank, tag)
    if need_uncond:
        encode_clip.write_unconditional()
    if todo:
        bar = tqdm(todo, desc=f"rank {rank}/{world}", unit="video", position=env.local_rank, file=sys.stderr,
                   dynamic_ncols=True)
        for rel, caption in bar:
            try:
                encode_clip(rel, caption)
                counts["prepared"] += 1
            except VideoError as e:
                bar.write(f"skipping {args.videos / rel}: {e}", file=sys.stderr)
                with open(skip_log, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"video": rel, "reason": str(e)}, ensure_ascii=False) + "\n")
                counts["skipped"] += 1
        bar.close()
    counts["manifest"], counts["manifest_skipped"] = merge(out, entries, t5, world, tag)
    counts["total"] = len(entries)
    if args.bucket_list:
        held = [tuple(json.loads(line).get("shape", ())) for line in (out / "manifest.jsonl").read_text().splitlines()]
        counts["buckets"] = {format_shape(b): held.count(b) for b in args.bucket_list}
    return counts


def main(argv=None) -> int:
    args = parse_args(argv)
    env = read_launch_env()
    try:
        cfg = load_config(args.config, args.overrides)
        counts = prepare(args, cfg, env)
    except (ConfigError, InputError) as e:
        return refused(parser().prog, str(e)) if env.local_rank == 0 else REFUSED
    print(f"rank {env.rank} of {env.world_size}: {counts['prepared']} prepared, {counts['skipped']} skipped, "
          f"{counts['done_before']} done before, of {counts['share']} videos in this rank's share; "
          f"{args.out / 'manifest.jsonl'}: {counts['manifest']} of {counts['total']} videos, "
          f"{counts['manifest_skipped']} in skipped.jsonl", flush=True)
    for bucket, n in counts.get("buckets", {}).items():
        print(f"  bucket {bucket}: {n} video{'' if n == 1 else 's'} in the manifest", flush=True)
    return 0

