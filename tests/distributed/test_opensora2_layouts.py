"""Open-Sora 2.0's switches of the HunyuanVideo family split over 2 gloo ranks, one spawn for every case: at tp 2 and
at sp 2 (8 text + 72 video tokens: one rank holds all the text), the model read from the diffusers folder where the
networks coincide predicts what diffusers predicts, and the model read from Open-Sora's checkpoint (cond_in
included; each rank rewrites the q/k rows and keeps its slice of every fused part) predicts what one process does;
exported back from tp 2 (`python -m parallel.export --format opensora`'s writer) it is that checkpoint byte for byte.
"""
import torch

from parallel.experiment.config import load_config
from tests.dist_utils import run_ranks
from tests.helpers.opensora2 import OPENSORA, checkpoint, coinciding_release, diffusers_prediction, inputs  # noqa: F401

LAYOUTS = [(2, 1), (1, 2)]                                                      # (tp, sp)


def _rank(rank, world_size, folder, path, export_dir):
    import types

    import deepspeed

    from parallel.model.build import build_model
    from parallel.distributed import accelerator
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.validation.validate import StageForward
    from parallel.weights.diffusers import load_released
    from parallel.weights.opensora import export_opensora

    deepspeed.init_distributed(dist_backend=accelerator.backend())
    x, out = inputs(), {}
    for tp, sp in LAYOUTS:
        ctx = ParallelContext.build(ParallelDims(tp_size=tp, sp_size=sp, pp_size=1, dp_size=world_size // (tp * sp)))
        for source, extra in (("diffusers", [f"model.init_from={folder}"]),
                              ("opensora", [f"model.init_from={path}", "model.cond_embed=true"])):
            cfg = load_config("debug-hunyuan", OPENSORA + extra + [f"parallel.tp_size={tp}", f"parallel.sp_size={sp}"])
            model = build_model(cfg, {}, ctx)
            load_released(model, ctx, cfg.model, cfg.model.init_from)
            forward = StageForward(types.SimpleNamespace(module=model, device=torch.device("cpu")), ctx)
            out[(source, tp, sp)] = forward.predict(x, x[0])
        if tp == 2:                                 # python -m parallel.export --format opensora's writer
            export_opensora(model, ctx, cfg, f"{export_dir}/Open_Sora_v2.safetensors")
    return out


def test_opensora2_split(checkpoint, tmp_path):  # noqa: F811
    path, model = checkpoint
    theirs = coinciding_release(tmp_path)
    results = run_ranks(_rank, 2, str(tmp_path), str(path), str(tmp_path / "export"))
    with torch.no_grad():
        one = model.predict(inputs())
    want = diffusers_prediction(theirs)
    for rank, out in enumerate(results):
        for tp, sp in LAYOUTS:
            torch.testing.assert_close(out[("diffusers", tp, sp)], want, msg=lambda m: f"tp {tp} sp {sp} rank {rank}: {m}")
            torch.testing.assert_close(out[("opensora", tp, sp)], one, msg=lambda m: f"tp {tp} sp {sp} rank {rank}: {m}")
    # written back from tp 2 (gathered q/k rows rewritten): the very file it was read from
    assert (tmp_path / "export" / "Open_Sora_v2.safetensors").read_bytes() == path.read_bytes()
