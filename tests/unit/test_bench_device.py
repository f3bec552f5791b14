"""bench/device.py's MFU denominator: a device's product name (torch's get_device_name) to its datasheet's dense
bf16 peak, the more specific names first (an H200 NVL is not an H200 SXM)."""
import pytest
import torch

from bench import device


@pytest.mark.parametrize("product, tflops", [("NVIDIA H200", 989), ("NVIDIA H200 NVL", 835), ("NVIDIA H100 80GB HBM3", 989),
                                             ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835),
                                             ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA L40S", 362),
                                             ("Ascend910B3", 313), ("NVIDIA B200", None)])
def test_each_product_gets_its_datasheet_peak(monkeypatch, product, tflops):
    from parallel.distributed import accelerator
    monkeypatch.setattr(accelerator, "product_name", lambda index=0: product)
    found = device.peak_flops(torch.device("meta", 0), torch.bfloat16)
    assert found["name"] == product
    assert found["flops"] == (tflops * 1e12 if tflops else None)
