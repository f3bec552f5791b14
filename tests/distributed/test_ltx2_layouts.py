"""The LTX-2 family in 4 gloo ranks against diffusers' LTX2VideoTransformer3DModel.

One spawn: the tiny random releases of tests/unit/test_ltx2.py (LTX-2.0, and the LTX-2.3 flags: gated attention,
cross-attention modulation) loaded at (tp, pp) = (1, 1), (2, 1), (1, 2), (2, 2) and at sp 2 (Ulysses; tp 2 x Ulysses 2
and tp 2 x ring 2: the video stream split, the audio stream whole on every rank) predict what diffusers predicts,
video and audio, on every rank, under sp at the preset's 48 video tokens and at 45 (padded) and 1 (one rank holds only
padding); so do they with image-to-video's timesteps (frame 0's tokens at 0, LTX2ImageToVideoPipeline's [B, S]
timestep), under sp also with the first frame on one rank and split over both; at tp 2, and at tp 2 x sp 2 (Ulysses,
ring; 45 tokens) the gradients of a loss over both streams equal diffusers' own (every q/k RMSNorm all-reduces its
statistic across heads, forward and backward; under sp the video-to-audio partials merge across ranks, and the sp
ranks' gradients are averaged as DeepSpeed's data axis does); one block's forward at tp 2 all-reduces what the block's
docstring counts, and under Ulysses makes the all-to-alls the family's spec declares
(FamilySpec.costs.attentions_per_layer). The same ranks train debug-ltx2 (both streams, synthetic data, fp32,
activation checkpointing) at tp 2 x sp 2 and at tp 2 x pp 2 (the pipeline engine sends the stage tuple of both streams
and takes the (video, audio) target), and LoRA adapters on every attention (the cross-modal ones too) and an FFN layer
of each stream at tp 2 x pp 2 (the frozen base's embed stage); the tp 2 x sp 2 run and the LoRA run as image-to-video
with model.image_dropout 0.5 (some samples conditioned on their first frame, the others text-to-video: the per-sample
loss mask split over the sp ranks, and carried in the target through the pipeline): the losses on every rank and the
final weights equal a one-process run's (the three one-process runs in one spawn). The user's commands in the same ranks (their main(argv), as
`deepspeed --module` runs them): `python -m parallel.export --format diffusers` of the tp 2 x pp 2 run's checkpoint
writes a folder whose tensors are the trained weights bit for bit and from which diffusers' model predicts what the
trained toolkit model predicts (video and audio); `python -m parallel.verify` holds that export to the checkpoint
(`--checkpoint latest`, tp 2 x pp 2) and the LTX-2.3 release to diffusers at tp 2 x sp 2, both streams;
`python -m parallel.sample` of that release at tp 2 x sp 2 samples what one process samples, video and audio.
"""
import json
import types

import torch
from safetensors.torch import load_file, save_file

from tests.dist_utils import count_all_to_alls, run_ranks
from tests.train_utils import _train_rank, assert_matches, experiment_overrides, fp32_config, merge_ranks
from tests.released_utils import assert_grads_match, layout_model
from tests.helpers import ltx2 as test_ltx2
from tests.helpers.ltx2 import released  # noqa: F401  (fixture)

# (tp, pp, sp, ring); dp fills 4 ranks; ring None: the preset's (Ulysses where the heads allow)
LAYOUTS = [(1, 1, 1, None), (2, 1, 1, None), (1, 2, 1, None), (2, 2, 1, None), (1, 1, 2, None), (2, 1, 2, None),
           (2, 1, 2, 2)]
GRAD_LAYOUTS = [(2, 1, 1, None), (2, 1, 2, None), (2, 1, 2, 2)]
VARIANTS = ["ltx2", "ltx2.3"]
# image-to-video, half the samples trained as text-to-video (ltx-trainer's i2v_lora.yaml)
I2V = ("model.image_condition=true", "model.image_dropout=0.5")
TRAIN_LAYOUTS = {(2, 1, 2): I2V, (2, 2, 1): ()}     # (tp, pp, sp) training debug-ltx2 on the 4 ranks, 2 steps: extras
# LoRA at tp 2 x pp 2 (both streams through the pipeline, the embed stage's outputs from a frozen base): ltx-trainer's
# targets (every attention's q, k, v, out, the cross-modal ones too) and an FFN layer of each stream
LORA = ("model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[to_q,to_k,to_v,to_out.0,ff.net.2,"
        "audio_ff.net.0.proj]")
EXPORT_LAYOUT = (2, 2, 1)                      # the one whose checkpoint is exported and verified
# Under sp 2 the models also run other steps' grids (a bucket's StepGrid): (t, h, w), audio tokens. 45 video tokens
# pad to 46 (23 a rank, 22 real on the second); 1 token leaves the second rank only padding (no key of its own).
DEBUG = ((test_ltx2.FRAMES, test_ltx2.HEIGHT, test_ltx2.WIDTH), test_ltx2.AUDIO)
ODD = [((3, 3, 5), 18), ((1, 1, 1), 1)]
# Image-to-video under sp 2: 45 tokens (the first frame's 15 all on the first rank, none on the second) and one frame
# of 15 (8 and 7 of it on the two ranks, then a padding row)
I2V_ODD = [ODD[0], ((1, 3, 5), 4)]


def i2v_inputs(shape=DEBUG):
    """inputs() with the video timesteps per latent position, frame 0's at 0 (image-to-video)."""
    from models.ltx2.image import token_timesteps
    x = test_ltx2.inputs(*shape)
    return (x[0], token_timesteps(x[1], shape[0]), *x[2:])


def targets(shape=DEBUG):
    g = torch.Generator().manual_seed(3)
    x = test_ltx2.inputs(*shape)
    return torch.randn(x[0].shape, generator=g), torch.randn(x[3].shape, generator=g)


def loss(video, audio, shape=DEBUG):
    want_video, want_audio = targets(shape)
    return torch.nn.functional.mse_loss(video, want_video) + torch.nn.functional.mse_loss(audio, want_audio)


def _predict(model, ctx, inputs):
    """Both predictions on every rank (StageForward: pipeline stages send the stage tuple on, the last stage's
    (video, audio) is broadcast over the pipeline group)."""
    from models.ltx2.released import DIFFUSERS
    from parallel.validation.validate import StageForward

    forward = StageForward(types.SimpleNamespace(module=model, device=torch.device("cpu")), ctx)
    return forward.predict(inputs, DIFFUSERS.prediction_like(None, inputs))


def _rank(rank, world_size, folders, run):
    import deepspeed

    from parallel.distributed import accelerator

    deepspeed.init_distributed(dist_backend=accelerator.backend())
    out = {variant: _variant(world_size, variant, folder) for variant, folder in folders}
    for (tp, pp, sp), extra in TRAIN_LAYOUTS.items():
        save = f"{run}/checkpoints" if (tp, pp, sp) == EXPORT_LAYOUT else None
        out[("train", tp, pp, sp)] = _train_rank(rank, world_size, tp, pp, 1, fp32_config(), 2, extra, sp,
                                                 "debug-ltx2", 0, save)
    out["lora"] = _train_rank(rank, world_size, 2, 2, 1, fp32_config(), 2, LORA + I2V, 1, "debug-ltx2", 0)
    return {**out, **_commands(dict(folders)["ltx2.3"], run)}


def _references(rank, world_size):
    """The one-process runs the layouts' training is held to, in one spawn: full fine-tuning (text- and
    image-to-video) and LoRA (image-to-video)."""
    runs = [_train_rank(rank, world_size, 1, 1, 1, fp32_config(), 2, extra, 1, "debug-ltx2", 0)
            for extra in ((), I2V, LORA + I2V)]
    return {extra: {**merge_ranks([r]), "slack": r["slack"]} for extra, r in zip(((), I2V, "lora"), runs)}


def _commands(release, run):
    """parallel.export of the EXPORT_LAYOUT run's checkpoint as a diffusers folder; parallel.verify of that folder
    against the checkpoint, and of the LTX-2.3 release at tp 2 x sp 2; parallel.sample of that release at tp 2 x sp
    2 (`sample_args`, written to run/sample.safetensors): each command's exit status."""
    from parallel import export, sample, verify

    tp, pp, sp = EXPORT_LAYOUT
    trained = ["--config", "debug-ltx2", "--deepspeed-config", f"{run}/ds.json", f"--set=ckpt.dir={run}/checkpoints",
               *(f"--set={o}" for o in experiment_overrides(tp, pp, 1, (), sp))]
    return {"export": export.main([*trained, "--format", "diffusers", "--out", f"{run}/export"]),
            "verify export": verify.main([*trained, "--checkpoint", "latest", f"--set=model.init_from={run}/export"]),
            "verify sp": verify.main(["--config", "debug-ltx2", "--set=parallel.tp_size=2", "--set=parallel.sp_size=2",
                                      *(f"--set={o}" for o in test_ltx2.overrides(release, "ltx2.3"))]),
            "sample sp": sample.main([*sample_args(release, run), "--set=parallel.tp_size=2", "--set=parallel.sp_size=2",
                                      "--out", f"{run}/sample.safetensors"])}


def sample_args(release, run) -> list[str]:
    """parallel.sample of the LTX-2.3 release: two prompts of run/prompt.safetensors (video and audio captions), the
    negative ones of run/negative.safetensors, noise of each prompt from (seed, i), 2 steps, guidance 3."""
    return ["--config", "debug-ltx2", *(f"--set={o}" for o in test_ltx2.overrides(release, "ltx2.3")),
            "--prompt-embeds", f"{run}/prompt.safetensors", "--negative-embeds", f"{run}/negative.safetensors",
            "--steps", "2", "--guidance", "3", "--seed", "5"]


def _grads(cfg, ctx, model, shape=DEBUG):
    """Full gradients of the training loss over both streams (SequenceLoss) at the step grid `shape`, as training
    takes them under sp: each rank's video share sp times, its whole audio once, the sp ranks' gradients averaged
    (DeepSpeed's data axis)."""
    import torch.distributed as dist

    from parallel.model.build import SequenceLoss
    from parallel.weights.gather import full_tensors

    model.zero_grad(set_to_none=True)
    model.step_grid.set(shape[0])
    SequenceLoss(cfg, ctx, model.step_grid)(model.predict(test_ltx2.inputs(*shape)), targets(shape)).backward()
    if ctx.sp_size > 1:                                       # one all-reduce of every gradient, flattened
        grads = [p.grad for p in model.parameters()]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=ctx.sp_group)
        for g, mean in zip(grads, torch._utils._unflatten_dense_tensors(flat / ctx.sp_size, grads)):
            g.copy_(mean)
    return dict(full_tensors(model, ctx, cfg.model.num_layers, value=lambda p: p.grad))


def _variant(world_size, variant, folder):
    from parallel.distributed.comm import count_comm

    x, out, overrides = test_ltx2.inputs(), {}, test_ltx2.overrides(folder, variant)
    for tp, pp, sp, ring in LAYOUTS:
        cfg, ctx, model = layout_model("debug-ltx2", overrides, folder, world_size, tp, pp, sp, ring)
        with torch.no_grad():
            out[("predict", tp, pp, sp, ring)] = _predict(model, ctx, x)
            out[("i2v", tp, pp, sp, ring)] = _predict(model, ctx, i2v_inputs())
            for shape in ODD if sp > 1 else ():
                model.step_grid.set(shape[0])
                out[("predict", tp, pp, sp, ring, shape)] = _predict(model, ctx, test_ltx2.inputs(*shape))
            for shape in I2V_ODD if sp > 1 else ():
                model.step_grid.set(shape[0])
                out[("i2v", tp, pp, sp, ring, shape)] = _predict(model, ctx, i2v_inputs(shape))
            model.step_grid.set(DEBUG[0])
            if (tp, pp, sp) == (2, 1, 1):
                with count_comm() as counter:
                    model.blocks[0](model.embed(x))
                out["block_all_reduces"] = counter.numels("all_reduce")
            if sp > 1 and tp == 2:
                with count_all_to_alls() as calls:
                    model.blocks[0](model.embed(x))
                out[("block_all_to_alls", ring)] = len(calls)
        if (tp, pp, sp, ring) in GRAD_LAYOUTS:               # under sp at 45 tokens: padded, and full chunks
            out[("grads", sp, ring)] = _grads(cfg, ctx, model, DEBUG if sp == 1 else ODD[0])
    return out


def test_ltx2_in_every_layout(released, tmp_path):
    from parallel.experiment.config import load_config

    (tmp_path / "ds.json").write_text(json.dumps(fp32_config()))
    g = torch.Generator().manual_seed(9)
    for name, rows in (("prompt", 2), ("negative", 1)):
        save_file({key: torch.randn(rows, 8, 16, generator=g) for key in ("text", "audio_text")},
                  str(tmp_path / f"{name}.safetensors"))
    results = run_ranks(_rank, 4, [(v, str(released[v][0])) for v in VARIANTS], str(tmp_path))
    references = run_ranks(_references, 1)[0]
    for (tp, pp, sp), extra in TRAIN_LAYOUTS.items():
        assert_matches(merge_ranks([r[("train", tp, pp, sp)] for r in results]), references[extra])
    lora_reference = references["lora"]
    assert_matches(merge_ranks([r["lora"] for r in results]), lora_reference)
    adapted = {n.split(".", 2)[2] for n in lora_reference["state"] if n.endswith("lora_B")}
    assert adapted == {f"{a}.{m}.lora_B" for a in ("attn1", "audio_attn1") for m in ("to_qkv", "to_out")} | {
        f"{a}.{m}.lora_B" for a in ("attn2", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
        for m in ("to_q", "to_kv", "to_out")} | {"ff.ff_out.lora_B", "audio_ff.ff_in.lora_B"}, adapted
    assert all(lora_reference["state"][f"blocks.{i}.{n}"].abs().sum() > 0 for i in (0, 1) for n in adapted)
    for command in ("export", "verify export", "verify sp", "sample sp"):
        assert [r[command] for r in results] == [0] * 4, command        # verify: 2 when a stream is apart
    check_export(tmp_path / "export", merge_ranks([r[("train", *EXPORT_LAYOUT)] for r in results])["state"])
    # parallel.sample at tp 2 x sp 2 samples what one process samples, video and audio (the pipeline's own loop
    # against one process: tests/unit/test_ltx2_sampling.py)
    from parallel import sample
    assert sample.main([*sample_args(released["ltx2.3"][0], tmp_path), "--out", str(tmp_path / "one.safetensors")]) == 0
    one, layout = (load_file(str(tmp_path / f"{n}.safetensors")) for n in ("one", "sample"))
    assert one.keys() == layout.keys() == {"latents", "audio"}
    for key, value in one.items():
        torch.testing.assert_close(layout[key], value, msg=lambda m: f"sample {key} at tp 2 x sp 2: {m}")
    for variant in VARIANTS:
        folder, model = released[variant]
        want = test_ltx2.diffusers_forward(model, variant)
        odd = {shape: test_ltx2.diffusers_forward(model, variant, test_ltx2.inputs(*shape)) for shape in ODD}
        i2v = {shape: test_ltx2.diffusers_forward(model, variant, i2v_inputs(shape)) for shape in [DEBUG, *I2V_ODD]}
        for rank, out in enumerate(r[variant] for r in results):
            for tp, pp, sp, ring in LAYOUTS:
                cases = [(("predict",), want), (("i2v",), i2v[DEBUG])] + [(("predict", shape), odd[shape])
                                                                          for shape in ODD if sp > 1]
                cases += [(("i2v", shape), i2v[shape]) for shape in I2V_ODD if sp > 1]
                for (kind, *key), expected_pair in cases:
                    for got, expected, stream in zip(out[(kind, tp, pp, sp, ring, *key)], expected_pair,
                                                     ("video", "audio")):
                        torch.testing.assert_close(got, expected, msg=lambda m: f"{variant} {kind} {stream} "
                                                   f"tp={tp} pp={pp} sp={sp} ring={ring} {key} rank {rank}: {m}")

        # tp 2, and tp 2 x sp 2 (Ulysses, ring) at 45 video tokens (padded): gradients equal diffusers' (names
        # through the released format's map).
        from models.ltx2.released import DIFFUSERS
        cfg = load_config("debug-ltx2", test_ltx2.overrides(folder, variant))
        theirs = {}
        for shape in (DEBUG, ODD[0]):
            model.zero_grad(set_to_none=True)
            loss(*DIFFUSERS.reference_call(model, test_ltx2.inputs(*shape), {}), shape).backward()
            theirs[shape] = {n: p.grad for n, p in model.named_parameters()}
        for rank, out in enumerate(r[variant] for r in results):
            for _, _, sp, ring in GRAD_LAYOUTS:
                assert_grads_match(out[("grads", sp, ring)], cfg.model, theirs[DEBUG if sp == 1 else ODD[0]])

        # Ulysses sp 2 (at tp 2): the video self-attention's four all-to-alls a block (the spec's
        # attentions_per_layer); a ring of 2 makes none.
        from models.ltx2 import SPEC
        assert results[0][variant][("block_all_to_alls", None)] == 4 * SPEC.costs.attentions_per_layer == 4
        assert results[0][variant][("block_all_to_alls", 2)] == 0

        # One block at tp 2: per attention, the q and k statistics (B x queries, B x keys) then its output
        # (B x queries x width of the stream the queries come from); then the two FFN outputs.
        b, s, a, text, d, da = 2, 48, 9, 8, 32, 16
        attentions = [(s, s, d), (a, a, da), (s, text, d), (a, text, da), (s, a, d), (a, s, da)]
        expected = [n for q, k, w in attentions for n in (b * q, b * k, b * q * w)] + [b * s * d, b * a * da]
        assert results[0][variant]["block_all_reduces"] == expected


def check_export(folder, state):
    """The diffusers folder parallel.export wrote: diffusers' from_pretrained reads the trained weights bit for bit
    (through the released name map), and its forward predicts what the trained toolkit model (one process, the
    ranks' gathered weights) predicts, video and audio."""
    from diffusers import LTX2VideoTransformer3DModel

    from parallel.experiment.config import load_config
    from parallel.model.build import build_model
    from parallel.distributed.topology import ParallelContext
    from parallel.weights.diffusers_export import to_diffusers

    theirs = LTX2VideoTransformer3DModel.from_pretrained(folder).eval()
    cfg = load_config("debug-ltx2")
    want = {k: v for name, full in state.items() for k, v in to_diffusers(name, full, cfg.model).items()}
    got = theirs.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    ours = build_model(cfg, {}, ParallelContext.single()).eval()
    ours.load_state_dict(state, strict=True)
    with torch.no_grad():
        predicted = ours.predict(test_ltx2.inputs())
    for got, expected, stream in zip(predicted, test_ltx2.diffusers_forward(theirs), ("video", "audio")):
        torch.testing.assert_close(got, expected, msg=lambda m: f"export {stream}: {m}")
