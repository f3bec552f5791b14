"""The model families, by the name `model.family` gives: one line each."""
from __future__ import annotations

from models import cogvideox, hunyuanvideo, stdit, wan
from models.config import ModelConfig
from models.spec import FamilySpec

FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in (
    cogvideox.SPEC,
    hunyuanvideo.SPEC,
    stdit.SPEC,
    wan.SPEC,
)}


def family(model: ModelConfig) -> FamilySpec:
    """The spec of a model section's family."""
    return FAMILIES[model.family]


def sequence_tokens(model: ModelConfig, data) -> int:
    """Tokens of the sequence x per sample (what sequence parallelism splits); see FamilySpec."""
    return family(model).sequence_tokens(model, data)
