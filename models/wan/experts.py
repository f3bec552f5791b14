"""Wan 2.2 A14B: two Wan 2.1 14B-shaped transformers, one for high-noise timesteps, one for low (`model.experts`).

diffusers' WanPipeline (0.42) calls `transformer` while t >= boundary_ratio * 1000 and `transformer_2` after;
the toolkit does the same per training sample. With `model.experts.train: both` every stage holds both experts'
weights (`experts.0`: transformer/, high noise; `experts.1`: transformer_2/, low noise) and the stage tuple
carries each sample's expert after the Wan tuple:

    (x, temb, tproj, y, expert [B] int64)          expert = FamilySpec.expert(t) with Expert boundaries
                                                   (round(boundary_ratio * 1000), 0); no gradient

Each sample runs through its expert's stage only (a micro-batch mixing both is split by sample and put back in
order), so a step computes only the experts its samples chose. The idle expert's parameters get a zero gradient
(an exact `+ 0 * w[0]` term on the output), so every layout and ZeRO stage reduces the same tensors. AdamW
would still move them (momentum, weight decay), so the trainer leaves an expert that no sample of the global
batch chose out of the update (parallel/train/optim.py's SkipsIdleExperts): its weights and optimizer states
stay as they were, as in a run of the other expert alone. It learns which from `routed_samples`, the embed
stage's count of the samples it sent to each expert since the trainer last cleared it.
The expert is a function of the sample's timestep, drawn from the step's seed (parallel/train/data.py), so every rank of every layout picks
the same expert for the same sample.

With `train: high_noise` or `low_noise` the model is one plain Wan transformer (its released names unchanged)
and the training timesteps are drawn in that expert's band only (`WanTimesteps`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import torch
from torch import nn

from models.diffusion import NUM_TRAIN_TIMESTEPS, PER_SAMPLE, Objective
from models.spec import Expert, FamilySpec

NAMES = ("high_noise", "low_noise")          # experts.0 = transformer/, experts.1 = transformer_2/


def both(cfg) -> bool:
    """Whether the model holds both experts' weights."""
    return cfg.experts is not None and cfg.experts.train == "both"


def plain(stage: type) -> Callable[..., nn.Module]:
    """A constructor of `stage` that skips its __new__ (which makes the two-expert wrapper): one expert's stage."""
    def build(*args, **kwargs):
        module = object.__new__(stage)
        module.__init__(*args, **kwargs)
        return module
    return build


def boundary(cfg) -> int:
    """The first timestep of the high-noise expert: boundary_ratio x 1000."""
    return round(cfg.experts.boundary_ratio * NUM_TRAIN_TIMESTEPS)


@dataclasses.dataclass(frozen=True)
class Experts:
    """The experts of one model section (the boundary is the config's, not the family's) and FamilySpec's own
    rule choosing among them."""

    experts: tuple[Expert, ...]
    expert = FamilySpec.expert


@functools.lru_cache(maxsize=None)
def experts_at(bound: int) -> Experts:
    return Experts((Expert(NAMES[0], bound), Expert(NAMES[1], 0)))


def expert_of(cfg, t: torch.Tensor) -> torch.Tensor:
    """The expert index (0 high noise, 1 low noise) of model timesteps t (any shape): FamilySpec.expert."""
    return experts_at(boundary(cfg)).expert(t)


class WanTimesteps:
    """Wan's training timesteps: one per sample, uniform over [0, 1000) (PER_SAMPLE); with one expert of an A14B
    model trained alone (model.experts.train high_noise / low_noise), uniform over the integer timesteps whose
    model timestep (shifted under a flow shift, as the model sees it) is in that expert's band."""

    per_token = False

    def draw(self, generator: torch.Generator, latent_shape, model) -> torch.Tensor:
        if model.experts is None or model.experts.train == "both":
            return PER_SAMPLE.draw(generator, latent_shape, model)
        allowed = band(model)
        return allowed[torch.randint(0, len(allowed), (1,), generator=generator)]       # [1]


def band(model) -> torch.Tensor:
    """The integer timesteps [n] whose model timestep falls in model.experts.train's band."""
    t = torch.arange(NUM_TRAIN_TIMESTEPS)
    chosen = expert_of(model, Objective.of(model).model_timesteps(t)) == NAMES.index(model.experts.train)
    return t[chosen]


def _route(modules: Sequence[nn.Module], expert: torch.Tensor, inputs: tuple, first: Callable):
    """Each sample of `inputs` (batch-first tensors) through modules[expert[b]]; the outputs in sample order.
    `first(out)` is the output's tensor that carries the idle experts' zero term."""
    # The planner traces on the meta device (no values): a micro-batch of one expert, what each step's memory is.
    used = [0] if expert.is_meta else sorted(set(expert.tolist()))
    if len(used) == 1:
        out = modules[used[0]](inputs)
    else:
        rows = [(expert == e).nonzero().squeeze(1) for e in used]
        parts = [modules[e](tuple(z.index_select(0, r) for z in inputs)) for e, r in zip(used, rows)]
        order = torch.cat(rows).argsort()
        if isinstance(parts[0], torch.Tensor):
            out = torch.cat(parts)[order]
        else:
            out = tuple(torch.cat(zs)[order] for zs in zip(*parts))
    idle = [p for e, m in enumerate(modules) if e not in used for p in m.parameters() if p.requires_grad]
    if not idle:
        return out
    zero = sum(p.reshape(-1)[0].float() for p in idle) * 0.0          # exact: adds 0, grads of zeros
    if isinstance(out, torch.Tensor):
        return out + zero.to(out.dtype)
    head = first(out)
    return (head + zero.to(head.dtype), *out[1:])


class ExpertEmbed(nn.Module):
    """Both experts' embed stages; (latents, timesteps, text, *image) -> (x, temb, tproj, y, expert)."""

    def __init__(self, stage: type, cfg, grid, ctx=None):
        super().__init__()
        self.cfg = cfg
        self.experts = nn.ModuleList([stage(cfg, grid, ctx) for _ in NAMES])
        self.routed_samples = [0] * len(NAMES)      # samples sent to each expert; the trainer reads and clears it

    def forward(self, inputs):
        expert = expert_of(self.cfg, inputs[1])                                       # (B,)
        if not expert.is_meta:
            for e in expert.tolist():
                self.routed_samples[e] += 1
        return (*_route(self.experts, expert, tuple(inputs), lambda out: out[0]), expert)


class ExpertLayer(nn.Module):
    """Both experts' block i; (x, temb, tproj, y, expert) -> the same, x updated by each sample's expert."""

    def __init__(self, stage: type, cfg, grid, ctx):
        super().__init__()
        self.experts = nn.ModuleList([stage(cfg, grid, ctx) for _ in NAMES])

    @property
    def expert_layers(self) -> tuple[nn.Module, ...]:
        """Each expert's block, whose parts selective recomputation wraps (parallel/model/recompute.py)."""
        return tuple(self.experts)

    def forward(self, inputs):
        *wan, expert = inputs
        return (*_route(self.experts, expert, tuple(wan), lambda out: out[0]), expert)


class ExpertFinal(nn.Module):
    """Both experts' output heads; (x, temb, tproj, y, expert) -> prediction (FinalStage's)."""

    def __init__(self, stage: type, cfg, grid, ctx=None):
        super().__init__()
        self.experts = nn.ModuleList([stage(cfg, grid, ctx) for _ in NAMES])

    def forward(self, inputs):
        *wan, expert = inputs
        return _route(self.experts, expert, tuple(wan), lambda out: out)

    def assemble(self, out: torch.Tensor) -> torch.Tensor:
        return self.experts[0].assemble(out)


def guidance(cfg, guidance_scale: float, guidance_scale_2: float | None):
    """The sampler's guidance (models/sampling.py `sample`): WanPipeline's guidance_scale while the high-noise
    expert samples (t >= the boundary), guidance_scale_2 after; a float when there is one expert or no
    guidance_scale_2 (the pipeline then uses guidance_scale throughout); guidance_scale_2 for one transformer is
    refused."""
    if guidance_scale_2 is None:
        return guidance_scale
    if not both(cfg):
        raise ValueError(f"val.guidance_scale_2={guidance_scale_2}: model {cfg.name} has one transformer (two: "
                         f"model.experts.train both); set val.guidance_scale only (--set val.guidance_scale_2=null)")
    bound = experts_at(boundary(cfg))
    return lambda t: guidance_scale if int(bound.expert(torch.as_tensor(t, dtype=torch.float64))) == 0 \
        else guidance_scale_2
