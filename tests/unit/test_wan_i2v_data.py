"""Wan 2.1 I2V's inputs and sampling against WanImageToVideoPipeline (diffusers 0.42), with tiny random
AutoencoderKLWan, CLIPVisionModel + CLIPImageProcessor and I2V transformer, fp32, one process:

  - the image latents of a clip's first frame (models/wan/image.py `encode_condition`, what data preparation
    stores) and of a picture (`encode_pictures`, sampling) equal prepare_latents' condition, and the training
    input (x_t, mask, image latents) equals the pipeline's latent_model_input;
  - the CLIP states (`encode_image_states`) equal the pipeline's encode_image;
  - sampling (models.sampling.sample, UniPC, guidance) from the same noise equals the pipeline's latents, and so
    does `python -m parallel.sample` (--image with --vae and --image-encoder, or --image-latents + --image-embeds);
  - data preparation (--image-encoder) stores both, and training batches from the folder carry them.
"""
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline
from PIL import Image
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

from models.vae import encode
from models.wan.image import WanImageCondition, condition_latents, encode_condition, encode_image_states, \
    encode_pictures
from parallel.experiment.config import load_config
from tests.helpers.prepare_data import videos  # noqa: F401  (fixture: clips)
from tests.helpers.prepare_data_wan import umt5_dir, wan_vae_dir  # noqa: F401  (fixtures: UMT5, Wan VAE)
from tests.helpers.wan_i2v import IMAGE, IMAGE_DIM, TEXT, released_i2v  # noqa: F401  (fixture)

FRAMES, HEIGHT, WIDTH = 9, 64, 96            # pixels -> latents [4, 3, 8, 12]


@pytest.fixture(scope="module")
def parts():
    """(vae, CLIP encoder, CLIP processor, a 64 x 96 picture): CLIP's 32 px input gives 2 x 2 + 1 = 5 tokens."""
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                           latents_std=[1.5, 0.8, 1.2, 2.0]).eval()
    encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=IMAGE_DIM, intermediate_size=32, num_hidden_layers=3,
                                               num_attention_heads=2, image_size=32, patch_size=16)).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    picture = Image.fromarray(np.random.default_rng(3).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8))
    return vae, encoder, processor, picture


def pipeline(transformer, parts):
    vae, encoder, processor, _ = parts
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                                   scheduler=scheduler, image_processor=processor, image_encoder=encoder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_inputs_are_the_pipelines(released_i2v, parts):
    _, model = released_i2v
    vae, encoder, processor, picture = parts
    pipe = pipeline(model, parts)
    noise = torch.randn(1, 4, 3, 8, 12, generator=torch.Generator().manual_seed(1))
    image = pipe.video_processor.preprocess(picture, height=HEIGHT, width=WIDTH).float()
    with torch.no_grad():
        latents, condition = pipe.prepare_latents(image, 1, 4, HEIGHT, WIDTH, FRAMES, torch.float32, "cpu",
                                                  latents=noise.clone())
    assert condition.shape == (1, 4 + 4, 3, 8, 12)
    # data preparation: the clip's first frame (its other frames play no part)
    clip = np.stack([np.asarray(picture)] + [np.full((HEIGHT, WIDTH, 3), 17, np.uint8)] * (FRAMES - 1))
    stored = encode_condition(encode, vae, clip)
    torch.testing.assert_close(stored[None], condition[:, 4:], atol=1e-5, rtol=1e-4)  # /127.5 - 1 vs /255 * 2 - 1
    torch.testing.assert_close(encode_pictures(vae, [picture], HEIGHT, WIDTH, FRAMES), condition[:, 4:])
    # the training input: the pipeline's latent_model_input = cat([latents, condition])
    torch.testing.assert_close(condition_latents(latents, condition[:, 4:], 4), torch.cat([latents, condition], 1),
                               rtol=0, atol=0)
    with torch.no_grad():
        want = pipe.encode_image(picture, "cpu")
    assert want.shape == (1, IMAGE, IMAGE_DIM)
    torch.testing.assert_close(encode_image_states(encoder, processor, [picture]), want)
    torch.testing.assert_close(encode_image_states(encoder, processor, [np.asarray(picture)]), want)


def test_sampling_equals_the_pipeline(released_i2v, parts, tmp_path, capsys):
    """UniPC, 4 steps, guidance 2 from the same noise: models.sampling.sample with the condition's sampling
    input and the CLIP states gives WanImageToVideoPipeline(..., output_type="latent")'s latents."""
    from models.diffusion import Objective
    from models.sampling import sample
    from parallel.model.build import layer_specs
    from parallel.distributed.pipeline import SequentialDiT
    from parallel.distributed.topology import ParallelContext
    from parallel.weights.diffusers import load_released
    from tests.helpers.wan_i2v import overrides

    folder, model = released_i2v
    vae, encoder, processor, picture = parts
    cfg = load_config("debug-wan-i2v", overrides(folder))
    ours = SequentialDiT(layer_specs(cfg, ParallelContext.single()))
    load_released(ours, ParallelContext.single(), cfg.model, folder)
    g = torch.Generator().manual_seed(11)
    noise, text, negative = (torch.randn(1, 4, 3, 8, 12, generator=g), torch.randn(1, TEXT, 32, generator=g),
                             torch.randn(1, TEXT, 32, generator=g))
    with torch.no_grad():
        want = pipeline(model, parts)(image=picture, prompt_embeds=text, negative_prompt_embeds=negative,
                                      latents=noise.clone(), height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                                      num_inference_steps=4, guidance_scale=2.0, output_type="latent").frames
    condition = WanImageCondition(cfg.model, cfg.data)
    first = encode_pictures(vae, [picture], HEIGHT, WIDTH, FRAMES)
    states = encode_image_states(encoder, processor, [picture])

    def predict(x, t, conditional):
        with torch.no_grad():
            return ours.predict((condition.sampling_input(x, first), t, text if conditional else negative, states))
    got = sample(predict, noise, Objective.of(cfg.model), 4, "unipc", 2.0)
    torch.testing.assert_close(got, want)
    sample_command(folder, parts, tmp_path, {"prompt": text, "negative": negative, "noise": noise}, first, states,
                   want, capsys)


def sample_command(folder, parts, tmp_path, tensors, first, states, want, capsys):
    """python -m parallel.sample gives the pipeline's latents: with --image PICTURE --vae --image-encoder, and
    with --image-latents + --image-embeds; without the CLIP states it is refused by name."""
    from safetensors.torch import load_file, save_file

    from parallel.sample import main
    from tests.helpers.wan_i2v import overrides

    vae, encoder, processor, picture = parts
    for name, value in {**tensors, "first": first, "states": states}.items():
        save_file({name: value.contiguous()}, str(tmp_path / f"{name}.safetensors"))
    vae.save_pretrained(tmp_path / "vae")
    encoder.save_pretrained(tmp_path / "clip")
    processor.save_pretrained(tmp_path / "clip")
    picture.save(tmp_path / "picture.png")
    base = ["--config", "debug-wan-i2v", *[a for s in overrides(folder) + [f"data.num_frames={FRAMES}"]
                                           for a in ("--set", s)],
            "--prompt-embeds", str(tmp_path / "prompt.safetensors"), "--negative-embeds",
            str(tmp_path / "negative.safetensors"), "--noise", str(tmp_path / "noise.safetensors"), "--steps", "4",
            "--guidance", "2", "--sampler", "unipc"]
    runs = {"picture": ["--image", str(tmp_path / "picture.png"), "--vae", str(tmp_path / "vae"), "--image-encoder",
                        str(tmp_path / "clip")],
            "latents": ["--image-latents", str(tmp_path / "first.safetensors"), "--image-embeds",
                        str(tmp_path / "states.safetensors")]}
    for name, image_args in runs.items():
        out = tmp_path / f"{name}.safetensors"
        assert main(base + image_args + ["--out", str(out)]) == 0
        torch.testing.assert_close(load_file(str(out))["latents"], want, msg=lambda m: f"{name}: {m}")
    assert main(base + ["--image-latents", str(tmp_path / "first.safetensors"), "--out", str(tmp_path / "x")]) == 1
    assert ("--image-latents needs the CLIP states of the model's image cross-attention: --image-embeds FILE"
            in capsys.readouterr().err)
    assert main(base + ["--image", str(tmp_path / "picture.png"), "--vae", str(tmp_path / "vae"), "--out",
                        str(tmp_path / "x")]) == 1
    assert ("--image needs the CLIP vision encoder of the model's image cross-attention: --image-encoder DIR"
            in capsys.readouterr().err)
    save_file({"states": states[:, :3].contiguous()}, str(tmp_path / "short.safetensors"))
    assert main(base + runs["latents"][:2] + ["--image-embeds", str(tmp_path / "short.safetensors"), "--out",
                                              str(tmp_path / "x")]) == 1
    assert (f"--image-embeds {tmp_path / 'short.safetensors'}: shape [1, 3, {IMAGE_DIM}], expected [I, D] = "
            f"[{IMAGE}, {IMAGE_DIM}]" in capsys.readouterr().err)


def test_prepared_folder_trains_on_the_pipelines_inputs(videos, wan_vae_dir, umt5_dir, parts, tmp_path, capsys):
    """python -m parallel.prepare_data --image-encoder on debug-wan-i2v: each latent file holds "image" (the
    first frame's image latents, encode_condition) and "image_embeds" (its CLIP states, as encode_image on that
    frame); the data check passes; a training batch is (x_t, mask, image latents), t, text, CLIP states.
    Without --image-encoder, or with a CLIP of another width, the run is refused by name before any encoding."""
    from diffusers import AutoencoderKLWan
    from safetensors.torch import load_file

    from parallel.model.build import build_model
    from parallel.check import check_data_files
    from parallel.distributed.topology import ParallelContext
    from parallel.prepare_data.frames import frame_indices
    from parallel.train.run import build_dataset, training_batches
    from tests.helpers.prepare_data_wan import SETS, run

    _, encoder, processor, _ = parts
    clip_dir = tmp_path / "image_encoder"
    encoder.save_pretrained(clip_dir)
    processor.save_pretrained(clip_dir)
    out = tmp_path / "prepared"
    assert run(videos[0], wan_vae_dir, out, "--t5", str(umt5_dir), config="debug-wan-i2v") == 1
    assert ("--image-encoder is missing: model debug-wan-i2v (--config=debug-wan-i2v) trains on the first frame's "
            "CLIP states; give the release's image encoder folder") in capsys.readouterr().err
    assert run(videos[0], wan_vae_dir, out, "--t5", str(umt5_dir), "--image-encoder", str(clip_dir),
               config="debug-wan-i2v", sets=SETS + ["model.image_dim=32", "model.added_kv_proj_dim=64"]) == 1
    assert f"--image-encoder={clip_dir}: hidden_size 24 != model.image_dim 32" in capsys.readouterr().err
    assert not out.exists() or not list(out.glob("latents/*"))
    assert run(videos[0], wan_vae_dir, out, "--t5", str(umt5_dir), "--image-encoder", str(clip_dir), "--posterior",
               "mode", config="debug-wan-i2v") == 0

    vae = AutoencoderKLWan.from_pretrained(wan_vae_dir).eval()
    clip = videos[1]["a0.mkv"]
    clip = clip[frame_indices(len(clip), 9)][:, :, 8:40]          # as test_prepare_data_wan: the middle 32 columns
    stored = load_file(out / "latents/a0.mkv.safetensors")
    assert stored["image"].shape == stored["latent"].shape == (4, 3, 4, 4)
    torch.testing.assert_close(stored["image"], encode_condition(encode, vae, clip))
    assert not torch.allclose(stored["image"][:, 1:], torch.zeros(4, 2, 4, 4))      # gray frames: not zeros
    torch.testing.assert_close(stored["image_embeds"], encode_image_states(encoder, processor, [clip[0]])[0])

    cfg = load_config("debug-wan-i2v", SETS + ["data.kind=directory", f"data.path={out}", "train.micro_batch_size=2",
                                               "train.grad_accum_steps=1"])
    assert check_data_files(cfg) == []
    dataset = build_dataset(cfg)
    batches = training_batches(cfg, ParallelContext.single(), dataset)
    (x_t, t, text, embeds), target = next(batches)
    samples = [dataset[batches.sample_index(p)] for p in (0, 1)]          # (latent, text, image, image_embeds)
    assert all(len(sample) == 4 for sample in samples)
    assert x_t.shape == (2, 12, 3, 4, 4) and text.shape == (2, 512, 32) and embeds.shape == (2, IMAGE, IMAGE_DIM)
    assert torch.equal(x_t[:, 4:8, 0], torch.ones(2, 4, 4, 4)) and not x_t[:, 4:8, 1:].any()
    torch.testing.assert_close(x_t[:, 8:], torch.stack([s[2] for s in samples]))
    torch.testing.assert_close(embeds, torch.stack([s[3] for s in samples]))
    torch.manual_seed(0)
    loss = build_model(cfg, {}, ParallelContext.single())((x_t, t, text, embeds), target)
    loss.backward()
    assert torch.isfinite(loss)
