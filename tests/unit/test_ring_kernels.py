"""The per-block kernels ring attention merges (parallel/distributed/ring.py) against autograd through
`F.scaled_dot_product_attention`, and the Ulysses x ring grid (parallel/distributed/topology.py), in one process."""
import pytest
import torch

from parallel.distributed.ring import _cpu_backward, _cpu_forward, _math_backward, _math_forward
from parallel.distributed.topology import ParallelDims


@pytest.mark.parametrize("kernels", [(_math_forward, _math_backward), (_cpu_forward, _cpu_backward)],
                         ids=["math", "cpu-flash"])
def test_block_kernel_matches_autograd(kernels):
    """out and lse against SDPA and logsumexp; the backward given the (merged) out and lse against autograd."""
    fwd, bwd = kernels
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, n, 8, generator=g) for n in (5, 7, 7, 5))
    scale = 8 ** -0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*leaves)
    ref.backward(do)
    out, lse = fwd(q, k, v, scale)
    torch.testing.assert_close(out, ref.detach())
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.transpose(-1, -2) * scale, dim=-1))
    for got, want in zip(bwd(do, q, k, v, out, lse, scale), leaves):
        torch.testing.assert_close(got, want.grad)


def test_ulysses_groups_inside_ring_groups_across():
    """sp 4 = ulysses 2 x ring 2 under tp 2: Ulysses peers are neighbouring sp ranks, ring peers stride over them."""
    dims = ParallelDims(tp_size=2, sp_size=4, ring_size=2)
    assert dims.sp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.ulysses_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert dims.ring_groups() == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert dims.ulysses_size == 2 and dims.as_dict()["ring_size"] == 2
    assert "ring_size" not in ParallelDims(sp_size=4).as_dict()
    with pytest.raises(ValueError, match="ring_size=3 must divide sp_size=4"):
        ParallelDims(sp_size=4, ring_size=3)
