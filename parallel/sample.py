"""Sample videos from a diffusers transformer folder as the release's pipeline does, in one process.

    python -m parallel.sample --config cogvideox-2b --set model.init_from=CogVideoX-2b/transformer \\
        --set data.text_encoder=t5/ --set val.decoder=CogVideoX-2b/vae --prompt "a cat on a wall" --out samples/

The weights are `model.init_from` (a released transformer/ folder, or a checkpoint exported with
`python -m parallel.export --format diffusers`). Sampler, steps, guidance, dynamic CFG, decoder, formats
and fps are the `val:` keys (`--set val.sampler=dpm`, `--steps`); the schedule is `model.schedule`.
Prompts are captions (encoded with data.text_encoder) or `--prompt-embeds` files ([S_txt, D] safetensors);
the unconditional input is `--negative-embeds`, else T5 of "" (data.text_encoder), else data.path's
uncond.safetensors. Prompt i starts from noise drawn from (--seed, i), the generator the dpm sampler continues,
so a latent equals CogVideoXPipeline's given that noise and generator. Writes prompt<i>.{gif,mp4,txt} and
latents.safetensors ({"prompt<i>": [C, T, H, W]}).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from parallel.check import load_and_check
from parallel.config import UNCOND_FILE, ConfigError


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m parallel.sample", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="experiment YAML file or preset name")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, as in train.py (repeatable)")
    ap.add_argument("--prompt", action="append", default=[], help="a caption (needs data.text_encoder); repeatable")
    ap.add_argument("--prompt-embeds", "--prompt_embeds", action="append", default=[], type=Path,
                    help="a T5 embedding file [model.max_text_len, model.text_embed_dim]; repeatable")
    ap.add_argument("--negative-embeds", "--negative_embeds", type=Path, default=None,
                    help="the unconditional embedding file; default: T5 of \"\" or data.path's " + UNCOND_FILE)
    ap.add_argument("--steps", type=int, default=None, help="sampling steps; default val.sample_steps")
    ap.add_argument("--seed", type=int, default=None, help="noise seed; default train.seed")
    ap.add_argument("--out", required=True, type=Path, help="output folder")
    return ap.parse_args(argv)


def check_args(args, cfg) -> list[str]:
    """Every problem with the command line, before a model loads."""
    problems = []
    if not cfg.model.init_from:
        problems.append("model.init_from is not set: give --set model.init_from=<diffusers transformer folder> "
                        "(python -m parallel.export --format diffusers turns a checkpoint into one)")
    if not args.prompt and not args.prompt_embeds:
        problems.append("nothing to sample: give --prompt or --prompt-embeds")
    if args.prompt and not cfg.data.text_encoder:
        problems.append("--prompt needs a T5 encoder: --set data.text_encoder=<folder>, or give --prompt-embeds")
    for path in args.prompt_embeds + ([args.negative_embeds] if args.negative_embeds else []):
        if not path.is_file():
            problems.append(f"{path}: no such embedding file")
    uncond = Path(cfg.data.path) / UNCOND_FILE if cfg.data.path else None
    if cfg.val.guidance_scale != 1 and not args.negative_embeds and not cfg.data.text_encoder \
            and not (uncond and uncond.is_file()):
        problems.append(f"val.guidance_scale={cfg.val.guidance_scale} needs the unconditional embedding: give "
                        f"--negative-embeds, or set data.text_encoder (T5 of \"\"), or data.path with {UNCOND_FILE}")
    if args.steps is not None and not 1 <= args.steps <= 1000:
        problems.append(f"--steps={args.steps}: give a number in [1, 1000]")
    return problems


def _embedding(path: Path):
    from safetensors.torch import load_file
    tensors = load_file(str(path))
    return (tensors["text"] if "text" in tensors else next(iter(tensors.values()))).float()


def sample_videos(args, cfg) -> dict[str, object]:
    """{"prompt<i>": latent [C, T, H, W]} for every prompt, with its files written under args.out."""
    import types

    import torch
    from safetensors.torch import save_file

    from models.diffusion import Objective
    from models.geometry import latent_shape
    from models.sampling import sample
    from parallel.build import build_model
    from parallel.dist.seed import derive_seed
    from parallel.dist.topology import ParallelContext
    from parallel.train.media import load_decoder, write_gif, write_mp4
    from parallel.train.validate import StageForward
    from parallel.weights.diffusers import load_released

    encoder = None
    if cfg.data.text_encoder:
        from models.text_encoder import T5TextEncoder
        encoder = T5TextEncoder(cfg.data.text_encoder, cfg.model.max_text_len, cfg.model.text_embed_dim)
    prompts = [(text, encoder.encode(text).float()) for text in args.prompt] + \
        [(str(path), _embedding(path)) for path in args.prompt_embeds]
    uncond = None
    if cfg.val.guidance_scale != 1:
        uncond = _embedding(args.negative_embeds) if args.negative_embeds else \
            encoder.encode("").float() if encoder else _embedding(Path(cfg.data.path) / UNCOND_FILE)

    ctx = ParallelContext.single()
    model = build_model(cfg, {}, ctx)
    load_released(model, ctx, cfg.model, cfg.model.init_from)
    model.eval()
    forward = StageForward(types.SimpleNamespace(module=model, device=torch.device("cpu")), ctx)
    objective, decode = Objective.of(cfg.model), load_decoder(cfg.val.decoder)
    shape = (1, cfg.model.in_channels, *latent_shape(cfg.model, cfg.data))
    seed = cfg.train.seed if args.seed is None else args.seed
    args.out.mkdir(parents=True, exist_ok=True)
    latents = {}
    for i, (label, text) in enumerate(prompts):
        g = torch.Generator().manual_seed(derive_seed(seed, "sample", i))
        noise = torch.randn(shape, generator=g)

        def predict(x, t, conditional, text=text[None]):
            return forward.predict((x, t, text if conditional else uncond[None]), x)

        latent = sample(predict, noise, objective, args.steps or cfg.val.sample_steps, cfg.val.sampler,
                        cfg.val.guidance_scale, use_dynamic_cfg=cfg.val.use_dynamic_cfg, generator=g)[0]
        latents[f"prompt{i}"] = latent.contiguous()
        frames = decode(latent)
        for fmt in cfg.val.formats:
            path = args.out / f"prompt{i}.{fmt}"
            (write_gif if fmt == "gif" else write_mp4)(frames, path, fps=cfg.val.fps)
            print(f"wrote {path}")
        (args.out / f"prompt{i}.txt").write_text(label + "\n")
    save_file(latents, str(args.out / "latents.safetensors"))
    return latents


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        cfg, _, _ = load_and_check(args.config, args.overrides, None, 1)
        problems = check_args(args, cfg)
    except ConfigError as e:
        problems = str(e).splitlines()
    if problems:
        print("refusing to sample:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 1
    sample_videos(args, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
