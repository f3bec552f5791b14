"""The one place that knows device specifics, through DeepSpeed's accelerator abstraction.

`DS_ACCELERATOR` (cuda, npu, cpu, ...) picks the accelerator; auto-detection prefers torch_npu over
CUDA when it imports. Everything else in the toolkit asks here for the device, the communication
backend, bf16 support and memory figures, so the same code runs on CUDA, Ascend NPU and CPU.
"""
from __future__ import annotations

import torch
from deepspeed.accelerator import get_accelerator

# DeepSpeed accelerator name -> the torch.distributed backend that carries its device tensors.
BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo", "xpu": "ccl", "hpu": "hccl", "mps": "gloo"}
# Backends that carry no CPU tensor: a collective on a CPU tensor in a group of only these fails with
# "No backend type associated with device type cpu".
DEVICE_ONLY = {"nccl", "hccl"}
HOST_BACKEND = "gloo"


def name() -> str:
    return get_accelerator().device_name()


def backend_for(device: str) -> str:
    """The process-group backend for an accelerator name: the device's own backend, with gloo beside it for
    CPU tensors where the device's carries none ("cpu:gloo,cuda:nccl", "cpu:gloo,npu:hccl"; plain "gloo"
    on CPU).

    Decided here once for every collective. Host-side agreement passes CPU tensors (a checkpoint's step and
    verdict, CRC lists, the anomaly flag, pickled objects), the model's traffic device tensors; torch routes
    each tensor to the backend of its device type, and every group created later without a backend
    (ParallelContext's, DeepSpeed's) inherits the pair. Only small messages take the gloo side: activations,
    gradients and parameters stay on the device and go through NCCL/HCCL."""
    device_backend = BACKENDS.get(device) or get_accelerator().communication_backend_name()
    return f"cpu:{HOST_BACKEND},{device}:{device_backend}" if device_backend in DEVICE_ONLY else device_backend


def backend() -> str:
    """This process's backend string, for `deepspeed.init_distributed(dist_backend=...)` (see backend_for)."""
    return backend_for(name())


def device_name(local_rank: int = 0) -> str:
    """'cuda:3', 'npu:3', or 'cpu' (one CPU device whatever the local rank)."""
    return "cpu" if name() == "cpu" else get_accelerator().device_name(local_rank)


def device(local_rank: int = 0) -> torch.device:
    return torch.device(device_name(local_rank))


def current_device() -> torch.device:
    """The device this process computes on ('cuda:3' after set_device(3); 'cpu')."""
    return torch.device("cpu" if name() == "cpu" else get_accelerator().current_device_name())


def device_count() -> int:
    """Devices on this node; 1 for the CPU accelerator (launch CPU runs with an explicit --nproc)."""
    return 1 if name() == "cpu" else int(get_accelerator().device_count())


def set_device(local_rank: int) -> None:
    if name() != "cpu":
        get_accelerator().set_device(local_rank)


def is_bf16_supported() -> bool:
    return bool(get_accelerator().is_bf16_supported())


def is_fp16_supported() -> bool:
    return bool(get_accelerator().is_fp16_supported())


def free_memory(local_rank: int = 0) -> int | None:
    """Bytes free on the device now (the device module's mem_get_info: torch.cuda, torch.npu); None on CPU and on an
    accelerator without the call."""
    module = getattr(torch, name(), None)
    if name() == "cpu" or not hasattr(module, "mem_get_info"):
        return None
    return int(module.mem_get_info(local_rank)[0])


def compute_capability(local_rank: int = 0) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device (9.0 H100/H200, 8.9 L40S/RTX 4090, 8.0 A100): what decides float8 tensor
    cores (train.float8); None on any other accelerator, which has no such number."""
    if name() != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(local_rank)
    return int(major), int(minor)


def synchronize() -> None:
    get_accelerator().synchronize()


def rng_state() -> torch.Tensor | None:
    """The current device's default generator state (a CPU uint8 tensor); None on CPU, whose generator is torch's
    own (torch.get_rng_state)."""
    return None if name() == "cpu" else get_accelerator().get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    """Set the current device's default generator to `state` (rng_state's); nothing on CPU."""
    if name() != "cpu":
        get_accelerator().set_rng_state(state)


def profiler_activities() -> list:
    """The torch.profiler activities that time this device: CPU, plus CUDA on CUDA (device kernel times).
    On NPU (and any other device) CPU only: torch_npu has its own profiler (torch_npu.profiler), which
    torch.profiler's activities cannot ask for, so the times are host-side (launch) times there."""
    from torch.profiler import ProfilerActivity, supported_activities
    activities = [ProfilerActivity.CPU]
    if name() == "cuda" and ProfilerActivity.CUDA in supported_activities():
        activities.append(ProfilerActivity.CUDA)
    return activities


def total_memory(local_rank: int = 0) -> int:
    """Bytes of memory on this device (host RAM on CPU, shared by the node's ranks)."""
    if name() == "cpu":
        import psutil
        return int(psutil.virtual_memory().total)
    return int(get_accelerator().total_memory(local_rank))


def peak_allocated() -> int | None:
    """The allocator's peak bytes on this device; None on CPU, which has no device allocator to ask."""
    return None if name() == "cpu" else int(get_accelerator().max_memory_allocated())


def peak_reserved() -> int | None:
    """The caching allocator's peak reserved bytes (what a cap_memory limit counts: allocated plus cached blocks);
    None on CPU."""
    return None if name() == "cpu" else int(get_accelerator().max_memory_reserved())


def cap_memory(limit: int, local_rank: int = 0) -> bool:
    """Limit this process's allocator on its device to `limit` bytes, as a smaller card would (bench/capped.py runs a
    24 GiB plan on an 80 GB card): the fraction limit / total_memory that the device module's
    set_per_process_memory_fraction takes (torch.cuda; torch.npu and torch.xpu have it too; DeepSpeed's accelerator
    only for MPS). Past it an allocation fails with out-of-memory after the cache is freed, counting reserved
    bytes (peak_reserved), not only allocated ones. True when capped; False, and nothing changed, on CPU (the host
    has no per-process allocator limit) or a device module without the call."""
    if name() == "cpu":
        return False
    setter = getattr(getattr(torch, name(), None), "set_per_process_memory_fraction", None)
    if setter is None:
        return False
    total = total_memory(local_rank)
    if not 0 < limit <= total:
        raise ValueError(f"a memory cap of {limit:,} bytes on a {name()} device of {total:,}: give 1 to {total:,}")
    setter(limit / total, local_rank)
    return True


def release_memory() -> None:
    """Collect what reference cycles hold (a DeepSpeed engine's) and return the allocator's cached blocks to the
    device, so that what comes next is measured alone; nothing on CPU but the collection."""
    import gc
    gc.collect()
    if name() != "cpu":
        get_accelerator().empty_cache()


def reset_peak_memory() -> None:
    if name() != "cpu":
        get_accelerator().reset_peak_memory_stats()


def memory_stats() -> dict[str, float]:
    """Allocated / peak allocated memory in GiB on this device; host RSS (max) on CPU."""
    if name() == "cpu":
        import resource
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"host_peak_rss_gib": round(peak_kib / 2**20, 3)}
    acc = get_accelerator()
    return {"mem_allocated_gib": round(acc.memory_allocated() / 2**30, 3),
            "mem_peak_gib": round(acc.max_memory_allocated() / 2**30, 3)}


def product_name(local_rank: int = 0) -> str:
    """The device's marketing name ('NVIDIA H100 80GB HBM3', 'Ascend910B2'), as the device module reports it;
    'cpu' on CPU. Used to look up a device's peak FLOP/s (bench/device.py)."""
    if name() == "cpu":
        return "cpu"
    module = getattr(torch, name(), None)            # torch.cuda, torch.npu (torch_npu), torch.xpu
    getter = getattr(module, "get_device_name", None)
    return str(getter(local_rank)) if getter else name()


def side_stream():
    """A stream beside the compute stream for host copies; None on CPU (no streams: copies run in order)."""
    return None if name() == "cpu" else get_accelerator().Stream()


def copy_to_host(t: torch.Tensor, stream) -> torch.Tensor:
    """A host copy of `t`: on an accelerator into pinned memory, queued on `stream` after the work that produced
    `t`, whose device memory the allocator then keeps until the copy is done (record_stream); on CPU a plain
    copy (the host is the device: the caller's storage is released all the same)."""
    if stream is None:
        return t.detach().clone()
    acc = get_accelerator()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    stream.wait_stream(acc.current_stream())
    with acc.stream(stream):
        host.copy_(t.detach(), non_blocking=True)
    t.record_stream(stream)
    return host


def copy_to_device(host: torch.Tensor, device: torch.device, stream, fresh: bool = False
                   ) -> tuple[torch.Tensor, object]:
    """(the device tensor, the event its copy records) of a host tensor (`copy_to_host`'s, `host_copy`'s), queued on
    `stream`; on CPU the host tensor itself, or with `fresh` a copy of it (block swap: the host tensor stays the
    master, each use gets its own storage as on a device), and no event."""
    if stream is None:
        return (host.clone() if fresh else host), None
    acc = get_accelerator()
    out = torch.empty(host.shape, dtype=host.dtype, device=device)     # allocated on the compute stream
    stream.wait_stream(acc.current_stream())
    with acc.stream(stream):
        out.copy_(host, non_blocking=True)
        event = acc.Event()
        event.record(stream)
    out.record_stream(stream)
    return out, event


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` that lives in host memory (block swap's weights): page-locked where the accelerator pins
    memory (what lets `copy_to_device` overlap compute); on CPU a clone, a storage of its own."""
    if name() == "cpu":
        return t.detach().clone()
    return get_accelerator().pin_memory(t.detach().to("cpu"))      # pinning copies: a storage of its own


def is_host_copy(t: torch.Tensor) -> bool:
    """Whether `t` is as `host_copy` leaves it: in host memory, and pinned where the accelerator pins."""
    return t.device.type == "cpu" and (name() == "cpu" or bool(get_accelerator().is_pinned(t)))


def wait_for(event) -> None:
    """The compute stream waits for `event` (a copy_to_device's); None: nothing to wait for."""
    if event is not None:
        get_accelerator().current_stream().wait_event(event)
