"""Training under ring attention and Ulysses x ring (parallel.ring_size) against one process: losses and
weights after 3 fp32 steps, for CogVideoX with 3D rotary positions (text tokens join the sequence: 8 text +
48 video = 56 tokens, so at ring 2 the text sits in the first chunk and each chunk rotates its keys from its
own first position) and for Wan (cross-attention to the caption stays local: only the queries are split).
"""
import pytest

from tests.distributed.test_sequence_parallel import sp_config
from tests.train_utils import assert_matches, train

ROPE = ("model.pos_embed=rope3d",)
REFERENCES = {"debug rope": ("debug", ROPE), "debug-wan": ("debug-wan", ())}


@pytest.fixture(scope="module")
def references():
    return {name: train(1, 1, 1, sp_config(), extra=extra, preset=preset) for name, (preset, extra) in REFERENCES.items()}


# (reference, tp, pp, sp, ring)
LAYOUTS = [("debug rope", 1, 1, 2, 2), ("debug rope", 1, 1, 4, 2), ("debug rope", 2, 1, 2, 2),
           ("debug rope", 1, 2, 2, 2), ("debug-wan", 1, 1, 2, 2), ("debug-wan", 1, 1, 4, 2)]


@pytest.mark.parametrize("ref, tp, pp, sp, ring", LAYOUTS,
                         ids=[f"{r.replace(' ', '-')}-tp{t}-pp{p}-ulysses{s // g}-ring{g}" for r, t, p, s, g in LAYOUTS])
def test_ring_layout_matches_one_process(references, ref, tp, pp, sp, ring):
    preset, extra = REFERENCES[ref]
    run = train(tp, pp, 1, sp_config(), sp=sp, extra=(*extra, f"parallel.ring_size={ring}"), preset=preset)
    assert_matches(run, references[ref])
