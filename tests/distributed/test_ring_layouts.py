"""Training under ring attention and Ulysses x ring (parallel.ring_size) against one process: losses and
weights after 3 fp32 steps. CogVideoX with 3D rotary positions at ring 2, ring 4, Ulysses 2 x ring 2, tp 2 x
ring 2 and pp 2 x ring 2 (text tokens join the sequence: 8 text + 48 video = 56 tokens, so at ring 2 the text
sits in the first chunk and each chunk rotates its keys from its own first position); Wan at ring 2, Ulysses
2 x ring 2 and tp 2 x ring 2 (cross-attention to the caption stays local: only the queries are split).

Every rank function of this module runs in one spawn per world size (1, 2 and 4 ranks: the `spawned` fixture).
"""
import pytest

from tests.helpers.sequence_parallel import sp_config
from tests.helpers.validation import _check_reads, _sample_rank, _validate_rank
from tests.train_utils import Run, assert_matches, train_all

ROPE = ("model.pos_embed=rope3d",)
REFERENCES = {"debug rope": ("debug", ROPE), "debug-wan": ("debug-wan", ())}


# (reference, tp, pp, sp, ring)
LAYOUTS = [("debug rope", 1, 1, 2, 2), ("debug rope", 1, 1, 4, 4), ("debug rope", 1, 1, 4, 2),
           ("debug rope", 2, 1, 2, 2), ("debug rope", 1, 2, 2, 2), ("debug-wan", 1, 1, 2, 2), ("debug-wan", 1, 1, 4, 2),
           ("debug-wan", 2, 1, 2, 2)]
RING = [*ROPE, "parallel.ring_size=2"]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """The one-process references and every layout's training; validation and samples at one process and at
    ring 2."""
    folder = tmp_path_factory.mktemp("samples")
    return train_all({
        **{name: Run(1, 1, 1, sp_config(), extra=extra, preset=preset) for name, (preset, extra) in REFERENCES.items()},
        **{layout: Run(tp, pp, 1, sp_config(), sp=sp, extra=(*REFERENCES[ref][1], f"parallel.ring_size={ring}"),
                       preset=REFERENCES[ref][0]) for layout in LAYOUTS for ref, tp, pp, sp, ring in [layout]}}, {
        "validate one": (1, _validate_rank, ([((1, 1, 1), 0)], [*ROPE])),
        "validate ring": (2, _validate_rank, ([((1, 1, 1, 2), 0)], RING)),
        "sample one": (1, _sample_rank, ([((1, 1, 1), 0)], str(folder / "one"), ROPE)),
        "sample ring": (2, _sample_rank, ([((1, 1, 1, 2), 0)], str(folder / "ring"), RING))})


@pytest.mark.parametrize("layout", LAYOUTS,
                         ids=[f"{r.replace(' ', '-')}-tp{t}-pp{p}-ulysses{s // g}-ring{g}" for r, t, p, s, g in LAYOUTS])
def test_ring_layout_matches_one_process(spawned, layout):
    assert_matches(spawned[layout], spawned[layout[0]])


def test_validation_and_samples_under_ring(spawned):
    """Validation losses and sample videos at ring 2 (CogVideoX, rope3d) equal one process's, to fp32 round-off
    (the ring merges its blocks in another order); each validation sample is read once."""
    (one,), by_rank = spawned["validate one"], spawned["validate ring"]
    for r in by_rank:
        assert r[0]["result"].keys() == one[0]["result"].keys()
        for key, value in one[0]["result"].items():
            assert r[0]["result"][key] == pytest.approx(value, rel=1e-5), key
    _check_reads([r[0] for r in by_rank], 7)

    (serial,), under_ring = spawned["sample one"], spawned["sample ring"]
    for i, frames in serial[0].items():
        diff = under_ring[0][0][i].astype(int) - frames.astype(int)
        assert abs(diff).max() <= 1 and (diff != 0).mean() < 0.01, i    # uint8 frames: rounding at most
