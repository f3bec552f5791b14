"""Tiny random diffusers CogVideoX transformers of the 1.5 and image-to-video releases, their toolkit
overrides and diffusers' forward as the pipelines call it (shared by the unit and distributed tests).

    t2v15   CogVideoX1.5-5B:     patch_size_t 2, patch_bias false, rotary "slice" grid
    i2v5b   CogVideoX-5B-I2V:    in_channels 2 x out, learned positions (+ rotary)
    i2v15   CogVideoX1.5-5B-I2V: in_channels 2 x out, patch_size_t 2, ofs embedding
Latents [B, 4, 4, 8, 8] (t2v15, i2v15: 4 frames = 2 temporal patches; i2v5b: 3 frames; data.num_frames 9 ->
3 VAE frames, padded at the front to 4 under patch_size_t 2), 8 text tokens of 32.
"""
import torch
from diffusers import CogVideoXTransformer3DModel
from diffusers.models.embeddings import get_3d_rotary_pos_embed
from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

B, C, SIZE, HEADS, HEAD_DIM, TEXT = 2, 4, 8, 2, 16, 32
VARIANTS = {
    "t2v15": dict(in_channels=C, patch_size_t=2, patch_bias=False, sample_height=12, sample_width=16),
    "i2v5b": dict(in_channels=2 * C, use_learned_positional_embeddings=True, sample_height=SIZE, sample_width=SIZE),
    "i2v15": dict(in_channels=2 * C, patch_size_t=2, patch_bias=False, ofs_embed_dim=24, sample_height=12,
                  sample_width=16),
}


def frames(variant: str) -> int:
    return 4 if VARIANTS[variant].get("patch_size_t") else 3


def overrides(variant: str, folder=None) -> list[str]:
    v = VARIANTS[variant]
    out = ["model.num_layers=2", f"model.hidden_size={HEADS * HEAD_DIM}", f"model.num_heads={HEADS}",
           f"model.head_dim={HEAD_DIM}", "model.time_embed_dim=24", "model.pos_embed=rope3d",
           f"model.sample_height={v['sample_height']}", f"model.sample_width={v['sample_width']}",
           f"model.patch_size_t={v.get('patch_size_t', 1)}", f"model.patch_bias={v.get('patch_bias', True)}",
           f"model.image_condition={v['in_channels'] == 2 * C}",
           f"model.learned_positions={v.get('use_learned_positional_embeddings', False)}"]
    if "ofs_embed_dim" in v:
        out.append(f"model.ofs_embed_dim={v['ofs_embed_dim']}")
    if v.get("use_learned_positional_embeddings"):
        out.append("model.sample_frames=9")
    return out + ([f"model.init_from={folder}"] if folder else [])


def released_model(variant: str, seed: int = 0) -> CogVideoXTransformer3DModel:
    torch.manual_seed(seed)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, out_channels=C, time_embed_dim=24,
        text_embed_dim=TEXT, num_layers=2, sample_frames=9, max_text_seq_length=8,
        use_rotary_positional_embeddings=True, **VARIANTS[variant]).eval()
    with torch.no_grad():              # every tensor non-trivial, the learned position table included
        for t in list(model.parameters()) + list(model.buffers()):
            t.add_(0.1 * torch.randn_like(t))
    if model.config.use_learned_positional_embeddings:     # diffusers builds the table in float64; releases
        model.patch_embed.pos_embedding = model.patch_embed.pos_embedding.float()   # store fp32 / bf16
    return model


def inputs(variant: str, seed: int = 7):
    """(latents [B, C_in, T, H, W], timesteps [B], text [B, 8, 32]): the toolkit's stage-0 input."""
    g = torch.Generator().manual_seed(seed)
    c_in = VARIANTS[variant]["in_channels"]
    return (torch.randn(B, c_in, frames(variant), SIZE, SIZE, generator=g), torch.tensor([3.0, 811.0]),
            torch.randn(B, 8, TEXT, generator=g))


def diffusers_forward(model, latents, timesteps, text) -> torch.Tensor:
    """diffusers' prediction as [B, C, T, H, W], with the rotary tables and ofs as the pipelines make them."""
    cfg, grid = model.config, SIZE // 2
    base = (cfg.sample_height // 2, cfg.sample_width // 2)
    if cfg.patch_size_t is None:                     # CogVideoXPipeline / ImageToVideo, 1.0
        crop = get_resize_crop_region_for_grid((grid, grid), base[1], base[0])
        rotary = get_3d_rotary_pos_embed(HEAD_DIM, crop, (grid, grid), latents.shape[2])
    else:                                            # 1.5
        t = (latents.shape[2] + cfg.patch_size_t - 1) // cfg.patch_size_t
        rotary = get_3d_rotary_pos_embed(HEAD_DIM, None, (grid, grid), t, grid_type="slice", max_size=base)
    ofs = latents.new_full((1,), 2.0) if cfg.ofs_embed_dim else None
    with torch.no_grad():
        out = model(latents.transpose(1, 2), text, timesteps, ofs=ofs, image_rotary_emb=rotary).sample
    return out.transpose(1, 2)
