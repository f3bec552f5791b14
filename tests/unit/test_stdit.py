"""The STDiT3-style family (`debug-stdit`): which tokens each attention mixes (tp = 2 against tp = 1, and
validation and sampling through a pipeline: tests/distributed/test_stdit_parallel.py)."""
import pytest
import torch

from parallel.experiment.config import load_config
from tests.helpers.stdit import B, H, S, T, W


def _block(temporal: bool):
    from parallel.model.build import layer_specs
    from parallel.distributed.topology import ParallelContext
    layer = layer_specs(load_config("debug-stdit"), ParallelContext.single())[1].build()
    return layer.temporal if temporal else layer.spatial


@pytest.mark.parametrize("temporal", [False, True], ids=["spatial", "temporal"])
def test_block_mixes_only_its_attention_group(temporal):
    """Perturb one token: a spatial block's outputs change exactly on that token's frame, a temporal
    block's exactly on that token's (h, w) position in every frame (the rest is per token)."""
    block = _block(temporal)
    torch.manual_seed(0)
    x, y, t_mlp = torch.randn(B, S, 64), torch.randn(B, 8, 64), torch.randn(B, 6 * 64)
    frame, row, col = 1, 2, 3
    j = (frame * H + row) * W + col
    moved = x.clone()
    moved[0, j] += 1.0
    with torch.no_grad():
        changed = (block(moved, y, t_mlp) != block(x, y, t_mlp)).any(-1)          # (B, S)
    grid = torch.zeros(T, H, W, dtype=torch.bool)
    if temporal:
        grid[:, row, col] = True
    else:
        grid[frame] = True
    assert changed[0].tolist() == grid.flatten().tolist()
    assert not changed[1].any()


def test_temporal_attention_sees_frame_order():
    """Rotary positions over frames: reversing the frames is not equivariant for the temporal block
    (it would be without positions), while the spatial block commutes with any reordering of frames."""
    torch.manual_seed(0)
    x, y, t_mlp = torch.randn(B, S, 64), torch.randn(B, 8, 64), torch.randn(B, 6 * 64)
    flip = lambda z: z.unflatten(1, (T, H * W)).flip(1).flatten(1, 2)
    with torch.no_grad():
        spatial, temporal = _block(False), _block(True)
        torch.testing.assert_close(spatial(flip(x), y, t_mlp), flip(spatial(x, y, t_mlp)))
        assert not torch.allclose(temporal(flip(x), y, t_mlp), flip(temporal(x, y, t_mlp)), atol=1e-4)
