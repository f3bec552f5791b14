"""Communication compression and compiled blocks before launch: the checker's decisions on
communication_data_type, ZeRO++ and train.compile, and the planner's byte model for ZeRO++."""
import pytest

from parallel.check import DeviceDtypes, check
from parallel.experiment.config import load_config
from parallel.plan.memory import EngineSettings
from parallel.plan.search import QUANT_GROUP, dp_bytes

CPU = DeviceDtypes("cpu", fp16=False, bf16=True, quantizer=False)
GPU = DeviceDtypes("cuda", fp16=True, bf16=True, quantizer=True)
GRADS = 'communication_data_type="bf16"'


def test_communication_data_type():
    cfg = load_config("debug")
    for dtype in ("fp32", "fp16", "bf16"):
        assert check(cfg, {"communication_data_type": dtype}, "c.json", device=CPU)[1] == [], dtype
    assert check(cfg, {"communication_data_type": "int8"}, "c.json")[1] == [
        "c.json: communication_data_type='int8' is refused: DeepSpeed reduces gradients in fp32, fp16, bf16; use "
        "one of those or remove it (the training precision)"]


def test_this_machine_has_no_quantizer_kernels():
    """DeepSpeed's CPU accelerator answers QuantizerBuilder with NotImplementedBuilder; initialize then fails
    with 'This op had not been implemented on CPU backend.' (tried: ZeRO-3, 2 gloo ranks, each flag)."""
    assert not DeviceDtypes.here().quantizer


@pytest.mark.parametrize("key", ["zero_quantized_weights", "zero_quantized_nontrainable_weights",
                                 "zero_quantized_gradients"])
def test_zero_plus_plus_quantisation(key):
    cfg = load_config("debug")
    ds = {"zero_optimization": {"stage": 3, key: True}}
    assert check(cfg, ds, "z.json", device=GPU)[1] == []
    assert check(cfg, ds, "z.json", device=CPU)[1] == [
        f"z.json: zero_optimization.{key}=true but the cpu accelerator on this machine has no DeepSpeed quantizer "
        f"kernels (its QuantizerBuilder is not implemented; DeepSpeed has them for CUDA and Ascend NPUs): run it "
        f"there, or remove it and use {GRADS} (half of fp32's gradient bytes on any device)"]
    assert check(cfg, {"zero_optimization": {"stage": 2, key: True}}, "z.json", device=GPU)[1] == [
        f"z.json: zero_optimization.{key}=True with zero_optimization.stage=2 is refused: ZeRO++ works on ZeRO-3's "
        f"parameter all-gathers only (DeepSpeed ignores it below); use stage 3, or {GRADS} to halve gradient traffic"]
    assert check(cfg, {"zero_optimization": {"stage": 2, key: False}}, "z.json", device=CPU)[1] == []


def test_zero_plus_plus_hierarchical_partition():
    """hpz trains on this machine (ZeRO-3, 2 gloo ranks, zero_hpz_partition_size=2: the fp32 run's losses)."""
    cfg = load_config("debug")
    assert check(cfg, {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, "z.json", device=CPU)[1] == []
    assert check(cfg, {"zero_optimization": {"stage": 1, "zero_hpz_partition_size": 1}}, "z.json")[1] == []
    assert "zero_optimization.zero_hpz_partition_size=2 with zero_optimization.stage=1 is refused" in \
        check(cfg, {"zero_optimization": {"stage": 1, "zero_hpz_partition_size": 2}}, "z.json")[1][0]


def test_dp_bytes_model():
    """Tensor bytes per step for 1,000,000 weights: bf16 training, fp32 gradients in communication, ZeRO++'s int8
    weights and int4 gradients with an fp32 scale per QUANT_GROUP elements. Derived by hand, not measured: the
    quantised collectives cannot run on this machine (the fp32/bf16 gradient bytes are measured against dp_bytes
    in tests/distributed/test_compile_layouts.py)."""
    def settings(ds):
        return EngineSettings.from_ds({"bf16": {"enabled": True}, **ds}, num_layers=2)
    n = 1_000_000
    int8, int4 = n * (1 + 4 / QUANT_GROUP), n * (0.5 + 4 / QUANT_GROUP)
    assert dp_bytes(settings({"zero_optimization": {"stage": 3}}), n) == (2 * n, 2 * n, 2 * n)
    assert dp_bytes(settings({"communication_data_type": "fp32"}), n)[0] == 4 * n
    zpp = settings({"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                          "zero_quantized_gradients": True, "zero_hpz_partition_size": 8}})
    assert dp_bytes(zpp, n) == (int4, int8, 2 * n) and zpp.hpz == 8


def test_compile_is_refused_where_it_cannot_work(monkeypatch):
    import shutil

    import torch

    cfg = load_config("debug", ["train.compile=true"])
    assert check(cfg, {}, "c.json")[1] == []
    monkeypatch.setattr(torch, "__version__", "2.1.2+cpu")
    assert check(cfg, {}, "c.json")[1] == [
        "train.compile=true needs torch >= 2.5 (regional compilation shares one graph between blocks only from "
        "there); found torch 2.1.2+cpu: upgrade torch or set train.compile=false"]
    monkeypatch.undo()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert check(cfg, {}, "c.json")[1] == [
        "train.compile=true with train.compile_backend=inductor needs a C++ compiler on this CPU host (inductor "
        "generates C++); install g++ or set train.compile_backend=aot_eager"]
    assert check(load_config("debug", ["train.compile=true", "train.compile_backend=aot_eager"]), {}, "c.json")[1] == []
    # on a GPU inductor generates Triton, whose launchers need a C compiler
    monkeypatch.delenv("CC", raising=False)
    assert check(cfg, {}, "c.json", device=GPU)[1] == [
        "train.compile=true with train.compile_backend=inductor needs a C compiler on this host (Triton builds each "
        "kernel's launcher with one: $CC, cc, gcc or clang); install gcc or set train.compile_backend=aot_eager"]
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/gcc" if name == "gcc" else None)
    assert check(cfg, {}, "c.json", device=GPU)[1] == []


def test_compile_with_activation_compression_is_refused_and_the_advice_works():
    """Compression's hooks do not reach inside compiled blocks (measured in test_compile_layouts.py): the two
    together are refused naming both keys, and either setting the message names is accepted."""
    both = ["train.compile=true", "train.compile_backend=aot_eager", "train.activation_compression.dtype=bf16"]
    assert check(load_config("debug", both), {}, "c.json")[1] == [
        "train.activation_compression (dtype bf16) with train.compile=true: compiled blocks save their tensors inside "
        "AOTAutograd, where the compression hooks do not reach; set train.compile=false to compress, or "
        "train.activation_compression=null to compile"]
    for fix in ("train.compile=false", "train.activation_compression=null"):
        assert check(load_config("debug", both + [fix]), {}, "c.json")[1] == [], fix
