"""Image-to-video sampling (`python -m parallel.sample --image / --image-latents`) against diffusers'
CogVideoXImageToVideoPipeline(..., output_type="latent") on tiny random transformers (fp32, one process).

The pipeline encodes its `image` itself with a tiny random AutoencoderKLCogVideoX. It draws the posterior
sample from the same generator that then gives the dpm sampler's step noise, so no seed of the toolkit's could
reproduce both; the pipeline's `retrieve_latents` is therefore wrapped to take the posterior's mode
(sample_mode="argmax"), which is what the toolkit encodes, and everything else in the pipeline runs unchanged
(preprocessing, scaling, the 1.5 frame padding, the concatenation, guidance). The --image-latents case feeds the
toolkit the first frame of the image latents the pipeline itself built (recorded from prepare_latents).

    i2v5b  CogVideoX-5B-I2V-like: learned positions, dpm, guidance 6 with dynamic CFG
    i2v15  CogVideoX1.5-5B-I2V-like: ofs embedding, patch_size_t 2 (3 VAE frames padded to 4), ddim,
           a VAE with invert_scale_latents (image latents z / scaling_factor)
The same files in tp 2 x pp 2: tests/distributed/test_sample_layouts.py.
"""
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXDPMScheduler
from diffusers import CogVideoXImageToVideoPipeline
from diffusers.pipelines.cogvideo import pipeline_cogvideox_image2video as i2v_module
from PIL import Image
from safetensors.torch import load_file, save_file

from tests.unit import cogvideox_variants as variants
from tests.unit.test_release_sampling import RELEASE

ROWS, STEPS, GUIDANCE, SEED = 2, 4, 6.0, 5
CASES = {"i2v5b": ("dpm", True), "i2v15": ("ddim", False)}       # variant: (sampler, dynamic CFG)
SCHEDULERS = {"ddim": CogVideoXDDIMScheduler, "dpm": CogVideoXDPMScheduler}


def write_case(variant: str, folder):
    """The transformer, a VAE, two pictures, prompt/negative embeddings and noise under `folder`; the tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    transformer = variants.released_model(variant)
    transformer.save_pretrained(folder / "transformer")
    torch.manual_seed(1)
    vae = AutoencoderKLCogVideoX(down_block_types=("CogVideoXDownBlock3D",) * 4,
                                 up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8),
                                 latent_channels=variants.C, layers_per_block=1, norm_num_groups=4,
                                 temporal_compression_ratio=4, scaling_factor=0.7,
                                 invert_scale_latents=variant == "i2v15").eval()
    vae.save_pretrained(folder / "vae")
    g = torch.Generator().manual_seed(21)
    rng = np.random.default_rng(3)
    for i in range(ROWS):      # a picture of another size: the pipeline and the toolkit resize it to 64 x 64
        Image.fromarray(rng.integers(0, 256, (72, 80, 3), dtype=np.uint8)).save(folder / f"picture{i}.png")
    t = variants.frames(variant)
    tensors = {"prompt": torch.randn(ROWS, 8, variants.TEXT, generator=g),
               "negative": torch.randn(ROWS, 8, variants.TEXT, generator=g),
               "noise": torch.randn(ROWS, variants.C, t, variants.SIZE, variants.SIZE, generator=g)}
    for name, value in tensors.items():
        save_file({name: value}, str(folder / f"{name}.safetensors"))
    return transformer, vae


def pipeline_latents(variant: str, transformer, vae, folder):
    """(latents [B, C, T, H, W], the pipeline's image latents [B, C, T, H, W]) of the I2V pipeline with the
    posterior's mode (see the module docstring)."""
    sampler, dynamic = CASES[variant]
    tensors = {k: load_file(str(folder / f"{k}.safetensors"))[k] for k in ("prompt", "negative", "noise")}
    pipe = CogVideoXImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                                         scheduler=SCHEDULERS[sampler](**RELEASE, snr_shift_scale=1.0))
    pipe.set_progress_bar_config(disable=True)
    recorded, original, prepare = {}, i2v_module.retrieve_latents, pipe.prepare_latents

    def prepare_latents(*args, **kwargs):
        latents, image_latents = prepare(*args, **kwargs)
        recorded["image"] = image_latents.transpose(1, 2)
        return latents, image_latents

    pipe.prepare_latents = prepare_latents
    i2v_module.retrieve_latents = lambda out, generator=None, sample_mode="sample": original(out, generator, "argmax")
    try:
        with torch.no_grad():
            out = pipe(image=[Image.open(folder / f"picture{i}.png") for i in range(ROWS)],
                       prompt_embeds=tensors["prompt"], negative_prompt_embeds=tensors["negative"],
                       latents=tensors["noise"].transpose(1, 2).clone(), num_frames=9, height=64, width=64,
                       num_inference_steps=STEPS, guidance_scale=GUIDANCE, use_dynamic_cfg=dynamic,
                       output_type="latent", max_sequence_length=8,
                       generator=torch.Generator().manual_seed(SEED)).frames
    finally:
        i2v_module.retrieve_latents = original
    return out.transpose(1, 2), recorded["image"]


def sample_argv(variant: str, folder, out, image_args, extra=()):
    sampler, dynamic = CASES[variant]
    sets = variants.overrides(variant, folder / "transformer") + [
        "data.num_frames=9", "data.height=64", "data.width=64", "model.schedule.snr_shift_scale=1.0",
        f"val.use_dynamic_cfg={dynamic}", *extra]
    return ["--config", "debug", *[a for s in sets for a in ("--set", s)],
            "--prompt-embeds", str(folder / "prompt.safetensors"), "--negative-embeds",
            str(folder / "negative.safetensors"), "--noise", str(folder / "noise.safetensors"), *image_args,
            "--steps", str(STEPS), "--guidance", str(GUIDANCE), "--sampler", sampler, "--seed", str(SEED),
            "--out", str(out)]


def image_latents_file(image: torch.Tensor, folder):
    """The first frame of the pipeline's image latents [B, C, 1, H, W], as --image-latents reads it."""
    save_file({"image": image[:, :, :1].contiguous()}, str(folder / "image.safetensors"))
    return ["--image-latents", str(folder / "image.safetensors")]


@pytest.mark.parametrize("variant", list(CASES))
def test_i2v_sample_command_equals_the_pipeline(tmp_path, variant):
    """--image-latents FILE, and (i2v15) --image PICTURE --vae DIR, give the pipeline's batch of two rows. (With
    --vae the command also decodes the videos, the slow part on a CPU: the picture path runs for one variant.)"""
    from parallel.sample import main

    transformer, vae = write_case(variant, tmp_path)
    want, image = pipeline_latents(variant, transformer, vae, tmp_path)
    assert torch.equal(image[:, :, 1:], torch.zeros_like(image[:, :, 1:]))     # [z_img, 0, ..., 0]
    pictures = [a for i in range(ROWS) for a in ("--image", str(tmp_path / f"picture{i}.png"))]
    runs = {"latents": image_latents_file(image, tmp_path)}
    if variant == "i2v15":
        runs["picture"] = pictures + ["--vae", str(tmp_path / "vae")]
    for name, image_args in runs.items():
        out = tmp_path / f"{name}.safetensors"
        assert main(sample_argv(variant, tmp_path, out, image_args)) == 0
        torch.testing.assert_close(load_file(str(out))["latents"], want, msg=lambda m: f"{variant} {name}: {m}")
    # The image conditions the sample: other image latents, another batch.
    save_file({"image": torch.zeros_like(image[:1, :, :1])}, str(tmp_path / "zeros.safetensors"))
    assert main(sample_argv(variant, tmp_path, tmp_path / "z.safetensors",
                            ["--image-latents", str(tmp_path / "zeros.safetensors")])) == 0
    assert (load_file(str(tmp_path / "z.safetensors"))["latents"] - want).abs().max() > 1e-3


def test_i2v_sample_command_refuses_missing_or_wrong_images(tmp_path, capsys):
    from parallel.sample import main

    write_case("i2v15", tmp_path)
    save_file({"image": torch.randn(3, variants.C, 1, 8, 6)}, str(tmp_path / "bad.safetensors"))
    assert main(sample_argv("i2v15", tmp_path, tmp_path / "x.safetensors", [])) == 1
    assert "model debug is image-to-video: give the first frame, either --image" in capsys.readouterr().err
    assert main(sample_argv("i2v15", tmp_path, tmp_path / "x.safetensors",
                            ["--image-latents", str(tmp_path / "bad.safetensors")])) == 1
    err = capsys.readouterr().err
    assert f"shape [3, {variants.C}, 1, 8, 6], expected [C, 1, H, W] = [{variants.C}, 1, 8, 8]" in err
    pictures = ["--image", str(tmp_path / "picture0.png")] * 3
    assert main(sample_argv("i2v15", tmp_path, tmp_path / "x.safetensors", pictures)) == 1
    err = capsys.readouterr().err
    assert "3 pictures for 2 prompts; give 1 or 2" in err and "--image needs the VAE" in err
    # A text-to-video model takes no image.
    from parallel.check import check
    from parallel.config import load_config
    from parallel.sample import check_args, parse_args
    args = parse_args(["--config", "debug", "--prompt-embeds", str(tmp_path / "prompt.safetensors"), "--image",
                       str(tmp_path / "picture0.png"), "--out", str(tmp_path / "x.safetensors")])
    cfg = load_config("debug", [f"train.output_dir={tmp_path}"])
    assert "--image: model debug is text-to-video (its family's conditioning is off); leave out the image" in \
        check_args(args, cfg, check(cfg, {}, "ds.json", 1)[0])
