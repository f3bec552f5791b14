"""The planner under ring attention: Wan 14B at sp 16 on 16 devices (40 heads: Ulysses 8 x ring 2) plans, with the
ring's buffers counted from the traced block input, and its traffic model against the ring's message sizes."""
import json

import pytest

from tests.helpers.plan import cli

WAN_14B_SP16 = ["--config", "configs/wan2.1-t2v-14b.yaml", "--deepspeed_config", "ds_configs/zero3_bf16.json",
                "--set", "parallel.sp_size=16", "--world-size", "16", "--device-memory", "80GiB",
                "--device-profile", "h100-80gb"]


def test_wan_14b_plans_at_sp_16_with_its_ring_buffers(capsys):
    from parallel.plan.memory import ring_buffers

    code, out, _ = cli(capsys, *WAN_14B_SP16, "--format", "json")
    r = json.loads(out)
    assert code == 0 and r["fits"] and (r["layout"]["sp"], r["layout"]["ring"]) == (16, 2)
    block_input = r["activations_per_micro_batch"]["block_input"]      # b x 75,600/16 tokens x 5,120 x bf16
    assert block_input == 75_600 // 16 * 5_120 * 2
    assert r["stages"][0]["lines"]["ring_buffers"] == ring_buffers(block_input, 1, 2, 2) > 0
    code, text, _ = cli(capsys, *WAN_14B_SP16)
    assert "layout: tp=1 sp=16 (ulysses 8 x ring 2) pp=1 dp=1" in text and "ring attention buffers" in text
    code, text, _ = cli(capsys, *WAN_14B_SP16[:4], "--world-size", "8", "--device-memory", "80GiB")
    assert "ring attention buffers" not in text                          # no ring, no line


def test_ring_traffic_counts_the_chunks_each_rank_sends():
    """Forward r - 1 key/value chunks; backward r - 1 again and r fp32 dK/dV accumulators (bf16: twice the bytes)."""
    from parallel.plan.search import ring_traffic

    assert ring_traffic(100, 4, 2) == (3 * 200, 3 * 200 + 4 * 400)
    assert ring_traffic(100, 2, 4) == (200, 200 + 2 * 200)


def test_search_runs_the_sp_sizes_ulysses_cannot_reach_with_a_ring(capsys):
    """Wan 14B's 40 heads on 16 devices, 8 a node: Ulysses alone stops at sp 8 (and at tp 2 at sp 4); the search
    adds ring for the rest (ulysses as large as the heads and the node allow) and charges the ring's traffic that
    the chunks' attention does not hide, over the inter-node link when tp x sp spans nodes."""
    code, out, _ = cli(capsys, *WAN_14B_SP16[:4], "--world-size", "16", "--device-memory", "80GiB", "--device-profile",
                       "h100-80gb", "--search", "--top", "1000", "--format", "json")
    r = json.loads(out)
    rings = [c for c in r["ranked"] + r["not_fitting"] if c["ring"] > 1]
    assert code == 0 and rings
    for c in rings:
        ulysses = c["sp"] // c["ring"]
        assert 40 // c["tp"] % ulysses == 0 and c["tp"] * ulysses <= 8 and f"parallel.ring_size={c['ring']}" in c["overrides"]
        assert c["tp"] * c["sp"] > 8 or 40 // c["tp"] % c["sp"]         # only where Ulysses alone could not
    assert {(c["tp"], c["sp"], c["ring"]) for c in rings} >= {(1, 16, 2), (2, 8, 2)}
    spanning = [c for c in r["ranked"] if c["ring"] > 1 and c["tp"] * c["sp"] > 8 and c["sp"] > c["ring"]]
    assert spanning and all(c["step_time"]["sp"] > 0 for c in spanning)


HUNYUAN_SP16 = ["--config", "configs/hunyuanvideo-t2v.yaml", "--deepspeed_config", "ds_configs/zero3_bf16.json",
                "--set", "parallel.sp_size=16", "--world-size", "16", "--device-memory", "80GiB",
                "--device-profile", "h100-80gb"]


def test_hunyuanvideo_13b_plans_at_sp_16_with_its_ring(capsys):
    """HunyuanVideo's 24 heads take Ulysses 8, not 16: sp 16 is Ulysses 8 x ring 2 (the ring takes its text mask),
    with the ring's buffers from the traced block input (b x 119,056/16 text + video tokens x 3,072 x bf16) and
    ring traffic in the step time (16 ranks span two nodes of 8)."""
    from parallel.plan.memory import ring_buffers

    code, out, _ = cli(capsys, *HUNYUAN_SP16, "--format", "json")
    r = json.loads(out)
    assert code == 0 and r["fits"] and (r["layout"]["sp"], r["layout"]["ring"]) == (16, 2)
    block_input = r["activations_per_micro_batch"]["block_input"]
    assert block_input == (256 + 118_800) // 16 * 3_072 * 2
    assert r["stages"][0]["lines"]["ring_buffers"] == ring_buffers(block_input, 1, 2, 2) > 0
    code, text, _ = cli(capsys, *HUNYUAN_SP16)
    assert "layout: tp=1 sp=16 (ulysses 8 x ring 2) pp=1 dp=1" in text and "ring attention buffers" in text


def test_stdit_step_time_counts_one_ring_attention_a_layer():
    """STDiT's ring holds whole frames: only its temporal attention rings (spatial attention stays in the chunk), so
    the step time charges one ring attention a layer, not its two self-attentions (the bytes counted in a real run:
    tests/distributed/test_ring_families.py). With compute too fast to hide any transfer, the sp time is exactly
    m x L x ((1 + f) forward + backward bytes) / link, f = 0 here."""
    import torch

    from parallel.experiment.config import load_config
    from parallel.plan.memory import EngineSettings
    from parallel.plan.search import Device, estimate_step_time, ring_traffic
    from parallel.plan.trace import ActivationTracer
    from tests.train_utils import fp32_config

    cfg = load_config("debug-stdit", ["data.num_frames=13", "parallel.sp_size=2", "parallel.ring_size=2"])
    tracer = ActivationTracer(cfg, torch.float32)
    eng = EngineSettings.from_ds(fp32_config(0, False), cfg.model.num_layers)
    link = 1e9
    time = estimate_step_time(cfg, eng, 1, Device("instant", 1e30, 1e30, link, link), 8, 1.0, tracer, 0)
    b, m = cfg.train.micro_batch_size, cfg.train.grad_accum_steps
    fwd, bwd = ring_traffic(tracer.trace("block", 1, b, 2).input_bytes, 2, 4)
    assert time.sp == pytest.approx(m * cfg.model.num_layers * (fwd + bwd) / link, rel=1e-9)
