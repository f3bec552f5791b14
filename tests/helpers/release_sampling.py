"""The helpers and fixtures of tests/unit/test_release_sampling.py that other test modules use too: `CASES`,
`RELEASE`, `_transformer`, `batch_files`, `pipeline_latents`, `sample_argv` (a test module imports no other test
module)."""

import torch
from diffusers import CogVideoXDDIMScheduler, CogVideoXDPMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel



RELEASE = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "clip_sample": False,
           "prediction_type": "v_prediction", "rescale_betas_zero_snr": True, "set_alpha_to_one": True,
           "timestep_spacing": "trailing"}
SCHEDULERS = {"ddim": CogVideoXDDIMScheduler, "dpm": CogVideoXDPMScheduler}


SIZE, FRAMES, HEADS, HEAD_DIM, TEXT = 8, 3, 2, 16, 8


def _transformer(pos, folder):
    torch.manual_seed(3)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=4, time_embed_dim=24,
        text_embed_dim=32, num_layers=2, sample_height=SIZE, sample_width=SIZE, sample_frames=(FRAMES - 1) * 4 + 1,
        max_text_seq_length=TEXT, use_rotary_positional_embeddings=pos == "rope3d").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


CASES = {"ddim": ("sincos", 3.0), "dpm": ("rope3d", 1.0)}     # sampler: (positions, snr_shift_scale), 2B / 5B-like
BATCH, STEPS, GUIDANCE, SEED = 2, 4, 6.0, 5


def batch_files(folder):
    """Prompt and negative embeddings [B, L, D] and noise [B, C, T, H, W] written to `folder`; the tensors."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(21)
    tensors = {"prompt": torch.randn(BATCH, TEXT, 32, generator=g),
               "negative": torch.randn(BATCH, TEXT, 32, generator=g),
               "noise": torch.randn(BATCH, 4, FRAMES, SIZE, SIZE, generator=g)}
    for name, t in tensors.items():
        save_file({name: t}, str(folder / f"{name}.safetensors"))
    return tensors


def sample_argv(kind, transformer_folder, files_folder, out, extra=()):
    """python -m parallel.sample's arguments for `kind` on the tiny transformer, the batch files and --noise."""
    pos, shift = CASES[kind]
    sets = ["model.num_layers=2", f"model.hidden_size={HEADS * HEAD_DIM}", f"model.num_heads={HEADS}",
            f"model.head_dim={HEAD_DIM}", "model.time_embed_dim=24", f"model.pos_embed={pos}",
            f"model.sample_height={SIZE}", f"model.sample_width={SIZE}", f"model.schedule.snr_shift_scale={shift}",
            f"model.init_from={transformer_folder}", f"data.num_frames={(FRAMES - 1) * 4 + 1}",
            f"data.height={SIZE * 8}", f"data.width={SIZE * 8}", *extra]
    return ["--config", "debug", *[a for s in sets for a in ("--set", s)],
            "--prompt-embeds", f"{files_folder}/prompt.safetensors", "--negative-embeds",
            f"{files_folder}/negative.safetensors", "--noise", f"{files_folder}/noise.safetensors",
            "--steps", str(STEPS), "--guidance", str(GUIDANCE), "--sampler", kind, "--seed", str(SEED),
            "--out", str(out)]


def pipeline_latents(kind, transformer, tensors):
    """CogVideoXPipeline(output_type="latent") on the batch, generator seeded with SEED, as [B, C, T, H, W]."""
    pipe = CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                             scheduler=SCHEDULERS[kind](**RELEASE, snr_shift_scale=CASES[kind][1]))
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        want = pipe(prompt_embeds=tensors["prompt"], negative_prompt_embeds=tensors["negative"],
                    latents=tensors["noise"].transpose(1, 2).clone(), num_frames=(FRAMES - 1) * 4 + 1,
                    height=SIZE * 8, width=SIZE * 8, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                    output_type="latent", generator=torch.Generator().manual_seed(SEED)).frames
    return want.transpose(1, 2)
