"""LTX-2's training batch and loss against the release, in one process: a micro-batch of debug-ltx2's synthetic data
is noised as LTX2Pipeline's scheduler and its audio copy do (FlowMatchEulerDiscreteScheduler's exponential time
shift at calculate_shift of the video tokens; one sigma for both streams), and the toolkit's loss on it equals a
hand-written reference: diffusers' LTX2VideoTransformer3DModel (a tiny random release) at that timestep, the
video MSE plus the audio MSE (Lightricks' ltx-trainer). Image-to-video (model.image_condition), as ltx-trainer's
first_frame condition: the first latent frame clean, its tokens at timestep 0 (diffusers' [B, S] timestep), out of
the video MSE; with model.image_dropout the samples not drawn are text-to-video ones and the loss is ltx-trainer's
masked per-sample mean. A prepared directory holds the audio beside the video; caption dropout gives a dropped
sample both streams' captions of the empty prompt.
"""
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift
from safetensors.torch import save_file

from parallel.distributed.seed import derive_seed
from parallel.distributed.topology import ParallelContext
from tests.helpers.ltx2 import B, overrides, release
from tests.released_utils import read_release, save_release


def _reference_batch(cfg, batches, keep=None):
    """The first micro-batch re-stated: each position's sample, its generator's video noise, uniform draw and audio
    noise; sigma as the pipeline's scheduler shifts it; x_t, a_t and the targets as flow matching makes them;
    image-to-video: the timesteps [B, T, H, W], frame 0 of x_t clean and its timestep 0 in the samples `keep`
    conditions (default: every one)."""
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                base_image_seq_len=1024, max_image_seq_len=4096)
    rows = []
    keep = [cfg.model.image_condition] * cfg.train.micro_batch_size if keep is None else keep
    for pos in range(cfg.train.micro_batch_size):
        x0, text, a0, atext = batches.dataset[batches.sample_index(pos)]
        g = torch.Generator().manual_seed(derive_seed(cfg.train.seed, "noise", pos))
        e = torch.randn(x0.shape, generator=g)
        u = torch.randint(0, 1000, (1,), generator=g) / 1000
        ea = torch.randn(a0.shape, generator=g)
        mu = calculate_shift(x0[0].numel(), 1024, 4096, 0.95, 2.05)     # the packed video tokens (patch 1)
        s = scheduler.time_shift(mu, 1.0, u.double()).float()
        x_t, t = s * e + (1 - s) * x0, (s * 1000).expand(x0.shape[1:]).clone()
        if keep[pos]:
            x_t[:, 0], t[0] = x0[:, 0], 0
        rows.append((x_t, text, s * ea + (1 - s) * a0, atext, t, s * 1000, e - x0, ea - a0))
    x_t, text, a_t, atext, t, at, v, va = (torch.cat(z) if z[0].dim() == 1 else torch.stack(z) for z in zip(*rows))
    return (x_t, t if cfg.model.image_condition else at, text, a_t, atext, at), (v, va)


@pytest.mark.parametrize("image", [False, True], ids=["t2v", "i2v"])
def test_the_loss_is_the_release_objective_on_diffusers_model(tmp_path, image):
    from models.ltx2.released import DIFFUSERS
    from parallel.model.build import SequenceLoss
    from parallel.train.run import training_batches

    model = release()
    folder, _ = save_release(tmp_path, model, "40KB")
    cfg, ours, _ = read_release("debug-ltx2", [*overrides(folder), f"model.image_condition={str(image).lower()}"],
                                folder)
    batches = training_batches(cfg, ParallelContext.single())
    inputs, target = next(batches)
    want_inputs, want_target = _reference_batch(cfg, batches)
    for got, want in zip((*inputs, *target), (*want_inputs, *want_target)):
        torch.testing.assert_close(got, want)
    levels = inputs[5]                                                   # the audio's: one a sample
    assert len(set(levels.tolist())) == 2 and 0 < levels.min() < levels.max() < 1000
    assert inputs[1].shape == ((B, 2, 4, 6) if image else (B,))

    loss = SequenceLoss(cfg, ParallelContext.single())(ours.predict(inputs), target)
    with torch.no_grad():
        video, audio = DIFFUSERS.reference_call(model, want_inputs, {})
    skip = 1 if image else 0                                             # the clean first frame: an input
    want = torch.nn.functional.mse_loss(video[:, :, skip:], want_target[0][:, :, skip:]) + \
        torch.nn.functional.mse_loss(audio, want_target[1])
    torch.testing.assert_close(loss, want)


def test_a_prepared_sample_holds_the_audio_stream(tmp_path):
    """The latent file's "audio" and the text file's "audio_text" follow the video latent and caption; the checker
    (headers only) names a file without them, or with another audio length, and so does the reader."""
    from parallel.experiment.config import load_config
    from parallel.train.data import DirectoryLatents, check_shapes

    video, text, audio, atext = torch.randn(8, 2, 4, 6), torch.randn(8, 16), torch.randn(9, 8), torch.randn(8, 16)
    save_file({"latent": video, "audio": audio}, str(tmp_path / "a.safetensors"))
    save_file({"text": text, "audio_text": atext}, str(tmp_path / "a_text.safetensors"))
    save_file({"latent": video}, str(tmp_path / "b.safetensors"))
    save_file({"latent": video, "audio": torch.randn(10, 8)}, str(tmp_path / "c.safetensors"))
    (tmp_path / "manifest.jsonl").write_text("".join(f'{{"latent": "{n}.safetensors", "text": "a_text.safetensors"}}\n'
                                                     for n in "abc"))
    cfg = load_config("debug-ltx2")
    missing, length = check_shapes(tmp_path, cfg.model, cfg.data)
    assert missing.startswith(f'{tmp_path / "b.safetensors"}: no "audio" tensor') and missing.endswith("(manifest."
                                                                                                       "jsonl:2)")
    assert length.startswith(f"{tmp_path / 'c.safetensors'}: audio shape [10, 8] != expected [9, 8] (manifest.jsonl:3")
    data = DirectoryLatents(tmp_path, stream=True)
    for got, want in zip(data[0], (video, text, audio, atext)):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match=f'^{tmp_path / "b.safetensors"}: no "audio" tensor'):
        data[1]


def _prepared_folder(root, n: int):
    """n samples of debug-ltx2's shapes, each caption pair its own, and uncond.safetensors with both streams'."""
    g = torch.Generator().manual_seed(11)
    lines = []
    for i in range(n):
        save_file({"latent": torch.randn(8, 2, 4, 6, generator=g), "audio": torch.randn(9, 8, generator=g)},
                  str(root / f"{i}.safetensors"))
        save_file({"text": torch.randn(8, 16, generator=g), "audio_text": torch.randn(8, 16, generator=g)},
                  str(root / f"{i}_text.safetensors"))
        lines.append(f'{{"latent": "{i}.safetensors", "text": "{i}_text.safetensors"}}\n')
    (root / "manifest.jsonl").write_text("".join(lines))
    save_file({"text": torch.full((8, 16), 0.25), "audio_text": torch.full((8, 16), -0.5)},
              str(root / "uncond.safetensors"))


def test_caption_dropout_gives_both_streams_the_empty_prompt_in_the_drawn_samples(tmp_path):
    """data.caption_dropout=p: the samples whose rand(seed, "caption_dropout", step, position) < p train on
    uncond.safetensors' "text" and "audio_text" (one draw for both streams: one caption makes both states), the others
    on their own; everything else in the batch is the batch without dropout; dp 2's ranks drop the same positions.
    The checker names an uncond.safetensors without the audio caption."""
    import types

    from parallel.experiment.config import load_config
    from parallel.train.data import check_shapes
    from parallel.train.run import training_batches

    _prepared_folder(tmp_path, 4)
    sets = ["data.kind=directory", f"data.path={tmp_path}", "train.micro_batch_size=4"]
    cfg, off = (load_config("debug-ltx2", [*sets, f"data.caption_dropout={p}"]) for p in (0.5, 0))
    uncond = {"text": torch.full((8, 16), 0.25), "audio_text": torch.full((8, 16), -0.5)}
    dropped = []
    for step in range(2):
        (inputs, target), (plain, plain_target) = (training_batches(c, ParallelContext.single()).micro_batch(step, 0)
                                                   for c in (cfg, off))
        for j in range(4):
            g = torch.Generator().manual_seed(derive_seed(cfg.train.seed, "caption_dropout", step, 4 * step + j))
            drop = float(torch.rand(1, generator=g)) < 0.5
            dropped.append(drop)
            for k, key in ((2, "text"), (4, "audio_text")):
                assert torch.equal(inputs[k][j], uncond[key] if drop else plain[k][j]), (step, j, key)
                assert drop or not torch.equal(plain[k][j], uncond[key])
        for k in (0, 1, 3, 5):
            assert torch.equal(inputs[k], plain[k])
        assert all(torch.equal(a, b) for a, b in zip(target, plain_target))
        # dp 2: each rank's two positions of the step, the same draw
        ranks = [training_batches(load_config("debug-ltx2", [*sets, "data.caption_dropout=0.5",
                                                             "train.micro_batch_size=2"]),
                                  types.SimpleNamespace(dp_rank=r, dp_size=2)).micro_batch(step, 0)[0] for r in (0, 1)]
        for k in range(6):
            assert torch.equal(torch.cat([r[k] for r in ranks]), inputs[k])
    assert 0 < sum(dropped) < len(dropped)

    save_file({"text": uncond["text"]}, str(tmp_path / "uncond.safetensors"))
    assert check_shapes(tmp_path, cfg.model, cfg.data) == [
        f'{tmp_path / "uncond.safetensors"}: no "audio_text" tensor: a model with a second stream (LTX-2\'s audio) '
        'trains on samples whose latent .safetensors also holds "audio" [audio tokens, model.audio_in_channels] and '
        'whose text .safetensors also holds "audio_text" [model.max_text_len, its caption width] (the empty '
        "prompt's, which python -m parallel.prepare_data --t5 writes for both streams)"]


def test_image_dropout_trains_the_samples_not_drawn_as_text_to_video(tmp_path):
    """model.image_dropout=p (1 - ltx-trainer's first_frame `probability`, drawn per sample): the samples whose
    rand(seed, "condition_dropout", step, position) >= p are conditioned as above (frame 0 clean, its tokens at
    timestep 0, out of the loss), the others are text-to-video samples (every frame noised at their level, timestep
    t on every token, in the loss); the target carries which. The loss is ltx-trainer's masked one, each sample's
    video MSE over what its mask keeps, averaged over the batch, plus the audio MSE, with diffusers' model by hand;
    under sp (3 ranks: the first frame on one rank and split; 5: padding) the ranks' shares average to it."""
    import types

    from models.geometry import patchify
    from models.ltx2.released import DIFFUSERS
    from parallel.model.build import SequenceLoss
    from parallel.train.run import training_batches

    model = release()
    folder, _ = save_release(tmp_path, model, "40KB")
    cfg, ours, _ = read_release("debug-ltx2", [*overrides(folder), "model.image_condition=true",
                                               "model.image_dropout=0.5", "train.micro_batch_size=4"], folder)
    batches = training_batches(cfg, ParallelContext.single())
    inputs, target = next(batches)
    keep = [float(torch.rand(1, generator=torch.Generator().manual_seed(
        derive_seed(cfg.train.seed, "condition_dropout", 0, pos)))) >= 0.5 for pos in range(4)]
    assert 0 < sum(keep) < 4
    want_inputs, want_target = _reference_batch(cfg, batches, keep)
    assert torch.equal(target[2], torch.tensor(keep))
    for got, want in zip((*inputs, *target[:2]), (*want_inputs, *want_target)):
        torch.testing.assert_close(got, want)
    assert [bool((inputs[1][j, 0] == 0).all()) for j in range(4)] == keep       # t2v samples: frame 0 at t too

    loss = SequenceLoss(cfg, ParallelContext.single())(prediction := ours.predict(inputs), target)
    with torch.no_grad():
        video, audio = DIFFUSERS.reference_call(model, want_inputs, {})
    per_sample = [(video[j] - want_target[0][j])[:, int(keep[j]):].square().mean() for j in range(4)]
    torch.testing.assert_close(loss, torch.stack(per_sample).mean() + torch.nn.functional.mse_loss(audio,
                                                                                                  want_target[1]))
    tokens = patchify(prediction[0], cfg.model)                       # [B, 48, C]: what the sp ranks hold
    for sp in (3, 5):
        padded = torch.nn.functional.pad(tokens, (0, 0, 0, -tokens.shape[1] % sp))
        shares = [SequenceLoss(cfg, types.SimpleNamespace(sp_size=sp, sp_rank=r))(
            (padded.chunk(sp, 1)[r], prediction[1]), target) for r in range(sp)]
        torch.testing.assert_close(torch.stack(shares).mean(), loss)
