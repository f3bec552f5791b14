"""train.float8: the toolkit's float8 layers against torchao's own Float8Linear (emulated: the same casts on CPU),
the layers it converts, recomputation, and the checker's refusals, each message as a user reads it on CPU."""
import sys

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallel.check import DeviceDtypes, _check_float8, check_torchao, load_and_check
from parallel.distributed.float8 import Float8Matmul
from parallel.distributed.layers import ColumnParallelLinear, RowParallelLinear
from parallel.distributed.topology import ParallelContext
from parallel.experiment.config import ConfigError, load_config

FLOAT8 = ["train.float8=tensorwise", "train.float8_emulate=true"]


def torchao_linear(weight: torch.Tensor, bias: torch.Tensor, emulate: bool = True) -> nn.Module:
    """torchao's Float8Linear (tensorwise; emulated by default) holding copies of `weight` and `bias`."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear
    ref = nn.Linear(weight.shape[1], weight.shape[0], dtype=weight.dtype)
    ref.weight.data.copy_(weight)
    ref.bias.data.copy_(bias)
    ref = convert_to_float8_training(nn.Sequential(ref), config=Float8LinearConfig(emulate=emulate))[0]
    assert isinstance(ref, Float8Linear)
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_the_float8_layer_at_tp1_is_torchaos_float8linear_bitwise(cls, dtype):
    torch.manual_seed(0)
    ours = cls(64, 48, ctx=ParallelContext.single(), dtype=dtype)
    ours.float8 = Float8Matmul.build("tensorwise", emulate=True)
    ref = torchao_linear(ours.weight.detach(), ours.bias.detach())
    x = torch.randn(2, 10, 64, dtype=dtype) * 3
    grad = torch.randn(2, 10, 48, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ours(x1), ref(x2)
    (y1 * grad).sum().backward()
    (y2 * grad).sum().backward()
    exact = dict(rtol=0, atol=0)
    torch.testing.assert_close(y1, y2, **exact)
    torch.testing.assert_close(x1.grad, x2.grad, **exact)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, **exact)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, **exact)
    # and it is float8: the unquantised layer's output is another (by far more than the dtype's round-off)
    plain = nn.functional.linear(x.float(), ours.weight.float(), ours.bias.float())
    assert (y1.float() - plain).abs().max() > 1e-2


def test_a_token_count_off_16_is_padded_in_the_weight_gradient_only():
    """CUDA's torch._scaled_mm needs its inner dimension a multiple of 16: the weight gradient's is the token count,
    so its gemm pads (zeros: the same sums), the other two do not need to. On CPU's _scaled_mm (no emulation) and
    emulated, 2 x 13 tokens give torchao's Float8Linear's numbers (its own config does not pad)."""
    spec = Float8Matmul.build("tensorwise")
    assert [g.pad_inner_dim for g in (spec.mm_config.output, spec.mm_config.grad_input,
                                       spec.mm_config.grad_weight)] == [False, False, True]
    for emulate in (False, True):
        torch.manual_seed(0)
        ours = ColumnParallelLinear(64, 48, ctx=ParallelContext.single(), dtype=torch.bfloat16)
        ours.float8 = Float8Matmul.build("tensorwise", emulate=emulate)
        ref = torchao_linear(ours.weight.detach(), ours.bias.detach(), emulate=emulate)
        x = torch.randn(2, 13, 64, dtype=torch.bfloat16)
        (ours(x) * 2).sum().backward()
        (ref(x) * 2).sum().backward()
        torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=0, atol=0)


def test_a_recomputed_float8_pair_gives_the_same_numbers():
    """Column -> Row under torch's checkpoint: the recomputed forward recomputes the same amaxes, so the gradients are
    those of the pair kept whole, bitwise."""
    ctx, spec = ParallelContext.single(), Float8Matmul.build("tensorwise", emulate=True)
    torch.manual_seed(1)
    up, down = ColumnParallelLinear(32, 64, ctx=ctx), RowParallelLinear(64, 32, ctx=ctx)
    up.float8 = down.float8 = spec
    pair = lambda x: down(torch.nn.functional.gelu(up(x)))
    x = torch.randn(3, 7, 32)
    grads = []
    for run in (pair, lambda x: checkpoint(pair, x, use_reentrant=False)):
        for p in (*up.parameters(), *down.parameters()):
            p.grad = None
        xr = x.clone().requires_grad_()
        run(xr).square().sum().backward()
        grads.append([xr.grad] + [p.grad.clone() for p in (*up.parameters(), *down.parameters())])
    for kept, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, kept, rtol=0, atol=0)


def test_float8_converts_the_blocks_aligned_layers_only():
    from parallel.model.build import build_model
    from parallel.model.float8 import eligible
    model = build_model(load_config("debug", FLOAT8), {}, ParallelContext.single())
    converted, left = model.float8_layers
    assert converted == [f"{i}.{n}" for i in range(4) for n in ("attn.to_qkv", "attn.to_out", "ff_in", "ff_out")]
    assert left == []
    on = sorted(n for n, m in model.named_modules() if getattr(m, "float8", None) is not None)
    assert on == sorted(f"blocks.{n}" for n in converted)      # embed and final stay in the run's precision
    # the rule is the local shard's: 48 outputs are aligned at tp 1, their 24-row shards at tp 2 are not
    for tp, out, aligned in ((1, 48, True), (2, 48, False), (2, 32, True)):
        ctx = ParallelContext.single(tp_size=tp)
        assert eligible(ColumnParallelLinear(64, out, ctx=ctx, device="meta")) == aligned, (tp, out)
        assert eligible(RowParallelLinear(out, 64, ctx=ctx, device="meta")) == aligned, (tp, out)


def test_float8_emulate_alone_is_refused_by_the_config():
    with pytest.raises(ConfigError, match=r"train.float8_emulate=true with train.float8=null emulates nothing; set "
                                          r"--set train.float8=tensorwise"):
        load_config("debug", ["train.float8_emulate=true"])


NPU = DeviceDtypes("npu", True, True)
A100 = DeviceDtypes("cuda", True, True, capability=(8, 0))
H100 = DeviceDtypes("cuda", True, True, capability=(9, 0))
CPU = DeviceDtypes("cpu", False, True, quantizer=False)
EMULATE = "set --set train.float8_emulate=true for a slow emulated check of the same casts"
WORKS = "or run on a CUDA device of compute capability 8.9 or above (H100, H200, L40S, RTX 4090)"


@pytest.mark.parametrize("device, why", [
    (CPU, "train.float8=tensorwise on the cpu accelerator, which has no float8 matmul units"),
    (NPU, "train.float8=tensorwise on the npu accelerator: torchao's float8 gemm (torch._scaled_mm) is CUDA's, Ascend "
          "NPUs have none"),
    (A100, "train.float8=tensorwise on a CUDA device of compute capability 8.0, which has no float8 tensor cores "
           "(torch._scaled_mm needs 8.9+)"),
])
def test_float8_without_emulation_is_refused_by_device_name(device, why):
    cfg = load_config("debug", ["train.float8=tensorwise"])
    assert _check_float8(cfg, device) == [f"{why}; {EMULATE}, {WORKS}"]
    assert _check_float8(cfg, H100) == []
    assert _check_float8(load_config("debug", FLOAT8), device) == []        # emulated: any device


def test_float8_on_this_cpu_is_refused_before_launch_and_emulation_passes():
    with pytest.raises(ConfigError) as refused:
        load_and_check("debug", ["train.float8=tensorwise"], "ds_configs/zero1_bf16.json", 1)
    assert str(refused.value) == (f"train.float8=tensorwise on the cpu accelerator, which has no float8 matmul units; "
                                  f"{EMULATE}, {WORKS}")
    cfg, _, _ = load_and_check("debug", FLOAT8, "ds_configs/zero1_bf16.json", 1)
    assert cfg.train.float8 == "tensorwise" and cfg.train.float8_emulate


def test_float8_with_lora_is_refused_and_with_compile_is_not():
    lora = load_config("debug", FLOAT8 + ["model.lora.rank=4"])
    assert _check_float8(lora, None) == [
        "train.float8=tensorwise with model.lora: LoRA trains adapters beside a frozen base (model.lora.base_dtype=fp8 "
        "already stores that base in float8), and the float8 layers are for full fine-tuning; set train.float8=null "
        "with model.lora, or drop model.lora to train every weight in float8"]
    assert _check_float8(load_config("debug", FLOAT8 + ["train.compile=true"]), None) == []


def test_a_compiled_float8_pair_is_the_eager_one():
    """torch.compile (aot_eager: the same kernels) traces the float8 Function without a graph break; output and
    gradients equal eager's bitwise (tests/distributed/test_float8_layouts.py: the same at tp 2 through train.py)."""
    from torch._dynamo.utils import counters
    ctx, spec = ParallelContext.single(), Float8Matmul.build("tensorwise", emulate=True)
    torch.manual_seed(1)
    up, down = ColumnParallelLinear(32, 64, ctx=ctx), RowParallelLinear(64, 32, ctx=ctx)
    up.float8 = down.float8 = spec

    def pair(x):
        return down(nn.functional.gelu(up(x)))

    torch._dynamo.reset()
    counters.clear()
    results = []
    for fn in (pair, torch.compile(pair, backend="aot_eager")):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2)).requires_grad_()
        y = fn(x)
        y.square().sum().backward()
        results.append((y.detach(), x.grad, up.weight.grad.clone(), down.weight.grad.clone()))
        up.weight.grad = down.weight.grad = None
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    assert not counters["graph_break"]
    torch._dynamo.reset()


def test_a_missing_torchao_is_refused_with_the_install_command(monkeypatch):
    cfg = load_config("debug", FLOAT8)
    assert check_torchao(cfg) == []
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)           # import torchao raises ImportError
    problem, = check_torchao(cfg)
    head, _, tail = problem.partition(" (ModuleNotFoundError: ")
    assert head == "train.float8=tensorwise needs torchao's float8 training, which this environment cannot import"
    assert tail.split("); ", 1)[1] == ("pip install torchao==0.18.0 (the version the toolkit is tested with; also pip "
                                       "install 'video-dit-parallel[float8]'), or set train.float8=null")
