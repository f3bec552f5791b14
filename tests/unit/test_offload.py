"""train.offload_activations on one process (CPU: the host copy is a plain one, the code path the same as on an
accelerator): gradients equal the same model's without it, bit for bit, for each checkpointing option; each kept
input leaves the device and comes back once; and the planner's device activation line and host bytes equal what
a real fp32 forward of the debug model holds (saved-tensor hooks outside, the copies counted where they are made)."""
from __future__ import annotations

import pytest
import torch

from parallel.experiment.config import load_config
from parallel.distributed import offload as offload_module
from parallel.plan.memory import plan_memory
from parallel.plan.trace import ActivationTracer
from parallel.train.probe import storage_key
from tests.helpers.batches import random_batch
from tests.train_utils import fp32_config

GiB = 2 ** 30
B = 2
# (train.recompute keys, JSON activation_checkpointing on)
OPTIONS = {"block": (["train.recompute.granularity=block"], False),
           "attention": (["train.recompute.granularity=attention"], False),
           "mlp": (["train.recompute.granularity=mlp"], False),
           "every-2": (["train.recompute.granularity=block", "train.recompute.every=2"], False),
           "json": ([], True)}


def _model(cfg, checkpointing: bool):
    import deepspeed

    from parallel.model.build import build_model
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext

    seed_all(0)
    return build_model(cfg, fp32_config(0, checkpointing), ParallelContext.single(),
                       deepspeed.checkpointing.checkpoint if checkpointing else None)


def _config(name: str, offload: bool):
    extra, _ = OPTIONS[name]
    return load_config("debug", [f"train.micro_batch_size={B}", *extra,
                                 f"train.offload_activations={'true' if offload else 'false'}"])


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_gradients_equal_without_offload_and_each_input_returns_once(name, monkeypatch):
    copies = {"to_host": 0, "to_device": 0}
    to_host, to_device = offload_module.accelerator.copy_to_host, offload_module.accelerator.copy_to_device

    def counted_host(t, stream):
        copies["to_host"] += 1
        return to_host(t, stream)

    def counted_device(host, device, stream):
        copies["to_device"] += 1
        return to_device(host, device, stream)
    monkeypatch.setattr(offload_module.accelerator, "copy_to_host", counted_host)
    monkeypatch.setattr(offload_module.accelerator, "copy_to_device", counted_device)
    runs = []
    for offload in (False, True):
        cfg = _config(name, offload)
        model = _model(cfg, OPTIONS[name][1])
        inputs, target = random_batch(cfg, B)
        loss = model(inputs, target)
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), (loss_off, grads_off) = runs
    assert torch.equal(loss, loss_off)
    for n, g in grads.items():
        assert torch.equal(grads_off[n], g), n
    checkpoints = {"every-2": 2, "attention": 3 * 4}.get(name, 4)      # debug: 4 blocks; the core keeps q, k, v
    assert copies == {"to_host": checkpoints, "to_device": checkpoints}


def _measured(cfg, checkpointing: bool, monkeypatch) -> tuple[int, int]:
    """(device, host) bytes after one real forward: distinct storages an outer saved-tensor hook sees (parameters
    and buffers skipped), and the host copies the offload made."""
    host = []
    to_host = offload_module.accelerator.copy_to_host

    def recorded(t, stream):
        out = to_host(t, stream)
        host.append(out)
        return out
    monkeypatch.setattr(offload_module.accelerator, "copy_to_host", recorded)
    model = _model(cfg, checkpointing)
    inputs, target = random_batch(cfg, B)
    seen = {}

    def pack(t):
        seen.setdefault(storage_key(t), t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(inputs, target)
    skip = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
    device = sum(t.untyped_storage().nbytes() for k, t in seen.items() if k not in skip)
    loss.backward()
    return device, sum(t.untyped_storage().nbytes() for t in host)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_planned_device_and_host_bytes_match_a_real_forward(name, monkeypatch):
    tracer = ActivationTracer(load_config("debug"), torch.float32)
    checkpointing = OPTIONS[name][1]
    cfg, plain = _config(name, True), _config(name, False)
    stage = plan_memory(cfg, fp32_config(0, checkpointing), 1, 80 * GiB, tracer).stages[0]
    before = plan_memory(plain, fp32_config(0, checkpointing), 1, 80 * GiB, tracer).stages[0]
    device, host = _measured(cfg, checkpointing, monkeypatch)
    print(f"{name}: device {device:,} B predicted {stage.lines['activations']:,}; host {host:,} B predicted "
          f"{stage.host['activations']:,} (without offload: device {before.lines['activations']:,})")
    assert stage.lines["activations"] == pytest.approx(device, rel=0.05)
    assert stage.host["activations"] == host > 0
    assert stage.lines["activations"] < before.lines["activations"]


def test_a_host_without_the_memory_the_plan_needs_is_refused_before_launch(monkeypatch, tmp_path):
    """train.py's checks (load_and_check with train.py's planner) plan the node's host bytes: two processes a node at tp 2 need twice one's
    host line; one byte less free is refused, naming the key, exactly that much is accepted."""
    from parallel.check import load_and_check
    from parallel.experiment.config import ConfigError
    from parallel.experiment.host_memory import uses_host
    from parallel.plan.memory import run_plan

    keys = ["train.recompute.granularity=block", "train.offload_activations=true", "parallel.tp_size=2",
            f"train.output_dir={tmp_path}"]
    cfg = load_config("debug", keys)
    stage = plan_memory(cfg, {}, 1, 0, ActivationTracer(cfg, torch.float32)).stages[0]
    need = 2 * sum(stage.host.values())
    assert stage.host["activations"] > 0
    for name, value in (("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("parallel.check.host_available", lambda: need - 1)
    with pytest.raises(ConfigError, match=r"2 process\(es\) on this node need .*train.offload_activations=false"):
        load_and_check("debug", keys, None, 2, device_check=True, planner=run_plan)
    monkeypatch.setattr("parallel.check.host_available", lambda: need)
    load_and_check("debug", keys, None, 2, device_check=True, planner=run_plan)
    assert uses_host(cfg, {}) and not uses_host(load_config("debug"), {})
