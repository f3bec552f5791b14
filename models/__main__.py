"""Print a model's architecture summary and parameter count, built on the meta device (instant for 5B).

    python -m models --config configs/cogvideox-5b.yaml [--set model.num_layers=4 ...]
"""
from __future__ import annotations

import sys

import torch

from models.geometry import latent_shape, token_grid
from models.registry import family
from parallel.model.build import layer_specs
from parallel.experiment.cli import Parser, add_experiment_args, refused
from parallel.experiment.config import ConfigError, load_config
from parallel.distributed.pipeline import SequentialDiT
from parallel.distributed.topology import ParallelContext
from parallel.experiment.units import count_parameters


def summary(cfg) -> str:
    with torch.device("meta"):
        model = SequentialDiT(layer_specs(cfg, ParallelContext.single()))
    m, spec = cfg.model, family(cfg.model)
    words = spec.wording
    t, h, w = token_grid(m, cfg.data)
    lines = [
        f"model: {m.name} ({m.family}), {words.describe_layers(m)}, hidden {m.hidden_size} = {m.num_heads} heads x "
        f"{m.head_dim}, FFN {m.ffn_size}, time embedding {m.time_embed_dim}, positions {m.pos_embed}",
        f"video: {cfg.data.num_frames} x {cfg.data.height} x {cfg.data.width} -> latents "
        f"{'x'.join(map(str, latent_shape(m, cfg.data)))} x {m.in_channels} ch -> {t} x {h} x {w} patches = "
        f"{spec.describe_tokens(m, cfg.data)}",
        f"embed:  {count_parameters(model.embed):>14,d}",
        f"blocks: {count_parameters(model.blocks):>14,d}  "
        f"({count_parameters(model.blocks[0]):,d} per {words.layer_noun})",
        f"final:  {count_parameters(model.final):>14,d}",
        f"parameters: {count_parameters(model)}",
    ]
    experts = [m.experts for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.ModuleList)]
    if experts:       # several transformers trained side by side (Wan 2.2 A14B, model.experts.train both)
        each = [sum(count_parameters(stage[e]) for stage in experts) for e in range(len(experts[0]))]
        lines.append(f"experts: {len(each)}, chosen by timestep; parameters per expert: "
                     + ", ".join(f"experts.{e} {n:,d}" for e, n in enumerate(each)))
    per_token = spec.timesteps.per_token
    per_token = per_token(m) if callable(per_token) else per_token
    if per_token or spec.experts:      # the traits a family may add (models/spec.py)
        experts = ", ".join(f"{e.name} (t >= {e.boundary})" for e in spec.experts)
        lines.append(f"timesteps: {'one per token' if per_token else 'one per sample'}"
                     + (f"; experts by timestep: {experts}" if experts else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = Parser(prog="python -m models", description=__doc__.splitlines()[0])
    add_experiment_args(ap, deepspeed=False)
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        return refused(ap.prog, str(e))
    print(summary(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
