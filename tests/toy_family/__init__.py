"""A fourth model family defined outside models/, registered at import (docs/architecture.md, "Adding a family").

An experiment that names this module under `families:` (tests/toy_family/debug-toy.yaml) is read by every
command and by every rank train.py spawns, each of which imports it and so registers `SPEC`. Its traits: a
timestep per token (`PerToken`) and two experts chosen by timestep (model.py). It trains on the CogVideoX
VAE's latents and T5 embeddings, samples with the DDPM samplers and has no released format (export: the
toolkit's).
"""
from __future__ import annotations

import math

import torch

from models.diffusion import NUM_TRAIN_TIMESTEPS
from models.registry import register
from models.shared.pipeline import T5, CogVideoXLatents
from models.spec import Costs, Expert, FamilySpec, Formats, Network, Sampling, Wording
from tests.toy_family.config import ToyConfig
from tests.toy_family.model import EmbedStage, FinalStage, ToyBlock


class PerToken:
    """A timestep per token, uniform over [0, 1000): drawn on the token grid, repeated over each patch."""

    per_token = True

    @staticmethod
    def draw(generator: torch.Generator, latent_shape, model) -> torch.Tensor:
        _, t, h, w = latent_shape
        pt, p = model.patch_size_t, model.patch_size
        tokens = torch.randint(0, NUM_TRAIN_TIMESTEPS, (1, t // pt, h // p, w // p), generator=generator)
        return tokens.repeat_interleave(pt, 1).repeat_interleave(p, 2).repeat_interleave(p, 3)     # [1, T, H, W]


SPEC = register(FamilySpec(
    name="toy",
    config=ToyConfig,
    network=Network(
        embed=EmbedStage,
        layer=ToyBlock,
        final=FinalStage,
        recompute_parts={"attention": ("core",), "mlp": ("mlp",)},
    ),
    costs=Costs(
        text_in_sequence=False,
        row_parallel_per_layer=3,                # self-attention, cross-attention, the experts' MLP
        attention_pairs=lambda m, grid: math.prod(grid) ** 2 + math.prod(grid) * m.max_text_len,
    ),
    wording=Wording(describe_layers=lambda m: f"{m.num_layers} blocks (2 timestep experts in each MLP)"),
    formats=Formats(vae=CogVideoXLatents(), text_encoder=T5, released=None),
    timesteps=PerToken(),
    sampling=Sampling(samplers={"v_prediction": ("ddim", "dpm"), "flow_matching": ("euler", "flow_euler")},
                      scheduler=None),
    experts=(Expert("high_noise", 500), Expert("low_noise", 0)),
))
