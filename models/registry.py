"""The model families, by the name `model.family` gives: one line each for the built-in ones.

A family kept outside models/ (a user's, or tests/toy_family/) registers itself at import: its module calls
`register(SPEC)`, and an experiment names the module in its top-level `families:` list (parallel/experiment/config.py
imports them before it reads the `model:` section), so every command and every rank train.py spawns, all
of which load the experiment, know the family.
"""
from __future__ import annotations

import importlib

from models import cogvideox, hunyuanvideo, hunyuanvideo15, ltx2, stdit, wan
from models.config import ModelConfig
from models.spec import FamilySpec

FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in (
    cogvideox.SPEC,
    hunyuanvideo.SPEC,
    hunyuanvideo15.SPEC,
    ltx2.SPEC,
    stdit.SPEC,
    wan.SPEC,
)}


def register(spec: FamilySpec) -> FamilySpec:
    """Add a family (its config's `family` field must default to spec.name). Registering the same spec again
    is a no-op; another spec under a taken name is refused."""
    if not isinstance(spec, FamilySpec):
        raise TypeError(f"register() takes a models.spec.FamilySpec, got {type(spec).__name__}")
    default = spec.config.model_fields["family"].default
    if default != spec.name:
        raise ValueError(f"family {spec.name}: its config {spec.config.__name__} must declare "
                         f"family: Literal[{spec.name!r}] = {spec.name!r} (got {default!r})")
    if FAMILIES.get(spec.name, spec) is not spec:
        raise ValueError(f"a family named {spec.name!r} is already registered; choose another name")
    FAMILIES[spec.name] = spec
    return spec


def import_families(modules: list[str], where: str = "families") -> None:
    """Import each module (dotted name), which registers its families; a module that does not import is named."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ImportError(f"{where}: cannot import {name!r} ({e}); give a module importable from the "
                              f"working directory or PYTHONPATH that calls models.registry.register") from None


def family(model: ModelConfig) -> FamilySpec:
    """The spec of a model section's family."""
    return FAMILIES[model.family]


def sequence_tokens(model: ModelConfig, data) -> int:
    """Tokens of the sequence x per sample (what sequence parallelism splits); see FamilySpec."""
    return family(model).sequence_tokens(model, data)


def ring_frames(model: ModelConfig, data) -> "tuple[int, int] | None":
    """(latent frames, tokens) for a family whose ring attention splits whole frames (its config's RING_FRAMES:
    STDiT, spatial attention within a frame and temporal across frames), else None."""
    if not getattr(type(model), "RING_FRAMES", False):
        return None
    from models.geometry import token_grid
    return token_grid(model, data)[0], sequence_tokens(model, data)


def ring_fits(model: ModelConfig, data, sp: int, ring: int) -> bool:
    """Whether ring attention over `ring` of the sp ranks runs on this model: always for full attention; for a
    ring of whole frames, ring divides the latent frames and sp the tokens (no padding), so that each ring
    chunk is whole frames."""
    frames = ring_frames(model, data)
    return ring == 1 or frames is None or (frames[0] % ring == 0 and frames[1] % sp == 0)


def vae_formats() -> dict:
    """Every registered family's VAE format, by the VAE folder's `_class_name`."""
    return {spec.formats.vae.class_name: spec.formats.vae for spec in FAMILIES.values()}


def text_encoder_formats() -> dict:
    """Every registered family's text-encoder format, by its transformers class name."""
    return {spec.formats.text_encoder.class_name: spec.formats.text_encoder for spec in FAMILIES.values()
            if spec.formats.text_encoder.prepared}
