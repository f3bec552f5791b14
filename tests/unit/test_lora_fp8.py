"""model.lora.base_dtype: float8_e4m3fn, one process: the frozen base's tensor-parallel linear weights stored as
fp8 + one fp32 scale each (parallel/distributed/layers.py quantise_base, parallel/model/lora.py apply_fp8_base).

* A layer's dequantised weight equals fp8(W / s) s with s = amax|W| / 448 done by hand, bit for bit; its output
  equals x (that weight)^T + b, and differs from the full-precision layer's by no more than e4m3's rounding
  bound (relative 2^-4 a weight, absolute 2^-10 s below the smallest normal 2^-6 s).
* The debug model with an fp8 base predicts what the same model with its weights replaced by the hand
  quantise-dequantise predicts (fp32); adapters stay trainable parameters, the fp8 weights are buffers; a model
  loading its state dict (as a checkpoint resumes) predicts the same, bit for bit.
* base_dtype without LoRA is refused, naming the key and what works.
* A device move, which re-makes the fp8 buffers without attributes, leaves the weight's tp split readable from its
  layer (layers.tp_marks), as the layout-free checkpoint copy reads it.
* The planner's parameter bytes with the fp8 base equal what the built model holds.
"""
import pytest
import torch

from parallel.model.build import build_model
from parallel.check import load_and_check
from parallel.experiment.config import ConfigError, load_config
from parallel.distributed.layers import FP8, ColumnParallelLinear, RowParallelLinear, marked_buffers, tp_marks
from parallel.distributed.topology import ParallelContext
from parallel.model.lora import apply_fp8_base, tp_linears

FP8_ARGS = ["model.lora.rank=4", "model.lora.base_dtype=float8_e4m3fn"]


def reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8(w / s) s in fp32, s), by hand."""
    s = w.abs().max().float() / 448
    return (w.float() / s).to(torch.float8_e4m3fn).float() * s, s


@pytest.mark.parametrize("kind", ["column", "row"])
def test_layer_dequantises_to_the_hand_quantisation_within_e4m3_rounding(kind):
    torch.manual_seed(0)
    ctx = ParallelContext.single()
    layer = ColumnParallelLinear(24, [16, 16], ctx=ctx) if kind == "column" else RowParallelLinear(32, 24, ctx=ctx)
    layer.weight.requires_grad_(False)
    w = layer.weight.detach().clone()
    x = torch.randn(3, 5, layer.in_features)
    with torch.no_grad():
        full = layer(x)
    layer.quantise_base()
    assert layer.weight.dtype == FP8 and layer.weight_scale.dtype == torch.float32
    assert [n for n, _ in layer.named_parameters()] == ["bias"]
    ref, s = reference(w)
    assert layer.weight_scale.item() == s.item()
    assert torch.equal(layer.base_weight(torch.float32), ref)
    with torch.no_grad():
        y = layer(x)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, ref, layer.bias), rtol=1e-6, atol=1e-6)
    bound = x.abs() @ (2.0 ** -4 * w.abs() + 2.0 ** -10 * s).T          # sum_k |x_k| |W_jk - W8_jk| at most
    assert ((y - full).abs() <= bound + 1e-6).all()
    assert (y - full).abs().max() > 0                                   # it did quantise


def test_model_with_fp8_base_predicts_as_its_hand_quantised_weights():
    cfg = load_config("debug", FP8_ARGS)
    torch.manual_seed(1)
    fp8 = build_model(cfg, {}, ParallelContext.single())
    by_hand = build_model(cfg, {}, ParallelContext.single())
    for _, layer in tp_linears(fp8, cfg.model.num_layers):
        if layer.lora_B is not None:
            layer.lora_B.data.normal_()                          # non-zero adapters: they still add
    by_hand.load_state_dict(fp8.state_dict())
    assert apply_fp8_base(fp8, cfg.model) > 0
    quantised = {n: layer for n, layer in tp_linears(fp8, cfg.model.num_layers)}
    for name, layer in tp_linears(by_hand, cfg.model.num_layers):
        layer.weight.data.copy_(reference(layer.weight.detach())[0])
        assert torch.equal(quantised[name].base_weight(torch.float32), layer.weight)
    trainable = {n for n, p in fp8.named_parameters() if p.requires_grad}
    assert trainable == {n for n, p in by_hand.named_parameters() if p.requires_grad} and trainable
    assert all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert {n for n, b in fp8.named_buffers() if b.dtype == FP8} == {f"{n}.weight" for n in quantised}
    m = cfg.model
    latent = torch.randn(2, m.in_channels, (cfg.data.num_frames - 1) // 4 + 1, cfg.data.height // 8,
                         cfg.data.width // 8)
    inputs = (latent, torch.tensor([10, 700]), torch.randn(2, m.max_text_len, m.text_embed_dim))
    with torch.no_grad():
        got = fp8.predict(inputs)
        torch.testing.assert_close(got, by_hand.predict(inputs), rtol=1e-5, atol=1e-5)
    resumed = build_model(cfg, {}, ParallelContext.single())          # a checkpoint's module state: fp8 + scales
    apply_fp8_base(resumed, cfg.model)
    resumed.load_state_dict(fp8.state_dict())
    with torch.no_grad():
        assert torch.equal(resumed.predict(inputs), got)


def test_base_dtype_without_lora_is_refused_naming_the_key_and_what_works():
    with pytest.raises(ConfigError) as e:
        load_and_check("debug", ["model.lora.base_dtype=float8_e4m3fn"], None, 1)
    message = str(e.value)
    assert "model.lora.base_dtype needs LoRA (set model.lora.rank)" in message
    assert "full fine-tuning" in message
    with pytest.raises(ConfigError, match="base_dtype"):
        load_config("debug", ["model.lora.rank=4", "model.lora.base_dtype=float16"])
    load_and_check("debug", FP8_ARGS, None, 1)                                       # no error


@pytest.mark.parametrize("preset", ["debug", "debug-hunyuan"])
def test_planner_counts_the_fp8_base_as_the_built_model_holds_it(preset):
    from parallel.plan.memory import plan_memory
    from parallel.plan.trace import ActivationTracer
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 1}}
    sizes = {}
    for args in (["model.lora.rank=4"], FP8_ARGS):
        cfg = load_config(preset, args)
        model = build_model(cfg, {}, ParallelContext.single())
        apply_fp8_base(model, cfg.model)
        held = sum(p.numel() * 2 for p in model.parameters() if not p.requires_grad)      # bf16 frozen parameters
        held += sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                    if n.endswith(("weight", "weight_scale")))                           # fp8 weights, fp32 scales
        plan = plan_memory(cfg, ds, 1, 80 * 2 ** 30, ActivationTracer(cfg, torch.bfloat16))
        states = plan.worst.lines
        adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert states["parameters"] == held + 2 * adapters, args
        sizes[args[-1]] = states["parameters"]
    assert sizes["model.lora.base_dtype=float8_e4m3fn"] < sizes["model.lora.rank=4"]


@pytest.mark.parametrize("fmt", [["--format", "diffusers", "--merge-lora"], ["--format", "toolkit"]])
def test_an_export_of_the_fp8_base_is_refused_pointing_at_the_adapters(fmt, tmp_path, capsys):
    from parallel.export import main as export_main
    sets = [a for kv in FP8_ARGS for a in ("--set", kv)]
    argv = ["--config", "debug", "--deepspeed-config", "ds_configs/zero1_bf16.json", *sets, *fmt, "--out", str(tmp_path)]
    assert export_main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m parallel.export refused (") and f"\n  - --format {fmt[1]}" in err
    assert "model.lora.base_dtype=float8_e4m3fn" in err
    assert "--format diffusers-lora writes the adapters" in err


@pytest.mark.parametrize("kind", ["column", "row"])
def test_fp8_weight_keeps_its_tp_marks_through_a_device_move(kind):
    """deepspeed.initialize's .to(device) re-makes buffers without their attributes; the layer's record keeps the fp8
    weight's split (layers.tp_marks), which the layout-free copy and the full-tensor gather read."""
    ctx = ParallelContext.single(tp_size=2)
    layer = ColumnParallelLinear(24, [16, 16], ctx=ctx) if kind == "column" else RowParallelLinear([16, 16], 24, ctx=ctx)
    layer.weight.requires_grad_(False)
    want = {"tensor_model_parallel": True, "partition_dim": 0 if kind == "column" else 1, "tp_parts": [8, 8]}
    layer.quantise_base()
    layer.to("meta")                                     # every buffer a new tensor, as a move to the device makes
    assert not hasattr(layer.weight, "partition_dim")
    assert tp_marks(layer, "weight") == want and tp_marks(layer, "weight_scale") == {}
    assert [(n, m) for n, _, m in marked_buffers(layer)] == [("weight_scale", {}), ("weight", want)]
