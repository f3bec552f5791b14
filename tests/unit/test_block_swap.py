"""train.block_swap on one process. On CPU the host copy is a storage of its own and each use copies it again (the
code path an accelerator runs, without its stream):

* loss and gradients equal the same LoRA model's without block swap bit for bit (nonzero adapters), without
  recomputation, with attention recompute and offloaded checkpoints, with the JSON's checkpointing (DeepSpeed's
  reentrant checkpoint) and with the fp8 base; a forward and backward copy 2N - 1 blocks and hold at most two
  blocks' copies;
* the planner's parameters line, swapped-copies line, host bytes and (debug) activation line equal what the built
  model holds, measured (debug fp32 and fp8; debug-hunyuan fp8: indexed dual/single-stream blocks with plain
  nn.Linear modulation);
* `.to()` leaves the swapped weights in host memory (converted there), a loaded state dict is what the next step uses;
* the checker refuses block swap without LoRA, under ZeRO-3, beyond a stage's blocks and with train.compile.
"""
from __future__ import annotations

import re
import weakref

import pytest
import torch

from parallel.model.build import apply_block_swap, build_model
from parallel.experiment.config import load_config
from parallel.distributed import block_swap as swap_module
from parallel.distributed.topology import ParallelContext
from parallel.model.lora import apply_fp8_base
from tests.helpers.batches import random_batch
from tests.released_utils import nonzero_adapters
from tests.train_utils import fp32_config

SWAP = 3                                    # of debug's 4 blocks
# name: (experiment keys, JSON activation_checkpointing on)
# (block granularity: tests/distributed/test_offload_parallel.py's tp 2 x pp 2 run)
OPTIONS = {"none": ([], False),
           "attention+host": (["train.recompute.granularity=attention", "train.offload_activations=true"], False),
           "json": ([], True), "fp8": (["model.lora.base_dtype=float8_e4m3fn"], False)}


def _model(preset: str, keys: list[str], swap: int, checkpointing: bool = False):
    import deepspeed

    from parallel.distributed.seed import seed_all
    cfg = load_config(preset, ["train.micro_batch_size=2", "model.lora.rank=4", f"train.block_swap={swap}", *keys])
    seed_all(0)
    model = build_model(cfg, fp32_config(0, checkpointing), ParallelContext.single(),
                        deepspeed.checkpointing.checkpoint if checkpointing else None)
    nonzero_adapters(model)
    apply_fp8_base(model, cfg.model)
    apply_block_swap(model, cfg)
    return cfg, model


class Copies:
    """Every device copy block swap makes: how many, and the most bytes alive at once (weak references)."""

    def __init__(self, monkeypatch):
        self.count, self.alive, self.peak = 0, 0, 0
        copy = swap_module.accelerator.copy_to_device

        def counted(host, device, stream, fresh=False):
            out, event = copy(host, device, stream, fresh)
            if not fresh:                     # train.offload_activations' copies
                return out, event
            self.count += 1
            self.alive += out.untyped_storage().nbytes()
            self.peak = max(self.peak, self.alive)
            weakref.finalize(out, self._freed, out.untyped_storage().nbytes())
            return out, event
        monkeypatch.setattr(swap_module.accelerator, "copy_to_device", counted)

    def _freed(self, nbytes):
        self.alive -= nbytes


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_gradients_equal_without_block_swap_and_two_blocks_at_most_are_on_the_device(name, monkeypatch):
    keys, checkpointing = OPTIONS[name]
    runs, copies = [], None
    for swap in (0, SWAP):
        copies = Copies(monkeypatch)
        cfg, model = _model("debug", keys, swap, checkpointing)
        inputs, target = random_batch(cfg)
        loss = model(inputs, target)
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (loss, grads), (loss_swapped, grads_swapped) = runs
    assert torch.equal(loss, loss_swapped)
    assert grads.keys() == grads_swapped.keys() and len(grads) == 16            # 4 blocks x 2 adapted layers x A, B
    for n, g in grads.items():
        assert torch.equal(grads_swapped[n], g), n
    tensors_a_block = sum(len(swap_module.moved_tensors(layer)) for layer in model.host_swap.units[0])
    assert copies.count == (2 * SWAP - 1) * tensors_a_block          # the last block's copy serves both passes
    assert copies.peak == 2 * swap_module.swappable_bytes(model.blocks[-1])


def _measured(preset: str, keys: list[str], swap: int, monkeypatch) -> dict:
    """One forward and backward of the built model: the device's parameters (every parameter and fp8 buffer that is
    not a host copy), the host copies block swap made, the most bytes of its device copies alive at once, and the
    saved activations (distinct storages an outer saved-tensor hook sees, parameters and buffers skipped)."""
    hosts, saved = [], {}
    host_copy = swap_module.accelerator.host_copy
    monkeypatch.setattr(swap_module.accelerator, "host_copy", lambda t: hosts.append(host_copy(t)) or hosts[-1])
    copies = Copies(monkeypatch)
    cfg, model = _model(preset, keys, swap)
    inputs, target = random_batch(cfg)

    def pack(t):
        saved.setdefault(t.untyped_storage()._cdata, t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(inputs, target)
    loss.backward()
    key = lambda t: t.untyped_storage()._cdata
    host = {key(t): t.untyped_storage().nbytes() for t in hosts}
    fp8_base = [t for m in model.modules() if getattr(m, "weight_scale", None) is not None
                for t in (m.weight, m.weight_scale)]
    held = {key(t): t.untyped_storage().nbytes() for t in (*model.parameters(), *fp8_base)}
    state = {key(t) for t in (*model.parameters(), *model.buffers())}
    return {"cfg": cfg, "host": sum(host.values()), "device": sum(n for k, n in held.items() if k not in host),
            "copies": copies.peak, "activations": sum(t.untyped_storage().nbytes() for k, t in saved.items()
                                                      if k not in state)}


@pytest.mark.parametrize("preset, fp8", [("debug", False), ("debug", True), ("debug-hunyuan", True)])
def test_planned_lines_equal_what_the_model_holds(preset, fp8, monkeypatch):
    """The measured figures (`_measured`) against plan_memory's parameters line, host block_swap, swapped-copies line
    and activation line (torch AdamW: fp32), with block swap and without."""
    from parallel.plan.memory import plan_memory
    from parallel.plan.trace import ActivationTracer
    keys = ["model.lora.base_dtype=float8_e4m3fn"] if fp8 else []
    swapped, plain = _measured(preset, keys, SWAP, monkeypatch), _measured(preset, keys, 0, monkeypatch)
    tracer = ActivationTracer(swapped["cfg"], torch.float32)
    stage, before = (plan_memory(m["cfg"], fp32_config(0, False), 1, 2 ** 40, tracer).stages[0]
                     for m in (swapped, plain))
    print(f"{preset} fp8={fp8}: host {swapped['host']:,} B planned {stage.host['block_swap']:,}; device parameters "
          f"{swapped['device']:,} B planned {stage.lines['parameters']:,} (without swap "
          f"{before.lines['parameters']:,}); copies {swapped['copies']:,} B planned {stage.lines['block_swap']:,}; "
          f"activations {swapped['activations']:,} B planned {stage.lines['activations']:,} (without swap "
          f"{plain['activations']:,} B planned {before.lines['activations']:,})")
    assert stage.host["block_swap"] == swapped["host"] > 0 and plain["host"] == before.host["block_swap"] == 0
    assert stage.lines["parameters"] == swapped["device"] == before.lines["parameters"] - stage.host["block_swap"]
    assert before.lines["parameters"] == plain["device"]
    assert stage.lines["block_swap"] == swapped["copies"] > 0
    # fp8: a swapped block keeps no dequantised copy of its weights. (debug-hunyuan's activations are traced on its
    # first, dual-stream, block for every block, so the plan's stand apart from the measure there, swapped or not.)
    if preset == "debug":
        assert stage.lines["activations"] == swapped["activations"]
        assert before.lines["activations"] == plain["activations"]
        assert (stage.lines["activations"] < before.lines["activations"]) == fp8


def _swapped(model) -> list[torch.Tensor]:
    return [t for layers in model.host_swap.units for layer in layers for _, t in swap_module.moved_tensors(layer)]


def test_to_leaves_swapped_weights_on_the_host_and_a_loaded_state_dict_is_used():
    cfg, model = _model("debug", [], SWAP)
    swapped = _swapped(model)
    before = [t.detach().clone() for t in swapped]
    seen = []                                                        # fn's inputs: (elements, storage address)
    model._apply(lambda t: seen.append((t.numel(), t.untyped_storage().data_ptr())) or t.double())   # as .to() does
    held = {t.untyped_storage().data_ptr() for t in swapped}
    assert sum(n == 0 for n, _ in seen) == len(swapped) and not any(ptr in held for n, ptr in seen if n)
    assert all(t.dtype == torch.float64 and swap_module.accelerator.is_host_copy(t) and torch.equal(t, b.double())
               for t, b in zip(_swapped(model), before))            # converted in host memory, the same tensors
    # a state dict loaded after a step (a resume) is what the next forward uses
    cfg, model = _model("debug", [], SWAP)
    _, reference = _model("debug", [], 0)
    inputs, target = random_batch(cfg)
    model(inputs, target)
    state = {k: v * 1.5 if k.startswith("blocks.3.") and k.endswith("weight") else v
             for k, v in reference.state_dict().items()}
    model.load_state_dict(state)
    reference.load_state_dict(state)
    assert torch.equal(model(inputs, target), reference(inputs, target))


def test_a_bf16_run_pins_its_swapped_weights_once_in_bf16(monkeypatch):
    """With the run's dtype (bf16: build_trainer's swap_dtype) the swapped parameters are pinned in it at once, as
    DeepSpeed's cast (params only) rounds them, and that cast then keeps those very copies: no fp32 pinned copy is
    made, and none lives beside the bf16 ones."""
    from parallel.distributed.seed import seed_all
    from parallel.train.engine import swap_dtype
    bf16 = {"bf16": {"enabled": True}}
    assert swap_dtype(bf16) == torch.bfloat16 and swap_dtype({}) is None
    assert swap_dtype({**bf16, "data_types": {"keep_in_fp32_modules": ["attn"]}}) is None   # DeepSpeed's choice
    pinned = []
    copy = swap_module.accelerator.host_copy
    monkeypatch.setattr(swap_module.accelerator, "host_copy", lambda t: pinned.append(t.dtype) or copy(t))
    cfg = load_config("debug", ["model.lora.rank=4", f"train.block_swap={SWAP}"])
    seed_all(0)
    model = build_model(cfg, fp32_config(0, False), ParallelContext.single(), None)
    from parallel.model.recompute import layers_of
    full = [t.detach().clone() for _, block in layers_of(model, cfg)[-SWAP:]       # fp32, before the swap
            for layer in swap_module.base_layers(block) for _, t in swap_module.moved_tensors(layer)]
    apply_block_swap(model, cfg, swap_dtype(bf16))
    held = _swapped(model)
    assert set(pinned) == {torch.bfloat16} and len(pinned) == len(held)
    assert all(torch.equal(t, f.to(torch.bfloat16)) for t, f in zip(held, full))      # DeepSpeed's rounding
    storages = [t.untyped_storage().data_ptr() for t in held]
    model._apply(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)     # the engine's cast
    assert [t.untyped_storage().data_ptr() for t in _swapped(model)] == storages and len(pinned) == len(held)


@pytest.mark.parametrize("preset, keys, ds, expected", [
    ("debug", [], {}, r"train.block_swap=2 without model.lora: full fine-tuning trains"),
    ("debug", ["model.lora.rank=4"], {"zero_optimization": {"stage": 3}},
     r"with zero_optimization.stage=3 in .*offload_param"),
    ("debug", ["model.lora.rank=4", "parallel.pp_size=2", "train.block_swap=3"], {},
     r"train.block_swap=3 is more than the 2 blocks of a pipeline stage .*2 \+ 2.*train.block_swap=2 or less"),
    ("debug", ["model.lora.rank=4", "train.compile=true"], {}, r"with train.compile=true: .*set train.compile=false"),
    ("debug-wan22", ["model.lora.rank=4"], {}, r"with 2 experts trained .*model.experts.train=high_noise or low_noise"),
])
def test_the_checker_refuses_what_block_swap_cannot_do(preset, keys, ds, expected):
    from parallel.check import check
    from parallel.experiment.host_memory import uses_host
    cfg = load_config(preset, ["train.block_swap=2", *keys])
    problems = check(cfg, ds, "ds.json", world_size=cfg.parallel.pp_size)[1]
    assert any(re.search(expected, p) for p in problems), problems
    ok = load_config("debug", ["train.block_swap=2", "model.lora.rank=4", "parallel.pp_size=2"])
    assert check(ok, {}, "ds.json", world_size=2)[1] == [] and uses_host(ok, {})
