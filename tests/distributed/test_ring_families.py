"""Ring attention in the HunyuanVideo family (its joint attention takes the text mask) and the STDiT family (its
ring splits whole frames: spatial attention stays local, temporal attention rings over frames), 4 gloo ranks in
one spawn, the one-process references in another.

- Predictions of the tiny random release (tests/helpers/hunyuanvideo.py's `released` fixture: 8 text + 72 video
  tokens, the second caption's last 3 text rows padding, so masked as keys) at ring 2, ring 4 and Ulysses 2 x
  ring 2 equal diffusers' on every rank.
- Parameter gradients of the sp loss (`SequenceLoss`, averaged over the sp ranks as DeepSpeed does) on those
  masked inputs at ring 2 and Ulysses 2 x ring 2 equal one process's, and the bytes each rank sends round the
  ring in that forward and backward are the planner's count (`ring_traffic` of a b x S/sp x H/tp chunk per
  attention, every block).
- Two training steps at ring 2 x dp 2, at Ulysses 2 x ring 2 with train.recompute.granularity=attention (the
  all-to-alls and the ring's transfers run again inside the recomputed attention core), at tp 2 x ring 2 (the ring
  passes each tp rank's heads) and at pp 2 x ring 2 (each stage rings its own blocks) equal one process's losses
  and weights (synthetic captions have no padding rows: the masked path's gradients are the check above).
- STDiT (`debug-stdit` at 13 frames: 4 latent frames of 4 x 4 patches, 64 tokens) predicts as one process at
  ring 2, ring 4 (one frame a rank) and Ulysses 2 x ring 2, sends round the ring the planner's count for one
  ring attention per layer (the temporal one), and trains two steps at ring 2 x dp 2, Ulysses 2 x ring 2, tp 2 x
  ring 2 and pp 2 x ring 2 to one process's losses and weights.
"""
import torch

from parallel.experiment.config import load_config
from parallel.distributed.sequence import padded_length
from parallel.plan.search import ring_traffic
from tests.dist_utils import run_ranks
from tests.helpers.hunyuanvideo_layouts import hunyuan_fp32_config
from tests.train_utils import assert_matches
from tests.helpers.hunyuanvideo import B, TEXT, diffusers_forward, inputs, overrides, released  # noqa: F401

VIDEO, HIDDEN, LAYERS = 72, 64, 4                          # the release's tokens, width and blocks
PREDICT = [(2, 2), (4, 4), (4, 2)]                       # (sp, ring); dp fills 4 ranks
GRADS = [(2, 2), (4, 2)]
RECOMPUTE = ("train.recompute.granularity=attention",)
FRAMES = ("data.num_frames=13",)                       # 4 latent frames: ring 2 and 4 hold whole frames
TRAIN = {"hunyuan ring2-dp2": ("debug-hunyuan", 1, 1, 2, 2, ()),             # (preset, tp, pp, sp, ring, extra)
         "hunyuan ulysses2-ring2-recompute": ("debug-hunyuan", 1, 1, 4, 2, RECOMPUTE),
         "hunyuan tp2-ring2": ("debug-hunyuan", 2, 1, 2, 2, ()),
         "hunyuan pp2-ring2": ("debug-hunyuan", 1, 2, 2, 2, ()),
         "stdit ring2-dp2": ("debug-stdit", 1, 1, 2, 2, FRAMES),
         "stdit ulysses2-ring2": ("debug-stdit", 1, 1, 4, 2, FRAMES),
         "stdit tp2-ring2": ("debug-stdit", 2, 1, 2, 2, FRAMES),
         "stdit pp2-ring2": ("debug-stdit", 1, 2, 2, 2, FRAMES)}
REFERENCES = {"debug-hunyuan": (), "debug-stdit": FRAMES}
STEPS = 2


def _model(folder, sp, ring, world_size):
    from parallel.model.build import build_model
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.weights.diffusers import load_released

    cfg = load_config("debug-hunyuan", overrides(folder) + [f"parallel.sp_size={sp}", f"parallel.ring_size={ring}"])
    ctx = ParallelContext.build(ParallelDims(sp_size=sp, ring_size=ring, dp_size=world_size // sp))
    model = build_model(cfg, {}, ctx)
    load_released(model, ctx, cfg.model, folder)
    return cfg, ctx, model


def _grads(folder, sp, ring, world_size, x, target):
    """The full parameter gradients of the sp loss, averaged over the sp ranks, and the bytes this rank isent."""
    import torch.distributed as dist

    from parallel.model.build import SequenceLoss
    from parallel.weights.gather import full_tensors

    cfg, ctx, model = _model(folder, sp, ring, world_size)
    sent, batch = [], dist.batch_isend_irecv

    def counted(ops):                                           # the ring posts its sends in batches
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return batch(ops)
    dist.batch_isend_irecv = counted
    try:
        h = model.embed(x)
        for block in model.blocks:
            h = block(h)
        SequenceLoss(cfg, ctx)(model.final(h), target).backward()
    finally:
        dist.batch_isend_irecv = batch
    for p in model.parameters():
        if sp > 1:
            dist.all_reduce(p.grad, group=ctx.sp_group)
            p.grad /= sp
    return dict(full_tensors(model, ctx, cfg.model.num_layers, value=lambda p: p.grad)), sum(sent)


def _rank(rank, world_size, folder):
    import types

    import deepspeed

    from parallel.distributed import accelerator
    from parallel.validation.validate import StageForward
    from tests.train_utils import _train_rank

    deepspeed.init_distributed(dist_backend=accelerator.backend())
    x, out = inputs(), {}
    for sp, ring in PREDICT:
        _, ctx, model = _model(folder, sp, ring, world_size)
        forward = StageForward(types.SimpleNamespace(module=model, device=torch.device("cpu")), ctx)
        out[("predict", sp, ring)] = forward.predict(x, x[0])
    target = torch.randn(x[0].shape, generator=torch.Generator().manual_seed(3))
    for sp, ring in [(1, 1), *GRADS]:
        out[("grads", sp, ring)] = _grads(folder, sp, ring, world_size, x, target)
    for sp, ring in [(1, 1), *PREDICT]:
        out[("stdit", sp, ring)] = _stdit_prediction(sp, ring, world_size)
    for name, (preset, tp, pp, sp, ring, extra) in TRAIN.items():
        ds = hunyuan_fp32_config()
        if RECOMPUTE[0] in extra:
            ds.pop("activation_checkpointing")                  # train.recompute instead
        out[name] = _train_rank(rank, world_size, tp, pp, world_size // (tp * pp * sp), ds, STEPS,
                                (f"parallel.ring_size={ring}", *extra), sp, preset, 0)
    return out


def _stdit_prediction(sp, ring, world_size):
    """debug-stdit's prediction at (sp, ring) of fixed random inputs, from the seed's initial weights, and the
    bytes this rank isends round the ring in one forward and backward of the loss on them."""
    import types

    import torch.distributed as dist

    from parallel.model.build import build_model
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext, ParallelDims
    from parallel.validation.validate import StageForward

    cfg = load_config("debug-stdit", [*FRAMES, f"parallel.sp_size={sp}", f"parallel.ring_size={ring}"])
    ctx = ParallelContext.build(ParallelDims(sp_size=sp, ring_size=ring, dp_size=world_size // sp))
    seed_all(cfg.train.seed)
    model = build_model(cfg, {}, ctx)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 4, 4, 8, 8, generator=g), torch.tensor([3.0, 811.0]), torch.randn(2, 8, 32, generator=g))
    prediction = StageForward(types.SimpleNamespace(module=model, device=torch.device("cpu")), ctx).predict(x, x[0])
    sent, batch = [], dist.batch_isend_irecv

    def counted(ops):                                           # the ring posts its sends in batches
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return batch(ops)
    dist.batch_isend_irecv = counted
    try:
        model(x, x[0]).backward()
    finally:
        dist.batch_isend_irecv = batch
    return prediction, sum(sent)


def _references(rank, world_size):
    from tests.train_utils import _train_rank
    return {preset: _train_rank(rank, world_size, 1, 1, 1, hunyuan_fp32_config(), STEPS, extra, 1, preset, 0)
            for preset, extra in REFERENCES.items()}


def _run(rows: list) -> dict:
    """tests.train_utils.train's summary of one run's ranks."""
    return {"losses": rows[0]["losses"], "all_losses": [r["losses"] for r in rows],
            "state": {k: v for r in rows for k, v in r["state"].items()}, "slack": rows[0]["slack"],
            "replica_mismatches": sorted({n for r in rows for n in r["replica_mismatches"]})}


def test_hunyuanvideo_and_stdit_under_ring_attention(released):
    folder, model = released
    (one,) = run_ranks(_references, 1)
    references = {preset: _run([run]) for preset, run in one.items()}
    results = run_ranks(_rank, 4, str(folder))
    want = diffusers_forward(model, *inputs())
    for rank, out in enumerate(results):
        for sp, ring in PREDICT:
            torch.testing.assert_close(out[("predict", sp, ring)], want,
                                       msg=lambda m: f"sp {sp} ring {ring} rank {rank}: prediction {m}")
        one, _ = out[("grads", 1, 1)]
        for sp, ring in GRADS:
            grads, sent = out[("grads", sp, ring)]
            chunk = B * padded_length(TEXT + VIDEO, sp) // sp * HIDDEN * 4           # b S/sp H, fp32
            assert sent == LAYERS * sum(ring_traffic(chunk, ring, 4)), (sp, ring, sent)
            assert grads.keys() == one.keys()
            for name, grad in one.items():
                torch.testing.assert_close(grads[name], grad, msg=lambda m: f"sp {sp} ring {ring} {name}: {m}")
        for sp, ring in PREDICT:
            (prediction, sent), (serial, _) = out[("stdit", sp, ring)], out[("stdit", 1, 1)]
            torch.testing.assert_close(prediction, serial,
                                       msg=lambda m: f"stdit sp {sp} ring {ring} rank {rank}: prediction {m}")
            # Only temporal attention rings (spatial attention stays in the chunk's frames): one per layer.
            chunk = B * 64 // sp * HIDDEN * 4                                   # b S/sp H, fp32
            assert sent == LAYERS * sum(ring_traffic(chunk, ring, 4)), (sp, ring, sent)
    for name, (preset, *_) in TRAIN.items():
        assert_matches(_run([r[name] for r in results]), references[preset])
    for reference in references.values():
        assert len(set(reference["losses"])) == STEPS                         # it trains
