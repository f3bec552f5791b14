"""The complex-multiply rotary (models.embeddings.apply_rope_complex) inside a compiled block (train.compile): one
graph, no break, the eager result within fp32 rounding. Its layout check reads x.storage_offset(), which dynamo cannot trace: before
the compiled path skipped it, every rope3d block (CogVideoX-5B's) broke its graph there (bench/peer_release.py at the
mid size: 9 graphs and 7 breaks in one forward of 4 blocks, 2 graphs and none after). Compiled, the rotation is
real pairs (no complex operator for inductor to fall back on), equal to eager's within fp32 rounding."""
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


def test_compiled_rotary_is_real_arithmetic_and_equals_eager_forward_and_backward():
    """Compiled, the rotation runs as real pairs (inductor generates no code for complex multiplies and its
    backward's view_as_complex needs a layout the compiler need not give): inductor's forward and input gradient
    equal eager's complex multiply within fp32 rounding, on a strided head slice of a fused QKV output."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 10, 3 * 4 * 8, generator=g)
    angles = torch.randn(10, 8, generator=g)
    freqs = rope_complex(angles.cos(), angles.sin())
    grad = torch.randn(2, 4, 10, 8, generator=g)
    results = []
    for fn in (apply_rope_complex, torch.compile(apply_rope_complex, backend="inductor", fullgraph=True)):
        x = qkv.clone().requires_grad_()
        k = x.unflatten(-1, (3, 4, 8))[:, :, 1].transpose(1, 2)
        out = fn(k, freqs)
        (out * grad).sum().backward()
        results.append((out.detach(), x.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager)
    # and what dynamo traces holds no complex view of x (the graph a backend is given)
    traced = []

    def record(gm, example_inputs):
        traced.extend(node.target for node in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(apply_rope_complex, backend=record, fullgraph=True)(k.detach(), freqs)
    assert traced and torch.view_as_complex not in traced and torch.view_as_real not in traced, traced
    torch._dynamo.reset()
