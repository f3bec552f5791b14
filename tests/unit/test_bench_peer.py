"""The benchmark's peer harness (bench/peer.py): at the bench's mid size, the toolkit's model read from the diffusers
model's save_pretrained folder predicts what diffusers predicts on the harness's inputs (each preset of peer.PRESETS:
CogVideoX with diffusers' rotary tables as its pipeline makes them, Wan); the profile's op groups. Timings are never asserted."""
import pytest
import torch

from bench import peer
from bench.profile import group_of


@pytest.mark.parametrize("preset", list(peer.PRESETS))
def test_harness_gives_both_models_the_same_weights_and_inputs(preset):
    pair = peer.build_pair(preset, "mid", torch.device("cpu"), torch.float32)
    with torch.no_grad():
        ours, theirs = pair.run_toolkit(), pair.run_peer()
    assert ours.shape == pair.inputs[0].shape
    torch.testing.assert_close(ours, theirs)


def test_profile_groups_by_op_name():
    assert [group_of(op) for op in ("aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu",
                                    "aten::native_layer_norm_backward", "aten::stack", "aten::cat",
                                    "Optimizer.step#AdamW.step", "aten::_foreach_mul_", "c10d::allreduce_",
                                    "aten::slow_conv3d_forward")] == \
        ["linear layers", "attention", "norms and modulation", "rotary", "copies and layout", "optimizer",
         "optimizer", "communication", "other"]
