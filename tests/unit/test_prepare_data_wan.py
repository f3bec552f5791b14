"""Data preparation for Wan 2.1 (debug-wan): generated videos -> a tiny random AutoencoderKLWan + a tiny random
UMT5EncoderModel -> the folder training reads; compared with diffusers' own encode and WanPipeline's
encode_prompt and decode path. The CogVideoX path and the shared fixtures: tests/unit/test_prepare_data.py."""
import json

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from safetensors.torch import load_file
from transformers import AutoTokenizer, UMT5EncoderModel

from parallel.experiment.config import load_config
from parallel.prepare_data.frames import frame_indices
from tests.helpers.prepare_data import lines, vae_dir, videos  # noqa: F401  (fixtures: clips, CogVideoX VAE)
from tests.helpers.text_encoder import VOCAB, t5_dir  # noqa: F401  (fixture: tiny T5)
from tests.helpers.prepare_data_wan import MEAN, SETS, STD, run
from tests.helpers.prepare_data_wan import umt5_dir, wan_vae_dir  # noqa: F401  (fixtures)

# Whitespace and an HTML entity for prompt_clean; the last caption is 9 words + EOS, truncated to max_text_len 8.
CAPTIONS = {"a0.mkv": "  a red   square &amp;amp; moving left ", "a1.mkv": "a square moving",
            "sub/b.mp4": "a red square moving left a red square moving"}


@pytest.fixture(scope="module")
def prepared(videos, wan_vae_dir, umt5_dir, tmp_path_factory): 
    out = tmp_path_factory.mktemp("prepared_wan")
    captions = out.parent / "wan_captions.jsonl"
    captions.write_text("".join(json.dumps({"video": v, "caption": c}) + "\n" for v, c in CAPTIONS.items()))
    assert run(videos[0], wan_vae_dir, out, "--t5", str(umt5_dir), "--posterior", "mode", captions=captions) == 0
    return out


def test_latents_and_text_are_what_diffusers_and_the_wan_pipeline_give(videos, wan_vae_dir, umt5_dir,
                                                                        prepared):
    frames = videos[1]
    manifest = lines(prepared / "manifest.jsonl")
    assert [m["video"] for m in manifest] == list(CAPTIONS)
    vae = AutoencoderKLWan.from_pretrained(wan_vae_dir).eval()
    mean, std = torch.tensor(MEAN).view(4, 1, 1, 1), torch.tensor(STD).view(4, 1, 1, 1)
    for name in ("a0.mkv", "a1.mkv"):
        # Lossless videos at 32 x 48: 9 frames spread over the video, the middle 32 columns, in [-1, 1].
        clip = frames[name][frame_indices(len(frames[name]), 9)][:, :, 8:40]
        x = torch.from_numpy(clip).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
        with torch.no_grad():
            expected = (vae.encode(x).latent_dist.mode()[0] - mean) / std
        latent = load_file(prepared / f"latents/{name}.safetensors")["latent"]
        assert latent.shape == (4, 3, 4, 4) and latent.dtype == torch.float32
        torch.testing.assert_close(latent, expected)

    pipe = WanPipeline(tokenizer=AutoTokenizer.from_pretrained(umt5_dir),
                       text_encoder=UMT5EncoderModel.from_pretrained(umt5_dir).eval(),
                       vae=None, transformer=None, scheduler=None)
    with torch.no_grad():
        embeds, uncond = pipe.encode_prompt([m["caption"] for m in manifest], do_classifier_free_guidance=True,
                                            max_sequence_length=8, device="cpu")      # negative prompt: ""
    texts = torch.stack([load_file(prepared / m["text"])["text"] for m in manifest])
    assert texts.shape == (3, 8, 32)
    torch.testing.assert_close(texts, embeds)
    # Zeros after each caption's tokens + EOS (7: "&" is one unknown word after cleaning; 4; all 8), as WanPipeline.
    assert [int(t.abs().sum(-1).gt(0).sum()) for t in texts] == [7, 4, 8]
    torch.testing.assert_close(load_file(prepared / "uncond.safetensors")["text"], uncond[0])
    assert int(uncond[0].abs().sum(-1).gt(0).sum()) == 1                            # EOS alone


def test_training_steps_from_the_prepared_folder(prepared):
    from models.diffusion import Objective
    from parallel.model.build import build_model
    from parallel.check import check_data_files, check_unconditional
    from parallel.distributed.seed import derive_seed
    from parallel.distributed.topology import ParallelContext
    from parallel.train.run import build_dataset, training_batches

    cfg = load_config("debug-wan", SETS + ["data.kind=directory", f"data.path={prepared}", "train.micro_batch_size=2",
                                           "train.grad_accum_steps=1", "data.caption_dropout=0.4"])
    assert check_data_files(cfg) == [] and check_unconditional(cfg) == []
    dataset = build_dataset(cfg)
    uncond = load_file(prepared / "uncond.safetensors")["text"]
    ctx = ParallelContext.single()
    batches = training_batches(cfg, ctx, dataset)
    torch.manual_seed(0)
    model = build_model(cfg, {}, ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    objective, dropped = Objective.of(cfg.model), []
    for step in range(2):
        (x_t, t, texts), target = next(batches)
        assert x_t.shape == (2, 4, 3, 4, 4) and texts.shape == (2, 8, 32)
        # Each position's flow-matching input from the prepared latent, and its caption's or the empty prompt's text.
        positions = [2 * step, 2 * step + 1]
        x0 = torch.stack([dataset[batches.sample_index(p)][0] for p in positions])
        gs = [torch.Generator().manual_seed(derive_seed(cfg.train.seed, "noise", p)) for p in positions]
        noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in gs])
        steps = torch.cat([torch.randint(0, 1000, (1,), generator=g) for g in gs])
        want_x, want_target = objective.noised(x0, noise, steps)
        torch.testing.assert_close(t, objective.model_timesteps(steps))
        torch.testing.assert_close(x_t, want_x)
        torch.testing.assert_close(target, want_target)
        for p, text in zip(positions, texts):
            dropped.append(batches.dropped(step, p))
            assert torch.equal(text, uncond if dropped[-1] else dataset[batches.sample_index(p)][1])
        loss = model((x_t, t, texts), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert True in dropped and False in dropped           # both the captions' and the empty prompt's embeddings fed


def test_wrong_vae_or_text_encoder_is_refused_by_name(videos, vae_dir, wan_vae_dir, umt5_dir, t5_dir,
                                                      tmp_path, capsys, monkeypatch):
    import models.vae
    monkeypatch.setattr(models.vae, "load_vae", lambda *a, **k: pytest.fail("a model was loaded"))
    root, _ = videos

    def refused(*args, **kwargs) -> str:
        assert run(root, *args, **kwargs) == 1
        return capsys.readouterr().err

    err = refused(vae_dir, tmp_path / "o")
    assert f"--vae={vae_dir}: an AutoencoderKLCogVideoX folder, but model.family=wan trains on AutoencoderKLWan " \
           "latents (use the vae/ folder of a Wan 2.1 diffusers release" in err
    err = refused(wan_vae_dir, tmp_path / "o", config="debug", sets=SETS)
    assert f"--vae={wan_vae_dir}: an AutoencoderKLWan folder, but model.family=cogvideox trains on " \
           "AutoencoderKLCogVideoX latents" in err
    err = refused(wan_vae_dir, tmp_path / "o", "--t5", str(t5_dir))
    assert f"--t5={t5_dir}: a T5EncoderModel, but model.family=wan trains on UMT5EncoderModel embeddings" in err
    err = refused(wan_vae_dir, tmp_path / "o", "--t5", str(umt5_dir), config="debug", sets=SETS)
    assert f"--t5={umt5_dir}: a UMT5EncoderModel, but model.family=cogvideox trains on T5EncoderModel" in err
    err = refused(wan_vae_dir, tmp_path / "o", sets=SETS + ["model.in_channels=16", "model.vae_scale_temporal=2"])
    assert f"--vae={wan_vae_dir}: latent channels 4 != model.in_channels=16" in err
    assert f"--vae={wan_vae_dir}: the VAE downsamples time by 4, model.vae_scale_temporal=2" in err
    # Training that encodes captions itself (data.text_encoder) refuses the other family's encoder the same way.
    from parallel.train.run import build_dataset
    (tmp_path / "manifest.jsonl").write_text(json.dumps({"latent": "x.pt", "caption": "a"}))
    cfg = load_config("debug-wan", ["data.kind=directory", f"data.path={tmp_path}", f"data.text_encoder={t5_dir}"])
    with pytest.raises(ValueError, match=f"data.text_encoder={t5_dir}: a T5EncoderModel, but this model family "
                                         "trains on UMT5EncoderModel embeddings"):
        build_dataset(cfg)


def test_validation_decodes_as_the_wan_pipeline(wan_vae_dir):
    """vae_decoder on a Wan VAE folder against WanPipeline.__call__'s decode path: a transformer that predicts
    zero velocity and one Euler step leave the given latents unchanged, so the pipeline decodes exactly them."""
    from models.vae import vae_decoder
    from parallel.validation.media import load_decoder, to_uint8

    latent = torch.randn(4, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                        in_channels=4, out_channels=4, text_dim=32, freq_dim=16, ffn_dim=32,
                                        num_layers=1).eval()
    with torch.no_grad():
        transformer.proj_out.weight.zero_()
        transformer.proj_out.bias.zero_()
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=AutoencoderKLWan.from_pretrained(wan_vae_dir).eval(),
                       transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    video = pipe(prompt_embeds=torch.zeros(1, 8, 32), latents=latent[None].clone(), num_frames=9, height=32,
                 width=32, num_inference_steps=1, guidance_scale=1.0, output_type="pt").frames[0]   # (F, 3, H, W)
    frames = vae_decoder(wan_vae_dir)(latent)
    assert frames.shape == (9, 32, 32, 3)
    torch.testing.assert_close(frames, video.permute(0, 2, 3, 1), rtol=0, atol=0)
    np.testing.assert_array_equal(load_decoder(str(wan_vae_dir))(latent), to_uint8(frames))
