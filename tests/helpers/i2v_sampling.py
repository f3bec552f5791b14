"""The helpers and fixtures of tests/unit/test_i2v_sampling.py that other test modules use too:
`image_latents_file`, `pipeline_latents`, `sample_argv`, `write_case` (a test module imports no other test
module)."""
import numpy as np
import torch
from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXDPMScheduler
from diffusers import CogVideoXImageToVideoPipeline
from diffusers.pipelines.cogvideo import pipeline_cogvideox_image2video as i2v_module
from PIL import Image
from safetensors.torch import load_file, save_file

from tests.unit import cogvideox_variants as variants
from tests.helpers.release_sampling import RELEASE


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
