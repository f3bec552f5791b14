"""The device the benchmark runs on, its precision, and the peak FLOP/s that model FLOP utilisation divides by.

On CPU: fp32 and this machine's measured matmul rate (no published peak fits a shared 2-core VM). On an
accelerator: bf16 (SDPA then picks its flash kernels) and the published dense bf16 peak of the device, looked
up by product name; a device not in the table reports "unknown peak" and no MFU.
"""
from __future__ import annotations

import time

import torch

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from the vendors' datasheets: NVIDIA A100 datasheet (312
# TFLOPS), H100 datasheet (SXM 989.4, PCIe 756, NVL 835), H200 datasheet (SXM 989, NVL 835), L40S datasheet (362), A10 (125),
# Huawei Ascend 910B: ~313 TFLOPS fp16/bf16 as commonly cited from Huawei's Atlas 800T A2 material (approximate).
# Matched in order, first hit wins: a substring of the product name (lower case).
PEAK_BF16 = [("h100 pcie", 756e12), ("h100 nvl", 835e12), ("h100", 989e12), ("h200 nvl", 835e12),
             ("h200", 989e12), ("h800", 989e12),
             ("a100", 312e12), ("a800", 312e12), ("l40s", 362e12), ("a10", 125e12), ("910b", 313e12)]


def device_and_dtype() -> tuple[torch.device, torch.dtype]:
    from parallel.distributed import accelerator
    where = accelerator.device(0)
    return where, torch.float32 if where.type == "cpu" else torch.bfloat16


def matmul_flops(n: int = 1024, seconds: float = 2.0, device="cpu", dtype=torch.float32) -> float:
    """The measured matmul rate (FLOP/s), the best of repeated n x n x n products."""
    from parallel.distributed import accelerator
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        accelerator.synchronize()
        tic = time.perf_counter()
        a @ b
        accelerator.synchronize()
        best = max(best, 2 * n ** 3 / (time.perf_counter() - tic))
    return best


def peak_flops(device: torch.device, dtype: torch.dtype) -> dict:
    """{"name", "flops" (None if unknown), "source"} for the MFU's denominator."""
    from parallel.distributed import accelerator
    if device.type == "cpu":
        return {"name": "cpu", "flops": matmul_flops(), "source": "measured fp32 matmul (1024^3), best of 2 s"}
    product = accelerator.product_name(device.index or 0)
    for key, flops in PEAK_BF16:
        if key in product.lower():
            return {"name": product, "flops": flops, "source": f"datasheet dense bf16 ({key})"}
    return {"name": product, "flops": None, "source": "unknown peak"}
