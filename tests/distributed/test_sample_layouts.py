"""`python -m parallel.sample` in 4 gloo ranks against diffusers' CogVideoXPipeline (fp32), released weights.

One spawn runs the command (its `main`, as `deepspeed --module parallel.sample` would) for every case: a tiny
random CogVideoXTransformer3DModel saved by diffusers, read with model.init_from at tp 2 x pp 2 with the DDIM
(2B-like: sin-cos positions, snr shift 3) and the DPM (5B-like: 3D RoPE, shift 1) scheduler, and at pp 2 x dp 2
with DPM (the replicas split the batch's rows; each draws the whole batch's step noise and keeps its rows).
A batch of 2 prompts with guidance 6 from --noise: the latents written by rank 0 equal the pipeline's
(output_type="latent") to fp32 round-off. The one-process command: tests/unit/test_release_sampling.py.
"""
import torch
from safetensors.torch import load_file

from tests.dist_utils import run_ranks
from tests.unit.test_release_sampling import CASES, _transformer, batch_files, pipeline_latents, sample_argv

DS_CONFIG = "ds_configs/zero0_fp32.json"
LAYOUTS = [("ddim", 2, 2), ("dpm", 2, 2), ("dpm", 1, 2)]       # (sampler, tp, pp); dp fills the 4 ranks


def _sample_rank(rank, world_size, argvs):
    from parallel.sample import main

    return [main(argv) for argv in argvs]


def test_sample_command_equals_the_pipeline_in_layouts(tmp_path):
    transformers = {kind: _transformer(pos, tmp_path / kind) for kind, (pos, _) in CASES.items()}
    tensors = batch_files(tmp_path)
    outs, argvs = {}, []
    for kind, tp, pp in LAYOUTS:
        outs[(kind, tp, pp)] = tmp_path / f"{kind}_tp{tp}_pp{pp}.safetensors"
        argvs.append(sample_argv(kind, tmp_path / kind, tmp_path, outs[(kind, tp, pp)],
                                 [f"parallel.tp_size={tp}", f"parallel.pp_size={pp}"])
                     + ["--deepspeed_config", DS_CONFIG])
    assert run_ranks(_sample_rank, 4, argvs) == [[0] * len(LAYOUTS)] * 4
    for kind, transformer in transformers.items():
        want = pipeline_latents(kind, transformer, tensors)
        for (k, tp, pp), out in outs.items():
            if k == kind:
                torch.testing.assert_close(load_file(str(out))["latents"], want,
                                           msg=lambda m: f"{kind} tp={tp} pp={pp}: {m}")
