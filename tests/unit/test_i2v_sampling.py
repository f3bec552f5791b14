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
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.unit import cogvideox_variants as variants
from tests.helpers.i2v_sampling import CASES, ROWS, image_latents_file, pipeline_latents, sample_argv, write_case


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
    from parallel.experiment.config import load_config
    from parallel.sample import check_args, parse_args
    args = parse_args(["--config", "debug", "--prompt-embeds", str(tmp_path / "prompt.safetensors"), "--image",
                       str(tmp_path / "picture0.png"), "--out", str(tmp_path / "x.safetensors")])
    cfg = load_config("debug", [f"train.output_dir={tmp_path}"])
    assert "--image: model debug is text-to-video (its family's conditioning is off); leave out the image" in \
        check_args(args, cfg, check(cfg, {}, "ds.json", 1)[0])
