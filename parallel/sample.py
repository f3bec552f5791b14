"""Sample videos from released weights or a checkpoint, in one process or in any layout, as the release's pipeline does.

    python -m parallel.sample --config cogvideox-2b --set model.init_from=CogVideoX-2b/transformer \\
        --set data.text_encoder=t5/ --vae CogVideoX-2b/vae --prompt "a cat on a wall" --out samples/
    deepspeed --num_gpus 4 --module parallel.sample --config run.yaml --deepspeed-config ds.json \\
        --set parallel.tp_size=2 --set parallel.pp_size=2 --prompt-embeds p.safetensors \\
        --negative-embeds n.safetensors --noise noise.safetensors --steps 50 --guidance 6 --sampler dpm \\
        --out latents.safetensors

Weights: `model.init_from` (a released transformer/ folder, or `python -m parallel.export --format diffusers`'s),
read by every rank for its part of the layout, in fp32; without it, a checkpoint of ckpt.dir
(<train.output_dir>/checkpoints): `--checkpoint latest` (default) the newest usable one, `--checkpoint N` (or
stepN) that step's, launched with the layout and DeepSpeed JSON that wrote it (`--ema`: its EMA weights), found
or refused (with the steps there are) before any process group exists. A run that started from init_from:
`--set model.init_from=null` samples its checkpoints.

Prompts, a batch of B rows in this order: captions (`--prompt`, encoded with data.text_encoder), then each
`--prompt-embeds` file's rows (one tensor, [L, D] or [B_i, L, D]). The unconditional input (guidance != 1) is
`--negative-embeds` ([L, D] or [1, L, D] for every row, or [B, L, D]), else T5 of "" (data.text_encoder), else
data.path's uncond.safetensors. `--steps`, `--guidance`, `--sampler` default to the `val:` keys (sample_steps,
guidance_scale, sampler); dynamic CFG is val.use_dynamic_cfg; the schedule is model.schedule. A model of two
experts (Wan 2.2 A14B): `--guidance` is the high-noise expert's, `--guidance-2` (val.guidance_scale_2) the
low-noise one's, as WanPipeline's guidance_scale and guidance_scale_2.

Noise: `--noise FILE` (one tensor [B, C, T, H, W], the toolkit's latent layout; T, H, W from data.num_frames,
data.height, data.width) samples the batch as CogVideoXPipeline(..., latents=noise.transpose(1, 2),
generator=torch.Generator().manual_seed(seed)) does: the dpm sampler draws the whole batch's step noise from
that one generator. Without it, prompt i starts from noise drawn from (--seed, i), the generator its dpm sampler
continues (as validation samples). seed: --seed, default train.seed. Data-parallel replicas split the rows.

Image-to-video models (model.image_condition): the first frame of every row, either `--image-latents FILE`
(one tensor [C, 1, H, W] for every row or [B, C, 1, H, W], the toolkit's layout of the VAE latent, scaled as
the pipeline scales it) or `--image PICTURE` (repeatable: one for every row, or one per row), encoded with
the VAE folder `--vae` as CogVideoXImageToVideoPipeline encodes its `image` (resized to data.height x
data.width, the posterior's mode; models/cogvideox/image.py). Both the conditional and the unconditional
call see the image latents, as in the pipeline; with --noise the batch equals
CogVideoXImageToVideoPipeline(image=..., latents=noise.transpose(1, 2), generator=..., output_type="latent")
given the same image latents (the pipeline draws its image latent from the posterior with the sampler's generator;
--image takes the mode).
Wan 2.1 I2V (models/wan/image.py): the image latents are [C, T, H, W] (the picture then gray frames through the
VAE, as WanImageToVideoPipeline.prepare_latents), and the model also takes the picture's CLIP states: with
`--image`, encoded by `--image-encoder DIR` (CLIPVisionModel + preprocessor_config.json) as the pipeline's
encode_image; with `--image-latents`, given as `--image-embeds FILE` ([I, image_dim] or [B, I, image_dim]).
HunyuanVideo 1.5 I2V (models/hunyuanvideo15/siglip.py): the picture's SigLIP states, encoded the same way
(`--image-encoder`: the pipeline folder's image_encoder/ and feature_extractor/, as its _get_image_embeds) or given
(`--image-embeds`), become the image rows of the prompt's and the negative prompt's text rows alike.

LTX-2 (a model of two streams, video and audio): its pipeline's own loop, both streams together (the sampler
"ltx2": models/ltx2/sampling.py, equal to LTX2Pipeline(..., output_type="latent")); each --prompt-embeds and
--negative-embeds file holds the connector's caption states of both, "text" and "audio_text" (guidance needs
--negative-embeds); --noise holds "latents" and "audio" [B, A, C] (packed); without it prompt i's audio noise is
drawn after its video noise; `--guidance` guides the video and `--guidance-2` (val.guidance_scale_2, default
--guidance) the audio (the pipeline's guidance_scale, audio_guidance_scale), `--guidance-rescale` both (its
guidance_rescale and audio_guidance_rescale, default its 0.7); the output adds "audio" (a folder: "prompt<i>_audio");
no decoder (val.decoder, and --vae but as --image's encoder: refused). Its image-to-video (model.image_condition,
equal to LTX2ImageToVideoPipeline(latents=..., output_type="latent") with the picture's latent in the latents' frame
0): `--image-latents`, or `--image` with `--vae` (the picture encoded and normalised as that pipeline does:
models/ltx2/image.py), the picture's latent in frame 0 of every step's input and of the result.

Output (rank 0): `--out FILE.safetensors` writes {"latents": [B, C, T, H, W]}, and with a decoder (--vae DIR or
val.decoder) the videos FILE/prompt<i>.{gif,mp4,txt} (FILE without the suffix). `--out DIR` (any other name)
writes DIR/latents.safetensors ({"latents": [B, C, T, H, W], "prompt<i>": [C, T, H, W]}) and the videos
DIR/prompt<i>.{gif,mp4,txt} (the latent preview when no decoder is given). Formats and fps are val.formats, val.fps.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from models.sampling import SAMPLERS
from parallel.check import load_and_check
from parallel.experiment.cli import LATEST, Parser, add_checkpoint, add_experiment_args, refused, run
from parallel.experiment.config import UNCOND_FILE, ConfigError
from parallel.distributed.topology import read_launch_env


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="python -m parallel.sample", description=__doc__.splitlines()[0])
    add_experiment_args(ap, deepspeed_required=False)
    add_checkpoint(ap, help="without model.init_from, the checkpoint to sample: latest (default; also auto) the "
                   "newest usable one in ckpt.dir; N or stepN: ckpt.dir's stepN")
    ap.add_argument("--prompt", action="append", default=[], help="a caption (needs data.text_encoder); repeatable")
    ap.add_argument("--prompt-embeds", action="append", default=[], type=Path,
                    help="T5 embeddings, one tensor [L, D] or [B, L, D] (L = model.max_text_len); repeatable")
    ap.add_argument("--negative-embeds", type=Path, default=None,
                    help="the unconditional embeddings [L, D] or [B, L, D]; default: T5 of \"\" or data.path's "
                         + UNCOND_FILE)
    ap.add_argument("--noise", type=Path, default=None, help="the initial latents, one tensor [B, C, T, H, W]; "
                    "default: drawn per prompt from (--seed, i)")
    ap.add_argument("--image", action="append", default=[], type=Path,
                    help="image-to-video: the first frame, a picture encoded with --vae; repeatable (1 or one per row)")
    ap.add_argument("--image-latents", type=Path, default=None,
                    help="image-to-video: the first frames' latents, one tensor [C, 1, H, W] or [B, C, 1, H, W]")
    ap.add_argument("--image-encoder", type=Path, default=None, help="image-to-video with image states: the "
                    "encoder folder that encodes --image (Wan 2.1 I2V: CLIP vision; HunyuanVideo 1.5 I2V: SigLIP, "
                    "the pipeline folder)")
    ap.add_argument("--image-embeds", type=Path, default=None, help="image-to-video with image states: the CLIP "
                    "(SigLIP) states beside --image-latents, one tensor [I, image_dim] or [B, I, image_dim]")
    ap.add_argument("--steps", type=int, default=None, help="sampling steps; default val.sample_steps")
    ap.add_argument("--guidance", type=float, default=None, help="guidance scale; default val.guidance_scale")
    ap.add_argument("--guidance-2", dest="guidance_2", type=float, default=None,
                    help="a model of two experts (Wan 2.2 A14B): the low-noise expert's guidance scale (WanPipeline's "
                    "guidance_scale_2), --guidance the high-noise one's; LTX-2: the audio stream's (LTX2Pipeline's "
                    "audio_guidance_scale), --guidance the video's; default val.guidance_scale_2, else --guidance")
    ap.add_argument("--guidance-rescale", dest="guidance_rescale", type=float, default=None,
                    help="LTX-2: both streams' guidance rescale (LTX2Pipeline's guidance_rescale and "
                    "audio_guidance_rescale), default the pipeline's 0.7; 0 turns it off")
    ap.add_argument("--sampler", default=None, help=f"one of {', '.join(sorted(s for g in SAMPLERS.values() for s in g))} "
                    "or a family's own (LTX-2: ltx2), fitting the model's objective (a misfit is refused, naming those "
                    "that fit); default val.sampler, else the first the model's family offers for its objective")
    ap.add_argument("--seed", type=int, default=None, help="noise seed; default train.seed")
    ap.add_argument("--ema", action="store_true", help="a checkpoint's EMA weights instead of its weights")
    ap.add_argument("--vae", default=None, help="decoder for the videos and encoder of --image (a VAE folder of "
                    "the model's family); default val.decoder")
    ap.add_argument("--out", required=True, type=Path, help="FILE.safetensors (latents) or a folder (latents, videos)")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    return parser().parse_args(argv)


def _tensor(path: Path, load: bool = True, key: Optional[str] = None):
    """The file's tensor (`key`; else "text" or "latents" if present, else its only one): the tensor, or
    (load=False) its shape; with `key`, None when the file has no such tensor."""
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        if key is not None:
            if key not in keys:
                return None
        elif "text" in keys or "latents" in keys:
            key = "text" if "text" in keys else "latents"
        elif len(keys) != 1:
            raise ValueError(f"{path}: expected one tensor, found {len(keys)} ({', '.join(keys[:5])})")
        else:
            key = keys[0]
        return f.get_tensor(key).float() if load else tuple(f.get_slice(key).get_shape())


def _rows(path: Path, shape: tuple) -> int:
    if len(shape) not in (2, 3):
        raise ValueError(f"{path}: embeddings are [L, D] or [B, L, D], got {list(shape)}")
    return 1 if len(shape) == 2 else shape[0]


def _settings(args, cfg) -> tuple[int, float, Optional[str], int]:
    """(steps, guidance, sampler, seed): the flags, else the val: keys and train.seed."""
    return (args.steps or cfg.val.sample_steps, cfg.val.guidance_scale if args.guidance is None else args.guidance,
            args.sampler or cfg.val.sampler, cfg.train.seed if args.seed is None else args.seed)


def guidance_of(args, cfg, guidance: float):
    """The sampler's guidance (models/sampling.py): `guidance` throughout, or with two experts (Wan 2.2 A14B)
    `guidance` for the high-noise one and --guidance-2 / val.guidance_scale_2 for the low-noise one. A
    ValueError naming the flag or key when the model has one transformer."""
    from models.registry import family
    from models.sampling import family_guidance

    second = cfg.val.guidance_scale_2 if args.guidance_2 is None else args.guidance_2
    try:
        return family_guidance(family(cfg.model), cfg.model, guidance, second)
    except ValueError as e:
        if args.guidance_2 is None:
            raise
        raise ValueError(f"--guidance-2 {args.guidance_2}: model {cfg.model.name} has one transformer (the "
                         f"low-noise expert's guidance needs two: model.experts.train both); leave out "
                         f"--guidance-2") from e


def check_args(args, cfg, layout, ds: dict | None = None) -> list[str]:
    """Every problem with the command line, before a model loads."""
    from models.geometry import latent_shape
    from models.registry import family
    from models.sampling import check_sampler

    problems, rows = [], len(args.prompt)
    steps, guidance, sampler, _ = _settings(args, cfg)
    if not args.prompt and not args.prompt_embeds:
        problems.append("nothing to sample: give --prompt or --prompt-embeds")
    if args.prompt and not cfg.data.text_encoder:
        problems.append("--prompt needs a T5 encoder: --set data.text_encoder=<folder>, or give --prompt-embeds")
    shapes = {}
    for path in args.prompt_embeds + [p for p in (args.negative_embeds, args.noise, args.image_latents,
                                                  args.image_embeds) if p]:
        try:
            shapes[path] = _tensor(path, load=False) if path.is_file() else None
        except Exception as e:                   # not a safetensors file, or several tensors
            problems.append(f"{path}: {e}")
            continue
        if shapes[path] is None:
            problems.append(f"{path}: no such file")
    for path in [p for p in args.prompt_embeds + [args.negative_embeds] if p and shapes.get(p)]:
        try:
            n = _rows(path, shapes[path])
            rows += n if path in args.prompt_embeds else 0
        except ValueError as e:
            problems.append(str(e))
            continue
        want = [cfg.model.max_text_len, cfg.model.text_embed_dim]
        if list(shapes[path][-2:]) != want:
            problems.append(f"{path}: embeddings [.., L, D] = {list(shapes[path])}, the model takes [L, D] = {want} "
                            "(model.max_text_len, model.text_embed_dim)")
    neg = shapes.get(args.negative_embeds)
    if neg and len(neg) == 3 and neg[0] not in (1, rows):
        problems.append(f"--negative-embeds {args.negative_embeds}: {neg[0]} rows for {rows} prompts; "
                        f"give 1 or {rows}")
    if args.noise and shapes.get(args.noise):
        want = (rows, cfg.model.in_channels, *latent_shape(cfg.model, cfg.data))
        if tuple(shapes[args.noise]) != want:
            problems.append(f"--noise {args.noise}: shape {list(shapes[args.noise])}, expected [B, C, T, H, W] = "
                            f"{list(want)} ({rows} prompts, model.in_channels; T, H, W from data.num_frames, "
                            f"data.height, data.width)")
    problems += _check_image(args, cfg, rows, shapes)
    stream = family(cfg.model).training_stream(cfg.model, cfg.data)
    second = cfg.val.guidance_scale_2 if args.guidance_2 is None else args.guidance_2
    if stream is not None:
        problems += _check_stream(args, cfg, stream, rows, guidance != 1 or second not in (None, 1), steps)
    elif args.guidance_rescale is not None:
        problems.append(f"--guidance-rescale {args.guidance_rescale}: model {cfg.model.name}'s sampler has no "
                        f"guidance rescale (LTX-2's has); leave it out")
    uncond = Path(cfg.data.path) / UNCOND_FILE if cfg.data.path else None
    if (guidance != 1 or second not in (None, 1)) and not args.negative_embeds and not cfg.data.text_encoder and \
            not (uncond and uncond.is_file()) and stream is None:          # a second stream: _check_stream's
        key = f"val.guidance_scale={guidance}" if args.guidance is None else f"--guidance {guidance}"
        if guidance == 1:
            key = f"val.guidance_scale_2={second}" if args.guidance_2 is None else f"--guidance-2 {second}"
        problems.append(f"{key} needs the unconditional embedding: give --negative-embeds, or set "
                        f"data.text_encoder (T5 of \"\"), or data.path with {UNCOND_FILE}")
    if not 1 <= steps <= 1000:
        problems.append(f"--steps={steps}: give a number in [1, 1000]")
    try:
        check_sampler(cfg.model.objective, sampler, family(cfg.model).sampling.samplers)
    except ValueError as e:
        problems.append(f"--sampler / val.sampler: {e}")
    try:
        guidance_of(args, cfg, guidance)
    except ValueError as e:
        problems.append(str(e))
    return problems + _check_weights(args, cfg, layout, ds or {})


def _check_stream(args, cfg, stream, rows: int, guided: bool, steps: int) -> list[str]:
    """A model of two streams (LTX-2: video and audio): each --prompt-embeds and --negative-embeds file holds the
    second stream's caption "audio_text" beside "text" (as a prepared sample's text file), the unconditional one
    given (guided), --noise holds its noise "audio" beside "latents", no decoder is asked for, and its sampler
    takes the steps."""
    from parallel.experiment.manifest import STREAM_KEYS

    (_, noise_key), (_, text_key) = STREAM_KEYS
    audio, caption = stream.shapes()
    problems = [] if steps >= stream.min_steps else [
        f"--steps={steps}: model {cfg.model.name}'s sampler takes {stream.min_steps} or more (LTX2Pipeline's schedule "
        f"ends at its shift terminal: one step is 0 / 0)"]
    for path in [p for p in args.prompt_embeds + [args.negative_embeds] if p and p.is_file()]:
        shape = _tensor(path, load=False, key=text_key)
        if shape is None or list(shape[-2:]) != list(caption):
            problems.append(f"{path}: model {cfg.model.name} takes a second caption: \"{text_key}\" [L, D] = "
                            f"{list(caption)} beside \"text\" (found {list(shape) if shape else 'none'}; "
                            f"the connector's audio caption states, as a prepared sample's text file holds them)")
    if guided and not args.negative_embeds:
        problems.append(f"guidance needs the unconditional captions of both streams of model {cfg.model.name}: give "
                        f"--negative-embeds (\"text\" and \"{text_key}\")")
    if args.guidance_rescale is not None and not 0 <= args.guidance_rescale <= 1:
        problems.append(f"--guidance-rescale {args.guidance_rescale}: give a number in [0, 1] (0: off)")
    if args.noise and args.noise.is_file():
        shape = _tensor(args.noise, load=False, key=noise_key)
        if shape != (rows, *audio):
            problems.append(f"--noise {args.noise}: model {cfg.model.name} starts its second stream from \"{noise_key}"
                            f"\" [B, A, C] = {[rows, *audio]} beside \"latents\" (found "
                            f"{list(shape) if shape else 'none'}; A from data.num_frames and model.frame_rate)")
    if (args.vae and not args.image) or cfg.val.decoder:           # --vae with --image: the picture's encoder only
        problems.append(f"{'val.decoder' if cfg.val.decoder else '--vae'}: decoding model {cfg.model.name}'s latents is "
                        f"not built (docs/models.md); leave it out: the latents of both streams are written")
    return problems


def _check_image(args, cfg, rows: int, shapes: dict) -> list[str]:
    """The image-to-video input: exactly one of --image / --image-latents for an I2V model, none otherwise."""
    from models.geometry import latent_shape
    from models.registry import family

    given = [flag for flag, v in (("--image", args.image), ("--image-latents", args.image_latents)) if v]
    condition = family(cfg.model).training_condition(cfg.model, cfg.data)
    if condition is None:
        return [f"{' and '.join(given)}: model {cfg.model.name} is text-to-video (its family's conditioning is off); "
                "leave out the image"] if given else []
    # what the sampler takes (LTX-2: the picture's latent, which its training data does not store)
    shapes_of = getattr(condition, "sampling_shapes", condition.stored_shapes)
    stored = shapes_of([cfg.model.in_channels, *latent_shape(cfg.model, cfg.data)])
    want = stored["image"]
    label = "[C, 1, H, W]" if want[1] == 1 else "[C, T, H, W]"
    if len(given) != 1:
        return [f"model {cfg.model.name} is image-to-video: give the first frame, either --image PICTURE (with --vae) "
                f"or --image-latents FILE {label}" + (", not both" if given else "")]
    if args.image and not hasattr(condition, "encode_pictures"):
        return [f"--image: encoding a picture for model {cfg.model.name} is not built (docs/models.md); give the "
                f"picture's latent: --image-latents FILE {label}"]
    problems = _check_image_embeds(args, condition, rows, shapes, stored)
    if args.image:
        missing = [str(p) for p in args.image if not p.is_file()]
        problems += [f"--image {', '.join(missing)}: no such file"] if missing else []
        if len(args.image) not in (1, rows):
            problems.append(f"--image: {len(args.image)} pictures for {rows} prompts; give 1 or {rows}")
        if not (args.vae or cfg.val.decoder):
            problems.append(f"--image needs the VAE that encodes it: --vae <{family(cfg.model).formats.vae.release}>")
    shape = shapes.get(args.image_latents)
    if shape and not (list(shape) == want or (len(shape) == 5 and shape[0] in (1, rows) and list(shape[1:]) == want)):
        problems.append(f"--image-latents {args.image_latents}: shape {list(shape)}, expected {label} = {want} "
                        f"or [B, {label[1:]} with B 1 or {rows} (model.in_channels; H, W from data.height, "
                        f"data.width)")
    return problems


def _check_image_embeds(args, condition, rows: int, shapes: dict, stored: dict) -> list[str]:
    """The picture's image states (an image cross-attention's CLIP states, Wan 2.1 I2V; HunyuanVideo 1.5's SigLIP
    rows): --image-encoder with --image, --image-embeds with --image-latents."""
    if not getattr(condition, "image_encoder", False):
        given = [flag for flag, v in (("--image-encoder", args.image_encoder), ("--image-embeds", args.image_embeds))
                 if v]
        return [f"{' and '.join(given)}: the model has no image cross-attention; leave it out"] if given else []
    states, encoder = condition.states_name, condition.encoder_name
    takes = "text input's image rows" if hasattr(condition, "text_rows") else "image cross-attention"
    if args.image and not args.image_encoder:
        return [f"--image needs the {encoder} of the model's {takes}: --image-encoder DIR"]
    if args.image:
        return condition.image_encoder_problems(args.image_encoder)
    if args.image_latents and not args.image_embeds:
        return [f"--image-latents needs the {states} of the model's {takes}: --image-embeds FILE"]
    shape, want = shapes.get(args.image_embeds), stored["image_embeds"]
    if shape and not (list(shape) == want or (len(shape) == 3 and shape[0] in (1, rows) and list(shape[1:]) == want)):
        return [f"--image-embeds {args.image_embeds}: shape {list(shape)}, expected [I, D] = {want} or [B, I, D] "
                f"with B 1 or {rows} (model.image_len, model.image_dim)"]
    return []


def load_first_frames(args, cfg, rows: int):
    """(The image-to-video rows' first-frame latents [B, C, 1, H, W] (Wan: [B, C, T, H, W]), the inputs after the
    text: (CLIP states [B, I, image_dim],) or ()), or (None, ()) for a text-to-video model."""
    if not (args.image or args.image_latents):
        return None, ()
    if args.image_latents:
        first = _tensor(args.image_latents)
        extra = (_tensor(args.image_embeds),) if args.image_embeds else ()
    else:
        from PIL import Image

        from models.registry import family
        from models.vae import load_vae
        condition = family(cfg.model).training_condition(cfg.model, cfg.data)
        pictures = [Image.open(p).convert("RGB") for p in args.image]
        first = condition.encode_pictures(load_vae(args.vae or cfg.val.decoder), pictures, cfg.data.height,
                                          cfg.data.width)
        extra = ((condition.encode_image_states(condition.load_image_encoder(args.image_encoder), pictures),)
                 if args.image_encoder else ())
    first = first[None] if first.dim() == 4 else first
    extra = tuple(e[None] if e.dim() == 2 else e for e in extra)
    return (first.expand(rows, *first.shape[1:]).contiguous(),
            tuple(e.expand(rows, *e.shape[1:]).contiguous() for e in extra))


def _check_weights(args, cfg, layout, ds: dict) -> list[str]:
    from parallel.experiment.ds_config import EMA_OPTIMIZERS

    if cfg.model.init_from:
        if args.checkpoint != LATEST:
            return [f"--checkpoint {args.checkpoint} reads ckpt.dir; model.init_from is set (sampled instead): "
                    f"--set model.init_from=null to sample step{args.checkpoint}"]
        return ["--ema reads a checkpoint's EMA; model.init_from is set (released weights have none): "
                "--set model.init_from=null to sample the newest checkpoint"] if args.ema else []
    from parallel.checkpoints.checkpoint import find_resume, model_signature
    from parallel.train.run import checkpoint_layout
    try:
        tag = find_resume(Path(cfg.ckpt_dir), checkpoint_layout(layout), model=model_signature(cfg.model),
                          step=None if args.checkpoint == LATEST else args.checkpoint, quiet=True, release=None)
    except ValueError as e:
        return [str(e)]
    if tag is None:
        return [f"no weights: model.init_from is not set and {cfg.ckpt_dir} (ckpt.dir) has no complete checkpoint; "
                "give --set model.init_from=<diffusers transformer folder> or train.output_dir of a run"]
    kind = str((ds.get("optimizer") or {}).get("type", "AdamW"))
    if args.ema and kind.lower() not in EMA_OPTIMIZERS:
        return [f"--ema: the DeepSpeed JSON's optimizer.type={kind!r} keeps no EMA; give the JSON the run trained "
                f"with (\"type\": \"FusedEmaAdam\" or \"EmaAdamW\"), or leave out --ema"]
    return []


def load_prompts(args, cfg, second: Optional[str] = None):
    """(labels, text [B, L, D], uncond [B, L, D] or None) from the captions and embedding files. second: the key of
    a second stream's caption in the same files (LTX-2's "audio_text"): text and uncond are then (text, second)."""
    import torch

    def batch(path, key=None):
        t = _tensor(path, key=key)
        return t[None] if t.dim() == 2 else t

    encoder = None
    if cfg.data.text_encoder:
        from models.registry import family
        from models.text_encoder import build_text_encoder
        encoder = build_text_encoder(cfg.data.text_encoder, cfg.model.max_text_len, cfg.model.text_embed_dim,
                                     expected=family(cfg.model).formats.text_encoder, model=cfg.model)
    labels, texts = list(args.prompt), [encoder.encode(text).float()[None] for text in args.prompt]
    for path in args.prompt_embeds:
        t = batch(path)
        labels += [str(path)] if len(t) == 1 else [f"{path}[{j}]" for j in range(len(t))]
        texts.append(t)
    text = torch.cat(texts)
    rows = len(text)
    if second:          # no captions to encode (check_args): the files' rows in the same order
        text = (text, torch.cat([batch(path, second) for path in args.prompt_embeds]))
    if _settings(args, cfg)[1] == 1:
        return labels, text, None
    uncond = _tensor(args.negative_embeds) if args.negative_embeds else \
        encoder.encode("").float() if encoder else _tensor(Path(cfg.data.path) / UNCOND_FILE)
    uncond = uncond[None] if uncond.dim() == 2 else uncond
    uncond = uncond.expand(rows, *uncond.shape[1:]).contiguous()
    if second:
        audio = batch(args.negative_embeds, second)
        uncond = (uncond, audio.expand(rows, *audio.shape[1:]).contiguous())
    return labels, text, uncond


def write_outputs(out: Path, latents, labels: list[str], cfg, decoder: Optional[str]) -> list[Path]:
    """The latents file and (folder form, or with a decoder) the videos; the paths written. A model of two streams
    (latents a pair: LTX-2's video and audio): the second as "audio" ([B, A, C]; "prompt<i>_audio" in a folder)
    beside "latents"; the videos from the first."""
    from safetensors.torch import save_file

    from models.geometry import video_latent
    from parallel.validation.media import load_decoder, write_gif, write_mp4

    written, audio = [], None
    if isinstance(latents, tuple):
        latents, audio = latents
    tensors = {"latents": latents.contiguous(), **({} if audio is None else {"audio": audio.contiguous()})}
    if out.suffix == ".safetensors":
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out))
        written.append(out)
        folder = out.with_suffix("") if decoder else None
    else:
        out.mkdir(parents=True, exist_ok=True)
        rows = {f"prompt{i}": v.clone() for i, v in enumerate(latents)}
        rows.update({} if audio is None else {f"prompt{i}_audio": a.clone() for i, a in enumerate(audio)})
        save_file({**tensors, **rows}, str(out / "latents.safetensors"))
        written.append(out / "latents.safetensors")
        folder = out
    if folder is not None:
        decode = load_decoder(decoder)
        folder.mkdir(parents=True, exist_ok=True)
        for i, latent in enumerate(latents):
            frames = decode(video_latent(latent, cfg.model, cfg.data))
            for fmt in cfg.val.formats:
                path = folder / f"prompt{i}.{fmt}"
                (write_gif if fmt == "gif" else write_mp4)(frames, path, fps=cfg.val.fps)
                written.append(path)
            (folder / f"prompt{i}.txt").write_text(labels[i] + "\n")
    return written


def sample_videos(args, cfg, ds: dict, layout, env):
    """The batch's latents [B, C, T, H, W] (every rank), written by rank 0 under args.out; a model of two streams
    (LTX-2): (video latents, audio latents [B, A, C])."""
    from models.diffusion import Objective
    from models.geometry import latent_shape
    from parallel.experiment.manifest import STREAM_KEYS
    from parallel.train.sampling import sample_batch, sampling_model

    from models.registry import family
    from models.sampling import check_sampler

    steps, guidance, sampler, seed = _settings(args, cfg)
    # Two experts (Wan 2.2 A14B): --guidance / val.guidance_scale for the high-noise one, --guidance-2 /
    # val.guidance_scale_2 after.
    guidance = guidance_of(args, cfg, guidance)
    sampler = check_sampler(cfg.model.objective, sampler, family(cfg.model).sampling.samplers)
    stream = family(cfg.model).training_stream(cfg.model, cfg.data)         # LTX-2's audio, or None
    (_, noise_key), (_, text_key) = STREAM_KEYS
    labels, text, uncond = load_prompts(args, cfg, text_key if stream else None)
    noise = _tensor(args.noise) if args.noise else None
    if stream is not None and noise is not None:
        noise = (noise, _tensor(args.noise, key=noise_key))
    first, extra = load_first_frames(args, cfg, len(labels))
    shape = (cfg.model.in_channels, *latent_shape(cfg.model, cfg.data))
    checkpoint = None if cfg.model.init_from else args.checkpoint
    with sampling_model(cfg, ds, layout, env, args.ema, checkpoint) as (forward, ctx):
        rescale = getattr(stream, "guidance_rescale", 0.0) if args.guidance_rescale is None else args.guidance_rescale
        latents = sample_batch(forward, ctx, Objective.of(cfg.model), text, uncond, noise, shape, seed, steps,
                               sampler, guidance, cfg.val.use_dynamic_cfg, first,
                               family(cfg.model).training_condition(cfg.model, cfg.data), extra,
                               progress=True, stream=stream, guidance_rescale=rescale)
        if ctx.rank == 0:
            decoder = None if stream is not None else args.vae or cfg.val.decoder     # LTX-2: --vae encodes --image
            for path in write_outputs(args.out, latents, labels, cfg, decoder):
                print(f"wrote {path}", flush=True)
    return latents


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    env = read_launch_env()
    try:
        cfg, ds, layout = load_and_check(args.config, args.overrides, args.deepspeed_config, env.world_size,
                                         purpose="sample")
        problems = check_args(args, cfg, layout, ds)
    except ConfigError as e:
        problems = str(e).splitlines()
    if problems:
        return refused(parser().prog, problems)
    sample_videos(args, cfg, ds, layout, env)
    return 0


def cli(argv=None) -> None:
    """The console script (and `python -m`): parallel.experiment.cli.run."""
    run(lambda: main(argv))


if __name__ == "__main__":
    cli()
