"""The planner with train.offload_activations: `--search` tries it (and ZeRO-3 offload) only when nothing fits and
says so in its "run it" line with the host memory needed; plan mode's DOES NOT FIT names the keys that fit, or
the device count that would; the copy time follows the device profile's host link. With LoRA the same for
train.block_swap (the least that fits, beside offload) and then an fp8 base."""
from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch

from parallel.experiment.config import load_config
from parallel.plan.cli import main
from parallel.plan.search import DEVICES, Device, search
from parallel.plan.trace import ActivationTracer
from tests.train_utils import fp32_config

VIDEO = ["data.num_frames=33", "data.height=128", "data.width=128", "train.micro_batch_size=1"]
# debug at 33 x 128 x 128, micro-batch 1 on one device, no workspace: the least a layout without offload needs is
# 12,348,441 B (ZeRO-0, the JSON's checkpointing), with checkpoint inputs on the host 11,855,078 B (block+host)
BETWEEN = "12.1MB"


def _run(capsys, *extra, memory=BETWEEN):
    status = main(["--config", "debug", "--deepspeed_config", "ds_configs/zero0_fp32.json", "--world-size", "1",
                   "--device-memory", memory, "--workspace", "0GiB", "--format", "json",
                   "--ds-out", os.path.join(tempfile.mkdtemp(), "ds.json"),      # a new file: an existing one is refused
                   "--device-profile", "h100-80gb", *(a for k in VIDEO for a in ("--set", k)), *extra])
    return status, json.loads(capsys.readouterr().out)


def test_search_tries_offload_when_nothing_fits_and_names_its_keys_and_host_memory(capsys):
    status, report = _run(capsys, "--search")
    assert status == 0 and report["offload"] is True
    best = report["ranked"][0]
    assert "train.offload_activations=true" in best["overrides"] and "+host" in best["recompute"]
    assert "--set train.offload_activations=true" in best["command"]
    assert best["host_memory"] > 0 and best["memory"]["total"] <= 12.1e6
    cfg = load_config("debug", VIDEO)
    plain = search(cfg, fp32_config(0, True), 1, 8, 12_100_000, DEVICES["h100-80gb"],
                   ActivationTracer(cfg, torch.float32), workspace=0)
    assert plain.ranked == []


def test_plan_mode_names_the_next_step(capsys):
    status, report = _run(capsys)
    assert status == 2 and report["next_step"]["keys"] == ["train.offload_activations=true"]
    assert report["next_step"]["total"] <= 12.1e6 < report["total"] and report["next_step"]["host_memory"] > 0
    # below the least with offload (11,855,078 B): no key fits one device; two do (ZeRO shards the model states)
    status, report = _run(capsys, memory="11.5MB")
    assert status == 2 and report["next_step"] == {"keys": None, "devices_that_fit": 2}


# debug LoRA (rank 4) at 33 x 128 x 128, micro-batch 1: offload alone needs 5,534,144 B at the least, with block swap 3
# of 4 blocks 5,209,740 B, all 4 4,885,337 B, and all 4 with an fp8 base 4,560,969 B (block+host)
LORA = ("--set", "model.lora.rank=4")


def test_search_tries_block_swap_then_an_fp8_base_and_plan_mode_names_the_swap(capsys):
    status, report = _run(capsys, "--search", *LORA, memory="5.3MB")
    best = report["ranked"][0]
    assert status == 0 and report["offload"] and not report["fp8_base"] and best["recompute"] == "block+host+swap3"
    assert "train.block_swap=3" in best["overrides"] and "--set train.block_swap=3" in best["command"]
    assert best["memory"]["lines"]["block_swap"] > 0 and best["host_memory"] > 0
    status, report = _run(capsys, "--search", *LORA, memory="4.7MB")
    best = report["ranked"][0]
    assert status == 0 and report["fp8_base"] and best["recompute"] == "block+host+swap4+fp8"
    assert {"train.block_swap=4", "model.lora.base_dtype=float8_e4m3fn"} <= set(best["overrides"])
    status, report = _run(capsys, *LORA, memory="5.3MB")            # plan mode: the JSON's checkpointing as given
    assert status == 2 and report["next_step"]["keys"] == ["train.offload_activations=true", "train.block_swap=4"]


def test_swapped_blocks_copy_time_is_what_their_compute_does_not_hide():
    """Each micro-batch copies the swapped bytes up twice, hidden behind the swapped blocks' share of its compute."""
    from parallel.plan.memory import EngineSettings, plan_memory
    from parallel.plan.search import estimate_step_time

    cfg = load_config("debug", [*VIDEO, "model.lora.rank=4", "train.block_swap=3", "train.grad_accum_steps=2"])
    tracer, ds = ActivationTracer(cfg, torch.float32), fp32_config(0, False)
    memory = plan_memory(cfg, ds, 1, 2 ** 40, tracer)
    eng = EngineSettings.from_ds(ds, cfg.model.num_layers)
    device = Device("test", 1e12, 1e12, 1e10, 1e10, 1e6)
    time = estimate_step_time(cfg, eng, 1, device, 8, 0.4, tracer, memory.worst.params, memory)
    swapped = memory.worst.host["block_swap"]
    assert swapped > 0 and memory.worst.host["activations"] == 0
    exposed = 2 * max(2 * swapped / 1e6 - 3 / 4 * time.compute / 2, 0)      # 3 of 4 blocks swapped, 2 micro-batches
    assert exposed > 0 and time.host == pytest.approx(exposed)


@pytest.mark.parametrize("host_bw", [1e6, 1e12])
def test_copy_time_is_what_the_host_link_does_not_hide(host_bw):
    """Each micro-batch's offloaded bytes go down and up once: 2 x bytes / host_bw, less that micro-batch's compute."""
    from parallel.plan.memory import EngineSettings, plan_memory
    from parallel.plan.search import estimate_step_time

    cfg = load_config("debug", [*VIDEO, "train.recompute.granularity=block", "train.offload_activations=true",
                                "train.grad_accum_steps=2"])
    tracer, ds = ActivationTracer(cfg, torch.float32), fp32_config(0, False)
    memory = plan_memory(cfg, ds, 1, 2 ** 40, tracer)
    eng = EngineSettings.from_ds(ds, cfg.model.num_layers)
    device = Device("test", 1e12, 1e12, 1e10, 1e10, host_bw)
    time = estimate_step_time(cfg, eng, 1, device, 8, 0.4, tracer, memory.worst.params, memory)
    per_micro_batch = memory.worst.host["activations"]
    assert per_micro_batch > 0
    assert time.host == pytest.approx(2 * max(2 * per_micro_batch / host_bw - time.compute / 2, 0))
    assert time.total == pytest.approx(time.compute + time.host)
