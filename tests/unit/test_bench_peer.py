"""The benchmark's peer harness (bench/peer.py): at the bench's mid size, the toolkit's model read from the diffusers
model's save_pretrained folder predicts what diffusers predicts on the harness's inputs (each preset of peer.PRESETS:
CogVideoX with diffusers' rotary tables as its pipeline makes them, Wan); the profile's op groups. Timings are never asserted."""
import pytest
import torch

from bench import peer
from bench.profile import ORDER, group_of, step_table


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


def test_profile_table_of_a_step():
    """step_table with this device's profiler activities (parallel.distributed.accelerator.profiler_activities): a
    step of matmuls lands in "linear layers", and the groups sum to the total."""
    a = torch.randn(128, 128)
    table = step_table(lambda: [a @ a for _ in range(20)], lambda: None, steps=1)
    assert table["linear layers"] > 0
    assert table["linear layers"] >= max(table[g] for g in ORDER)
    assert table["total"] == pytest.approx(sum(table[g] for g in ORDER))
