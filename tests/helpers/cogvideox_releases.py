"""The helpers and fixtures of tests/unit/test_cogvideox_releases.py that other test modules use too: `releases15`
(a test module imports no other test module)."""

import pytest

from tests.unit.cogvideox_variants import VARIANTS, released_model


@pytest.fixture(scope="module")
def releases15(tmp_path_factory):
    """{variant: (folder, diffusers model)} of the 1.5 and image-to-video variants."""
    out = {}
    for i, variant in enumerate(VARIANTS):
        folder = tmp_path_factory.mktemp(variant)
        model = released_model(variant, seed=10 + i)
        model.save_pretrained(folder)
        out[variant] = (folder, model)
    return out
