"""The complex-multiply rotary (models.embeddings.apply_rope_complex) inside a compiled block (train.compile): one
graph, no break, the eager result within fp32 rounding. Its layout check reads x.storage_offset(), which dynamo cannot trace: before
the compiled path skipped it, every rope3d block (CogVideoX-5B's) broke its graph there (bench/peer_release.py at the
mid size: 9 graphs and 7 breaks in one forward of 4 blocks, 2 graphs and none after)."""
import torch

from models.embeddings import apply_rope_complex, rope_complex


def test_rotary_compiles_in_one_graph_on_a_fused_qkv_slice():
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 10, 3 * 4 * 8, generator=g)                   # [B, S, 3 heads dim], fused projections
    k = qkv.unflatten(-1, (3, 4, 8))[:, :, 1].transpose(1, 2)           # [B, heads, S, D]: a strided view
    angles = torch.randn(10, 8, generator=g)
    freqs = rope_complex(angles.cos(), angles.sin())
    compiled = torch.compile(apply_rope_complex, backend="aot_eager", fullgraph=True)   # fullgraph: a break raises
    torch.testing.assert_close(compiled(k, freqs), apply_rope_complex(k, freqs))       # fp32 rounding: 1 ulp
