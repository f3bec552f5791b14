"""Released weights in the diffusers layout against diffusers itself, at tiny random CogVideoX configs, in
4 gloo ranks (the folders, the fixture and the refusals: tests/unit/test_released_weights.py).

Both position variants (sin-cos like 2B, 3D RoPE like 5B, with a non-square sample size so the rotary
grid is a crop) are written by `save_pretrained`, loaded into the toolkit at (tp, pp) = (1, 1), (2, 1),
(1, 2), (2, 2) and run forward: the prediction equals `CogVideoXTransformer3DModel`'s (fp32). Exported
back from tp 2 x pp 2 and from ZeRO-3 (dp 4, through build_trainer), `from_pretrained` gives the
original tensors bit for bit. The CogVideoX 1.5 and image-to-video variants (tests/unit/cogvideox_variants.py:
temporal patches, learned positions, the ofs embedding, image channels) go through the same layouts, and
sequence parallelism (sp 2 x dp 2: the 1.5 temporal patches and the image channels split over sp ranks), and
export in the same spawn.
"""
from pathlib import Path

import torch
from diffusers import CogVideoXTransformer3DModel
from safetensors.torch import load_file

from parallel.experiment.config import load_config
from parallel.weights.diffusers import INDEX_NAME, load_released
from tests.dist_utils import run_ranks
from tests.unit import cogvideox_variants as variants
from tests.helpers.cogvideox_releases import releases15  # noqa: F401  (fixture)
from tests.helpers.released_weights import B, FRAMES, HEAD_DIM, SIZE, overrides, released  # noqa: F401  (fixture)
from tests.helpers.released_weights_layouts import _inputs, diffusers_forward


LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]                # (tp, pp); dp fills the 4 ranks
LAYOUTS15 = [(1, 1, 2)] + [(tp, pp, 1) for tp, pp in LAYOUTS]  # (tp, pp, sp); the last exports


def _layouts_rank(rank, world_size, folders, export_dir, folders15):
    import types

    import deepspeed

    from parallel.distributed import accelerator
    from parallel.model.build import build_model
    from parallel.weights.diffusers_export import export_diffusers
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.validation.validate import StageForward

    deepspeed.init_distributed(dist_backend=accelerator.backend())
    inputs, out = _inputs(), {}
    for pos, folder in folders.items():
        for tp, pp in LAYOUTS:
            cfg = load_config("debug", overrides(pos, folder) + [f"parallel.tp_size={tp}", f"parallel.pp_size={pp}"])
            ctx = ParallelContext.build(ParallelDims(tp_size=tp, pp_size=pp, dp_size=world_size // (tp * pp)))
            model = build_model(cfg, {}, ctx)
            load_released(model, ctx, cfg.model, folder)
            forward = StageForward(types.SimpleNamespace(module=model, device=torch.device("cpu")), ctx)
            out[(pos, tp, pp)] = forward.predict(inputs, inputs[0])
        # Back to the diffusers layout from tp 2 x pp 2; 20 KB shards for the sharded variant.
        export_diffusers(model, ctx, cfg, Path(export_dir) / pos,
                         max_shard_bytes=20_000 if pos == "sincos" else 2**30)
    for variant, folder in folders15.items():
        x = variants.inputs(variant)
        for tp, pp, sp in LAYOUTS15:
            cfg = load_config("debug", variants.overrides(variant, folder) + [
                f"parallel.tp_size={tp}", f"parallel.pp_size={pp}", f"parallel.sp_size={sp}"])
            ctx = ParallelContext.build(ParallelDims(tp_size=tp, pp_size=pp, sp_size=sp,
                                                     dp_size=world_size // (tp * pp * sp)))
            model = build_model(cfg, {}, ctx)
            load_released(model, ctx, cfg.model, folder)
            forward = StageForward(types.SimpleNamespace(module=model, device=torch.device("cpu")), ctx)
            out[(variant, tp, pp, sp)] = forward.predict(x, x[0][:, :variants.C])
        export_diffusers(model, ctx, cfg, Path(export_dir) / variant)
    from parallel import verify                      # the parity command in a layout: tp 2 x pp 2
    out["verify"] = verify.main(["--config", "debug", "--set=parallel.tp_size=2", "--set=parallel.pp_size=2",
                                 *(f"--set={o}" for o in variants.overrides("t2v15", folders15["t2v15"]))])
    out["zero3_partitioned"] = _zero3(world_size, folders["rope3d"], Path(export_dir) / "zero3")
    return out


def _zero3(world_size, folder, export_dir):
    """The training path at dp = 4, ZeRO-3: load before deepspeed.initialize, export gathers."""
    from parallel.train.engine import build_trainer
    from parallel.weights.diffusers_export import export_diffusers
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from tests.train_utils import fp32_config

    cfg = load_config("debug", overrides("rope3d", folder) + ["train.micro_batch_size=1", "train.grad_accum_steps=1"])
    ds = fp32_config(stage=3, checkpointing=False)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0     # partition even tiny tensors
    ctx = ParallelContext.build(ParallelDims(tp_size=1, pp_size=1, dp_size=world_size))
    seed_all(cfg.train.seed)
    trainer = build_trainer(cfg, ds, ctx)
    partitioned = all(p.numel() == 0 for p in trainer.engine.module.parameters())
    export_diffusers(trainer.engine.module, ctx, cfg, export_dir, zero3=True)
    return partitioned


def _same_model(exported, model):
    """`from_pretrained` of the exported folder: the original config and tensors, bit for bit."""
    again = CogVideoXTransformer3DModel.from_pretrained(exported)
    public = lambda config: {k: v for k, v in config.items() if not k.startswith("_")}
    assert public(again.config) == public(model.config)
    original = model.state_dict()
    assert again.state_dict().keys() == original.keys()
    for name, value in again.state_dict().items():
        assert torch.equal(value, original[name]), name


def test_forward_equals_diffusers_in_every_layout_and_export_round_trips(released, releases15, tmp_path):
    """One spawn of 4 ranks: every (tp, pp) layout of all variants, the exports, and ZeRO-3 at dp 4."""
    folders = {pos: str(folder) for pos, (folder, _) in released.items()}
    folders15 = {variant: str(folder) for variant, (folder, _) in releases15.items()}
    results = run_ranks(_layouts_rank, 4, folders, str(tmp_path), folders15)
    for variant, (_, model) in releases15.items():
        want = variants.diffusers_forward(model, *variants.inputs(variant))
        for rank, out in enumerate(results):
            for tp, pp, sp in LAYOUTS15:
                torch.testing.assert_close(out[(variant, tp, pp, sp)], want,
                                           msg=lambda m: f"{variant} tp={tp} pp={pp} sp={sp} rank {rank}: {m}")
        _same_model(tmp_path / variant, model)
    assert [r["verify"] for r in results] == [0] * 4
    inputs = _inputs()
    for pos, (_, model) in released.items():
        want = diffusers_forward(model, pos, *inputs)
        for rank, out in enumerate(results):
            for tp, pp in LAYOUTS:
                torch.testing.assert_close(out[(pos, tp, pp)], want,
                                           msg=lambda m: f"{pos} tp={tp} pp={pp} rank {rank}: {m}")
        exported = tmp_path / pos           # each pipeline stage writes its own shards, 20 KB ones for sincos
        shards = len(list(exported.glob("*.safetensors")))
        assert (exported / INDEX_NAME).is_file() and (shards > 2 if pos == "sincos" else shards == 2)
        _same_model(exported, model)

    # ZeRO-3 (pp = 1, one stage): parameters partitioned after initialize, exported to one file.
    assert [r["zero3_partitioned"] for r in results] == [True] * 4
    exported = load_file(str(tmp_path / "zero3" / "diffusion_pytorch_model.safetensors"))
    original = released["rope3d"][1].state_dict()
    assert exported.keys() == original.keys() and not (tmp_path / "zero3" / INDEX_NAME).exists()
    for name, value in exported.items():
        assert torch.equal(value, original[name]), name
