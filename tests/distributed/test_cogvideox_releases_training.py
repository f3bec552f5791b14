"""Tiny CogVideoX 1.5 (temporal patches, front-padded frames, slice rotary grid) and 1.5 image-to-video (image
latents on channels with dropout, ofs embedding) train at tp 2 x pp 2 exactly like one process (fp32, 3 steps).
Both variants share one spawn per layout; the conditioning is checked against the I2V pipeline's layout.
"""
import torch

from tests.dist_utils import run_ranks
from tests.train_utils import assert_matches, fp32_config

T2V15 = ["model.patch_size_t=2", "model.patch_bias=false", "model.pos_embed=rope3d"]
I2V15 = T2V15 + ["model.image_condition=true", "model.ofs_embed_dim=32", "model.image_dropout=0.5"]
VARIANTS = {"t2v15": T2V15, "i2v15": I2V15}


def _rank(rank, world_size, tp, pp):
    from tests.train_utils import _train_rank
    return {name: _train_rank(rank, world_size, tp, pp, 1, fp32_config(), 3, tuple(extra), 1, "debug", 0)
            for name, extra in VARIANTS.items()}


def _merged(results, name):
    state = {}
    for r in results:
        state.update(r[name]["state"])
    return {"losses": results[0][name]["losses"], "all_losses": [r[name]["losses"] for r in results],
            "state": state, "slack": results[0][name]["slack"],
            "replica_mismatches": sorted({n for r in results for n in r[name]["replica_mismatches"]})}


def test_15_and_i2v_train_at_tp2_pp2_like_one_process():
    one, four = run_ranks(_rank, 1, 1, 1), run_ranks(_rank, 4, 2, 2)
    for name in VARIANTS:
        assert_matches(_merged(four, name), _merged(one, name))
    assert one[0]["i2v15"]["losses"] != one[0]["t2v15"]["losses"]


def test_the_training_input_is_the_pipelines_image_latents_with_dropout():
    """x_t and [z_img, 0, ..., 0] over the padded frames (1.5, odd VAE frames: as CogVideoXImageToVideoPipeline
    and CogVideo's I2V fine-tuning build them) on channels; the dropped samples' image latents are zeros."""
    from models.registry import family
    from parallel.experiment.config import load_config
    from parallel.distributed.topology import ParallelContext
    from parallel.train.run import training_batches

    cfg = load_config("debug", I2V15 + ["train.micro_batch_size=4", "train.grad_accum_steps=1"])
    batches = training_batches(cfg, ParallelContext.single())
    assert batches.condition is not None and family(cfg.model).training_condition(
        load_config("debug", T2V15).model, cfg.data) is None
    kept = set()
    for step in range(4):
        (x, _, _), target = batches.micro_batch(step, 0)
        assert x.shape == (4, 8, 4, 8, 8) and target.shape == (4, 4, 4, 8, 8)        # 3 VAE frames -> 4
        first = torch.stack([batches.dataset[batches.sample_index(step * 4 + j)][0][:, :1] for j in range(4)])
        image = x[:, 4:]
        for j in range(4):
            keep = not torch.equal(image[j], torch.zeros_like(image[j]))
            kept.add(keep)
            want = torch.cat([first[j], torch.zeros(4, 3, 8, 8)], dim=1) if keep else torch.zeros(4, 4, 8, 8)
            assert torch.equal(image[j], want)
    assert kept == {True, False}                 # image_dropout 0.5 drops some and keeps some
