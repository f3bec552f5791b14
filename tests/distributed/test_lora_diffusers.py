"""LoRA adapters against diffusers + peft, at tiny random CogVideoX configs, in one spawn of 4 gloo ranks.

A random adapter (A and B both non-zero, rank 4, alpha 8) in diffusers' file format on q and v of the
fused QKV, the attention output (row-parallel) and the FFN input (column-parallel) is read through
model.lora.init_from at (tp, pp) = (1, 1) and (2, 2): the toolkit's prediction equals
`CogVideoXTransformer3DModel` with the file loaded by `load_lora_adapter` (peft), fp32. Exported from
tp 2 x pp 2, `--format diffusers-lora` gives the file's tensors bit for bit and loads into diffusers the
same way; `--merge-lora` gives a diffusers folder whose plain prediction is the adapted one.
"""
import copy
from pathlib import Path

import torch
from diffusers import CogVideoXTransformer3DModel
from safetensors import safe_open
from safetensors.torch import save_file

from parallel.config import load_config
from parallel.lora import LORA_WEIGHTS_NAME
from tests.dist_utils import run_ranks
from tests.distributed.test_released_weights_layouts import _inputs, diffusers_forward
from tests.unit.test_released_weights import overrides, released  # noqa: F401  (fixture)

POS, RANK, ALPHA = "sincos", 4, 8.0
TARGETS = ["to_q", "to_v", "to_out.0", "ff.net.0.proj"]
LAYOUTS = [(1, 1), (2, 2)]


def adapter_file(model, folder: Path) -> Path:
    """Random A [r, in] and B [out, r] for every targeted module, with the peft config diffusers writes."""
    from parallel.lora import peft_metadata
    g, tensors = torch.Generator().manual_seed(11), {}
    for name, module in model.named_modules():
        if any(name.endswith("." + t) for t in TARGETS):
            out_f, in_f = module.weight.shape
            tensors[f"transformer.{name}.lora_A.weight"] = torch.randn(RANK, in_f, generator=g) / in_f ** 0.5
            tensors[f"transformer.{name}.lora_B.weight"] = 0.5 * torch.randn(out_f, RANK, generator=g)
    cfg = load_config("debug", _lora(overrides(POS, "unused"), "unused"))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / LORA_WEIGHTS_NAME), metadata=peft_metadata(cfg.model))
    return folder / LORA_WEIGHTS_NAME


def _lora(extra, path) -> list[str]:
    return extra + [f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", f"model.lora.targets={TARGETS}",
                    f"model.lora.init_from={path}"]


def _rank(rank, world_size, folder, lora_path, export_dir):
    import types

    import deepspeed

    from parallel.build import build_model
    from parallel.dist import accelerator
    from parallel.dist.topology import ParallelContext, ParallelDims
    from parallel.lora import load_lora
    from parallel.train.validate import StageForward
    from parallel.weights.diffusers import load_released
    from parallel.weights.diffusers_export import export_diffusers
    from parallel.weights.lora_export import export_lora

    deepspeed.init_distributed(dist_backend=accelerator.backend())
    inputs, out = _inputs(), {}
    for tp, pp in LAYOUTS:
        cfg = load_config("debug", _lora(overrides(POS, folder), lora_path) + [f"parallel.tp_size={tp}",
                                                                               f"parallel.pp_size={pp}"])
        ctx = ParallelContext.build(ParallelDims(tp_size=tp, pp_size=pp, dp_size=world_size // (tp * pp)))
        model = build_model(cfg, {}, ctx)
        load_released(model, ctx, cfg.model, folder)
        load_lora(model, ctx, cfg.model, cfg.model.lora.init_from)
        forward = StageForward(types.SimpleNamespace(module=model, device=torch.device("cpu")), ctx)
        out[(tp, pp)] = forward.predict(inputs, inputs[0])
    export_lora(model, ctx, cfg, Path(export_dir) / "lora")
    export_diffusers(model, ctx, cfg, Path(export_dir) / "merged", merge_lora=True)
    return out


def test_prediction_with_adapters_equals_diffusers_with_peft(released, tmp_path):
    folder, base = released[POS]
    lora_path = adapter_file(base, tmp_path / "given")
    results = run_ranks(_rank, 4, str(folder), str(lora_path), str(tmp_path))
    inputs = _inputs()
    adapted = copy.deepcopy(base)
    adapted.load_lora_adapter(str(lora_path.parent), prefix="transformer", weight_name=LORA_WEIGHTS_NAME)
    want = diffusers_forward(adapted, POS, *inputs)
    assert not torch.allclose(want, diffusers_forward(base, POS, *inputs), atol=1e-3)   # the adapter matters
    for rank, out in enumerate(results):
        for tp, pp in LAYOUTS:
            torch.testing.assert_close(out[(tp, pp)], want, msg=lambda m: f"tp={tp} pp={pp} rank {rank}: {m}")
    # The export from tp 2 x pp 2: the given tensors bit for bit, and diffusers loads it the same way.
    exported = tmp_path / "lora" / LORA_WEIGHTS_NAME
    with safe_open(str(lora_path), "pt") as given, safe_open(str(exported), "pt") as written:
        assert sorted(given.keys()) == sorted(written.keys())
        for key in given.keys():
            assert torch.equal(given.get_tensor(key), written.get_tensor(key)), key
    again = copy.deepcopy(base)
    again.load_lora_adapter(str(exported.parent), prefix="transformer", weight_name=LORA_WEIGHTS_NAME)
    torch.testing.assert_close(diffusers_forward(again, POS, *inputs), want)
    merged = CogVideoXTransformer3DModel.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(diffusers_forward(merged, POS, *inputs), want)
