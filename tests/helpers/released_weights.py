"""The helpers and fixtures of tests/unit/test_released_weights.py that other test modules use too: `B`, `FRAMES`,
`HEAD_DIM`, `SIZE`, `overrides`, `released`, `released_model` (a test module imports no other test module)."""

import pytest
from diffusers import CogVideoXTransformer3DModel

from parallel.weights.diffusers import INDEX_NAME
from tests.released_utils import random_release


B, FRAMES, SIZE, HEADS, HEAD_DIM = 2, 3, 8, 2, 16        # latents [B, 4, 3, 8, 8] -> 48 video + 8 text tokens
VARIANTS = {"sincos": {"sample_width": SIZE}, "rope3d": {"sample_width": 12}}   # rope3d: 4x4 grid in a 4x6 base


def overrides(pos: str, folder) -> list[str]:
    return ["model.num_layers=2", f"model.hidden_size={HEADS * HEAD_DIM}", f"model.num_heads={HEADS}",
            f"model.head_dim={HEAD_DIM}", "model.time_embed_dim=24", f"model.pos_embed={pos}",
            f"model.sample_height={SIZE}", f"model.sample_width={VARIANTS[pos]['sample_width']}",
            f"model.init_from={folder}"]


def released_model(pos: str) -> CogVideoXTransformer3DModel:
    return random_release(
        CogVideoXTransformer3DModel, 0 if pos == "sincos" else 1, num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM, in_channels=4, out_channels=4, time_embed_dim=24, text_embed_dim=32,
        num_layers=2, sample_height=SIZE, sample_width=VARIANTS[pos]["sample_width"],
        sample_frames=(FRAMES - 1) * 4 + 1, max_text_seq_length=8, use_rotary_positional_embeddings=pos == "rope3d")


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """{pos: (folder, diffusers model)}; the sin-cos folder in several shards with an index."""
    out = {}
    for pos in VARIANTS:
        folder = tmp_path_factory.mktemp(pos)
        model = released_model(pos)
        model.save_pretrained(folder, max_shard_size="20KB" if pos == "sincos" else "10GB")
        out[pos] = (folder, model)
    assert (out["sincos"][0] / INDEX_NAME).is_file() and not (out["rope3d"][0] / INDEX_NAME).exists()
    return out
