"""`python -m parallel.sample` in 4 gloo ranks against diffusers' CogVideoXPipeline (fp32).

One spawn runs the command (its `main`, as `deepspeed --module parallel.sample` would) for every case, on a
batch of 2 prompts with guidance 6 from --noise; the latents rank 0 writes equal the pipeline's
(output_type="latent") to fp32 round-off:
- released weights: a tiny random CogVideoXTransformer3DModel saved by diffusers, read with model.init_from
  at tp 2 x pp 2 with the DDIM (2B-like: sin-cos positions, snr shift 3) and the DPM (5B-like: 3D RoPE,
  shift 1) scheduler, and at pp 2 x dp 2 with DPM (the replicas split the rows; each draws the whole
  batch's step noise and keeps its rows);
- a checkpoint: the 2B-like weights trained one step at tp 2 x pp 2 with EmaAdamW and saved; the command
  reads train.output_dir's newest checkpoint (model.init_from=null), and its EMA with --ema; the reference
  pipelines run on `export_diffusers` of the weights and of the EMA;
- image-to-video (tests/unit/test_i2v_sampling.py): the 1.5-I2V-like transformer (ofs, patch_size_t 2, ddim)
  at tp 2 x pp 2 and the 5B-I2V-like one (learned positions, dpm, dynamic CFG) at pp 2 x dp 2, from
  --image-latents, against CogVideoXImageToVideoPipeline.
The one-process commands: tests/unit/test_release_sampling.py, tests/unit/test_i2v_sampling.py.
"""
import json
from pathlib import Path

import torch
from diffusers import CogVideoXTransformer3DModel
from safetensors.torch import load_file

from tests.dist_utils import run_ranks
from tests.train_utils import fp32_config
from tests.helpers import i2v_sampling as i2v
from tests.helpers.release_sampling import CASES, _transformer, batch_files, pipeline_latents, sample_argv

LAYOUTS = [("ddim", 2, 2), ("dpm", 2, 2), ("dpm", 1, 2)]       # (sampler, tp, pp); dp fills the 4 ranks
BATCH_SETS = ["train.micro_batch_size=1", "train.grad_accum_steps=2", "train.lr=0.01"]
I2V_LAYOUTS = [("i2v15", 2, 2), ("i2v5b", 1, 2)]                 # (variant, tp, pp)


def _train_and_save(argv, export_dir):
    """One training step from model.init_from at the argv's layout, a checkpoint, and the exports of the
    weights and the EMA (diffusers folders export_dir/model, export_dir/ema)."""
    import deepspeed

    from parallel.check import load_and_check
    from parallel.distributed import accelerator
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext
    from parallel.sample import parse_args
    from parallel.checkpoints import checkpoint
    from parallel.weights.ema import full_ema
    from parallel.train.engine import build_trainer
    from parallel.train.run import checkpoint_layout, training_batches
    from parallel.weights.diffusers_export import export_diffusers

    args = parse_args(argv)
    cfg, ds, layout = load_and_check(args.config, args.overrides, args.deepspeed_config, 4)
    deepspeed.init_distributed(dist_backend=accelerator.backend())
    ctx = ParallelContext.build(layout.dims)
    seed_all(cfg.train.seed)
    trainer = build_trainer(cfg, ds, ctx)
    trainer.train_step(training_batches(cfg, ctx))
    checkpoint.save(trainer, Path(cfg.ckpt_dir), 1, 1, checkpoint_layout(layout))
    module = trainer.engine.module
    export_diffusers(module, ctx, cfg, Path(export_dir) / "model")
    export_diffusers(module, ctx, cfg, Path(export_dir) / "ema", full_ema(trainer.optimizer, trainer.engine.optimizer))


def _sample_rank(rank, world_size, argvs, train_argv, export_dir):
    from parallel.sample import main

    codes = [main(argv) for argv in argvs[:len(LAYOUTS)]]
    _train_and_save(train_argv, export_dir)
    return codes + [main(argv) for argv in argvs[len(LAYOUTS):]]


def test_sample_command_equals_the_pipeline_in_layouts(tmp_path):
    transformers = {kind: _transformer(pos, tmp_path / kind) for kind, (pos, _) in CASES.items()}
    tensors = batch_files(tmp_path)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(fp32_config(checkpointing=False, optimizer="EmaAdamW")))
    engine = ["--deepspeed_config", str(ds)]
    outs, argvs = {}, []
    for kind, tp, pp in LAYOUTS:
        outs[(kind, tp, pp)] = tmp_path / f"{kind}_tp{tp}_pp{pp}.safetensors"
        argvs.append(sample_argv(kind, tmp_path / kind, tmp_path, outs[(kind, tp, pp)],
                                 [f"parallel.tp_size={tp}", f"parallel.pp_size={pp}"]) + engine)
    run = ["parallel.tp_size=2", "parallel.pp_size=2", f"train.output_dir={tmp_path / 'run'}", *BATCH_SETS]
    train_argv = sample_argv("ddim", tmp_path / "ddim", tmp_path, tmp_path / "unused", run) + engine
    for weights in ("model", "ema"):
        outs[weights] = tmp_path / f"checkpoint_{weights}.safetensors"
        argvs.append(sample_argv("ddim", tmp_path / "ddim", tmp_path, outs[weights], [*run, "model.init_from=null"])
                     + engine + (["--ema"] if weights == "ema" else []))

    want_i2v = {}
    for variant, tp, pp in I2V_LAYOUTS:
        folder = tmp_path / variant
        want_i2v[variant], image = i2v.pipeline_latents(variant, *i2v.write_case(variant, folder), folder)
        outs[variant] = tmp_path / f"{variant}_tp{tp}_pp{pp}.safetensors"
        argvs.append(i2v.sample_argv(variant, folder, outs[variant], i2v.image_latents_file(image, folder),
                                     [f"parallel.tp_size={tp}", f"parallel.pp_size={pp}"]) + engine)

    assert run_ranks(_sample_rank, 4, argvs, train_argv, str(tmp_path / "export")) == [[0] * len(argvs)] * 4

    for variant, tp, pp in I2V_LAYOUTS:
        torch.testing.assert_close(load_file(str(outs[variant]))["latents"], want_i2v[variant],
                                   msg=lambda m: f"{variant} tp={tp} pp={pp}: {m}")

    for kind, transformer in transformers.items():
        want = pipeline_latents(kind, transformer, tensors)
        for (k, tp, pp) in LAYOUTS:
            if k == kind:
                torch.testing.assert_close(load_file(str(outs[(k, tp, pp)]))["latents"], want,
                                           msg=lambda m: f"{kind} tp={tp} pp={pp}: {m}")
    got = {}
    for weights in ("model", "ema"):
        exported = CogVideoXTransformer3DModel.from_pretrained(tmp_path / "export" / weights).eval()
        got[weights] = load_file(str(outs[weights]))["latents"]
        torch.testing.assert_close(got[weights], pipeline_latents("ddim", exported, tensors),
                                   msg=lambda m: f"checkpoint, {weights}: {m}")
    # The step moved the weights: the checkpoint, its EMA and the released weights sample differently.
    released = pipeline_latents("ddim", transformers["ddim"], tensors)
    assert (got["model"] - got["ema"]).abs().max() > 1e-3 and (got["model"] - released).abs().max() > 1e-3
