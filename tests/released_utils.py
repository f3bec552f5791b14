"""What the family tests of released weights share (tests/unit/test_<family>.py, tests/distributed/
test_<family>_layouts.py): a tiny random diffusers release written as model.init_from reads it, the toolkit model
read from it in one process or at one layout (its adapters made non-zero where a test compares them), and the
comparisons of a layout's results with diffusers' (gradients through the released name map, an exported folder
read back bit for bit). Each family's test keeps its own sizes, inputs and expected numbers; only the plumbing
lives here.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from parallel.weights.diffusers import INDEX_NAME


def random_release(cls, seed: int = 0, **config) -> torch.nn.Module:
    """diffusers' `cls(**config)` from torch seed `seed`, in eval mode, every tensor moved by 0.1 x N(0, 1): no norm
    weight, bias, gate or zero-initialised projection is trivial, so a wrong name map or slice changes the output."""
    torch.manual_seed(seed)
    model = cls(**config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def save_release(folder: Path, model: torch.nn.Module, max_shard_size: str) -> tuple[Path, torch.nn.Module]:
    """(folder, model): `model` written by save_pretrained in shards of `max_shard_size` with their index (the
    sharded case of parallel/weights/diffusers.py's reader)."""
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    assert (folder / INDEX_NAME).is_file()
    return folder, model


def read_release(preset: str, overrides: list[str], folder):
    """(cfg, the toolkit model in one process with the release in `folder` read in, the elements read)."""
    from parallel.model.build import layer_specs
    from parallel.experiment.config import load_config
    from parallel.distributed.pipeline import SequentialDiT
    from parallel.distributed.topology import ParallelContext
    from parallel.weights.diffusers import load_released

    cfg = load_config(preset, overrides)
    ours = SequentialDiT(layer_specs(cfg, ParallelContext.single()))
    return cfg, ours, load_released(ours, ParallelContext.single(), cfg.model, folder)


def nonzero_adapters(model: torch.nn.Module, seed: int = 5) -> None:
    """Every adapter's B (zero at the start, as peft starts it) set to 0.2 x N(0, 1) from `seed`, in parameter
    order, so that the adapters change the prediction."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def layout_model(preset: str, overrides: list[str], folder, world_size: int, tp: int = 1, pp: int = 1, sp: int = 1,
                 ring: Optional[int] = None):
    """(cfg, ctx, model) in a spawned rank: `preset` with `overrides` at (tp, pp, sp; ring when given, else the
    preset's), dp filling `world_size`, the release in `folder` read into this rank's part."""
    from parallel.model.build import build_model
    from parallel.experiment.config import load_config
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.weights.diffusers import load_released

    ring_set = [] if ring is None else [f"parallel.ring_size={ring}"]
    cfg = load_config(preset, [*overrides, f"parallel.tp_size={tp}", f"parallel.pp_size={pp}",
                               f"parallel.sp_size={sp}", *ring_set])
    ctx = ParallelContext.build(ParallelDims(tp_size=tp, sp_size=sp, ring_size=ring or 1, pp_size=pp,
                                             dp_size=world_size // (tp * pp * sp)))
    model = build_model(cfg, {}, ctx)
    load_released(model, ctx, cfg.model, folder)
    return cfg, ctx, model


def assert_grads_match(grads: dict, model_cfg, theirs: dict) -> None:
    """The toolkit's full gradients (`grads`, toolkit names: parallel.weights.gather.full_tensors) equal diffusers'
    (`theirs`, by parameter name), each toolkit tensor split into its released ones by the family's name map."""
    from parallel.weights.diffusers_export import to_diffusers

    ours = {}
    for name, grad in grads.items():
        ours.update(to_diffusers(name, grad, model_cfg))
    assert ours.keys() == theirs.keys()
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, msg=lambda m: f"{name}: {m}")


def assert_export_reads_back(exported: Path, model: torch.nn.Module) -> None:
    """A folder export_diffusers wrote from tp 2 x pp 2 (shards of each stage with an index) read by diffusers'
    `from_pretrained` has `model`'s public config and its tensors bit for bit."""
    assert (exported / INDEX_NAME).is_file() and len(list(exported.glob("*.safetensors"))) > 2
    again = type(model).from_pretrained(exported)
    public = lambda config: json.loads(json.dumps({k: v for k, v in config.items() if not k.startswith("_")}))
    assert public(again.config) == public(model.config)
    original = model.state_dict()
    assert again.state_dict().keys() == original.keys()
    for name, value in again.state_dict().items():
        assert torch.equal(value, original[name]), name


def write_release(model: torch.nn.Module, cfg, folder: Path) -> Path:
    """A one-process toolkit model (tp = pp = 1) as the diffusers folder model.init_from reads: each transformer's
    tensors under their released names in one file with its config.json (Wan 2.2 A14B: transformer/ and
    transformer_2/), and the pipeline's model_index.json where the family has one; the adapters are left out, as
    parallel.export writes the base. (export_diffusers writes the same from any layout, in process groups.)"""
    from safetensors.torch import save_file

    from parallel.distributed.topology import ParallelContext
    from parallel.model.lora import is_adapter
    from parallel.weights.diffusers import (CONFIG_NAME, PIPELINE_INDEX, WEIGHTS_NAME, diffusers_config, folders,
                                            pipeline_index, stored_name)
    from parallel.weights.diffusers_export import to_diffusers
    from parallel.weights.gather import full_tensors

    m, subs = cfg.model, folders(cfg.model)
    files: dict[str, dict[str, torch.Tensor]] = {prefix: {} for prefix in subs}
    for name, full in full_tensors(model, ParallelContext.single(), m.num_layers):
        if not is_adapter(name):
            for source, t in to_diffusers(name, full, m).items():
                stored = stored_name(source)
                files[source[:len(source) - len(stored)]][stored] = t.clone()
    for prefix, sub in subs.items():
        out = folder / sub if sub and prefix else folder
        out.mkdir(parents=True, exist_ok=True)
        save_file(files[prefix], str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        (out / CONFIG_NAME).write_text(json.dumps(diffusers_config(m, cfg.data)))
    index = pipeline_index(m)
    if index is not None:
        (folder / PIPELINE_INDEX).write_text(json.dumps(index))
    return folder
