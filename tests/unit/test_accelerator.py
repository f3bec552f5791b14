"""Device specifics live in parallel/distributed/accelerator.py only; its answers per accelerator name."""
import pathlib
import re

import pytest

from parallel.distributed import accelerator

ROOT = pathlib.Path(__file__).resolve().parents[2]
FORBIDDEN = re.compile(r"\.cuda\(|torch\.cuda\.|[\"']nccl[\"']")


def test_no_device_specifics_outside_the_accelerator_module():
    files = [*ROOT.glob("parallel/**/*.py"), *ROOT.glob("models/**/*.py"), ROOT / "train.py"]
    offenders = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}" for f in files if f.name != "accelerator.py"
                 for n, line in enumerate(f.read_text().splitlines(), 1) if FORBIDDEN.search(line)]
    assert len(files) > 10 and offenders == []


class _Fake:
    def __init__(self, name):
        self.name = name

    def device_name(self, index=None):
        return self.name if index is None else f"{self.name}:{index}"

    def communication_backend_name(self):
        return {"cuda": "nccl", "npu": "hccl"}.get(self.name, "gloo")


@pytest.mark.parametrize("name, backend, device", [("cuda", "cpu:gloo,cuda:nccl", "cuda:3"),
                                                   ("npu", "cpu:gloo,npu:hccl", "npu:3"), ("cpu", "gloo", "cpu")])
def test_backend_and_device_per_accelerator(monkeypatch, name, backend, device):
    monkeypatch.setattr(accelerator, "get_accelerator", lambda: _Fake(name))
    assert accelerator.backend() == backend
    assert accelerator.device_name(3) == device


@pytest.mark.parametrize("name", sorted(accelerator.BACKENDS))
def test_every_backend_carries_cpu_and_device_tensors(name):
    """torch's own reading of the backend string: CPU tensors (host-side agreement) have a backend on every
    accelerator, and the device's tensors go to the device's backend (NCCL/HCCL carry no CPU tensor: on the
    H200 every checkpoint save failed with 'No backend type associated with device type cpu')."""
    from torch.distributed.distributed_c10d import Backend, BackendConfig
    carried = BackendConfig(Backend(accelerator.backend_for(name))).get_device_backend_map()
    assert carried["cpu"] == ("gloo" if accelerator.BACKENDS[name] in accelerator.DEVICE_ONLY
                              else accelerator.BACKENDS[name])
    if name != "cpu":
        assert carried.get(name, carried["cpu"]) == accelerator.BACKENDS[name]


class _Device:
    """A device module's memory-fraction call, recorded."""

    def __init__(self):
        self.calls = []

    def set_per_process_memory_fraction(self, fraction, device):
        self.calls.append((fraction, device))


def test_cap_memory_sets_the_fraction_of_the_device_and_refuses_nothing_on_cpu(monkeypatch):
    assert accelerator.cap_memory(24 * 2**30) is False           # this CPU machine: no allocator to cap
    device = _Device()
    monkeypatch.setattr(accelerator, "get_accelerator", lambda: _Fake("cuda"))
    monkeypatch.setattr(accelerator, "total_memory", lambda local_rank=0: 80 * 2**30)
    monkeypatch.setattr(accelerator.torch, "cuda", device)
    assert accelerator.cap_memory(24 * 2**30, local_rank=1) is True
    assert device.calls == [(0.3, 1)]
    with pytest.raises(ValueError, match="give 1 to 85,899,345,920"):
        accelerator.cap_memory(81 * 2**30)
    monkeypatch.setattr(accelerator.torch, "cuda", object())
    assert accelerator.cap_memory(24 * 2**30) is False           # a device module without the call


def test_free_memory_is_the_device_modules_and_none_on_cpu(monkeypatch):
    assert accelerator.free_memory() is None                     # this CPU machine
    asked = []

    class Cuda:
        def mem_get_info(self, index):
            asked.append(index)
            return 7 * 2**30, 80 * 2**30                          # (free, total), as torch.cuda.mem_get_info

    monkeypatch.setattr(accelerator, "get_accelerator", lambda: _Fake("cuda"))
    monkeypatch.setattr(accelerator.torch, "cuda", Cuda())
    assert accelerator.free_memory(local_rank=3) == 7 * 2**30 and asked == [3]
    monkeypatch.setattr(accelerator.torch, "cuda", object())
    assert accelerator.free_memory() is None                     # a device module without the call
