"""The helpers and fixtures of tests/unit/test_opensora2.py that other test modules use too: `OPENSORA`,
`checkpoint`, `coinciding_release`, `config`, `diffusers_prediction`, `inputs`, `opensora_forward`, `random_model`
(a test module imports no other test module)."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from diffusers import HunyuanVideoTransformer3DModel
from safetensors.torch import save_file

from parallel.model.build import layer_specs
from parallel.experiment.config import load_config
from parallel.distributed.pipeline import SequentialDiT
from parallel.distributed.topology import ParallelContext
from parallel.weights.diffusers import CONFIG_NAME, WEIGHTS_NAME
from parallel.weights.gather import full_state
from parallel.weights.opensora import write_opensora
from tests.released_utils import random_release


B, FRAMES, HEIGHT, WIDTH = 2, 3, 8, 12            # latents [2, 4, 3, 8, 12] -> 3 x 4 x 6 = 72 video tokens
T5, POOLED, TEXT = 32, 8, 8
# debug-hunyuan (2 dual + 2 single blocks, 4 heads x 16) switched to Open-Sora 2.0's design
OPENSORA = ["model.num_refiner_layers=0", "model.guidance_embed=false", "model.text_mask=false",
            "model.rope_theta=10000", f"data.width={WIDTH * 8}"]


def config(*extra):
    return load_config("debug-hunyuan", OPENSORA + list(extra))


def inputs():
    """(latents, timesteps, text rows = [T5 state; pooled vector]); the second caption's last 3 T5 rows are zero
    (Open-Sora attends to them all the same)."""
    g = torch.Generator().manual_seed(7)
    t5, pooled = torch.randn(B, TEXT, T5, generator=g), torch.randn(B, 1, POOLED, generator=g)
    t5[1, 5:] = 0
    return (torch.randn(B, 4, FRAMES, HEIGHT, WIDTH, generator=g), torch.tensor([3.0, 811.0]),
            torch.cat([t5, pooled.expand(-1, TEXT, -1)], dim=-1))


def random_model(cfg, seed: int) -> SequentialDiT:
    torch.manual_seed(seed)
    model = SequentialDiT(layer_specs(cfg, ParallelContext.single())).eval()
    with torch.no_grad():                       # every tensor non-trivial: norm scales, gates, cond_in too
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(path, model): a tiny Open-Sora 2.0 checkpoint (cond_in included) written from a random toolkit model."""
    cfg = config("model.cond_embed=true")
    model = random_model(cfg, 0)
    path = tmp_path_factory.mktemp("opensora2") / "Open_Sora_v2.safetensors"
    write_opensora(full_state(model, ParallelContext.single(), cfg.model.num_layers).items(), cfg.model, path)
    return path, model


def opensora_forward(sd: dict, latents, timesteps, text, heads: int, axes=(4, 6, 6), theta=10000.0):
    lin = lambda x, n: F.linear(x, sd[n + ".weight"], sd[n + ".bias"])            # noqa: E731
    embedder = lambda x, n: lin(F.silu(lin(x, n + ".in_layer")), n + ".out_layer")  # noqa: E731  MLPEmbedder
    norm = lambda x: F.layer_norm(x, (x.shape[-1],), eps=1e-6)                    # noqa: E731  no affine
    b, c, t, h, w = latents.shape
    # sampling.py pack: "b c t (h ph) (w pw) -> b (t h w) (c ph pw)"
    img = latents.reshape(b, c, t, h // 2, 2, w // 2, 2).permute(0, 2, 3, 5, 1, 4, 6).reshape(b, -1, c * 4)
    txt, y_vec = text[..., :T5], text[:, 0, T5:]
    # layers.py timestep_embedding: t * time_factor (1000) with t in [0, 1]; [cos, sin] of 128 frequencies
    freqs = torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float32) / 128)
    args = (1000 * (timesteps / 1000))[:, None] * freqs[None]
    vec = embedder(torch.cat([args.cos(), args.sin()], dim=-1), "time_in") + embedder(y_vec, "vector_in")
    # model.py prepare_block_inputs: img_in, plus cond_in of the text-to-video condition (zeros: mask + latents)
    img = lin(img, "img_in") + lin(img.new_zeros(*img.shape[:2], (c + 1) * 4), "cond_in")
    txt = lin(txt, "txt_in")
    # sampling.py prepare: img_ids (t, h, w) integer positions, txt_ids zeros; layers.py LigerEmbedND: per axis
    # cos, sin of pos x theta^(-2j/dim), concatenated, .repeat(1, 1, 2): channel j pairs with j + d/2
    grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h // 2), torch.arange(w // 2), indexing="ij"),
                       dim=-1).reshape(-1, 3).float()
    ids = torch.cat([torch.zeros(txt.shape[1], 3), grid])
    ang = torch.cat([torch.outer(ids[:, i], 1.0 / theta ** (torch.arange(0, d, 2).float() / d))
                     for i, d in enumerate(axes)], dim=-1)
    cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)                  # (S, d)

    def rms(x, n):                                                                  # QKNorm's RMSNorm (scale)
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * sd[n + ".scale"]

    def heads_of(x):                                                                # (B, S, H) -> (B, n, S, d)
        return x.unflatten(-1, (heads, -1)).transpose(1, 2)

    def attention(q, k, v):
        # Liger's rope: x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]; flash attention, no mask
        half = lambda x: torch.cat([-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]], dim=-1)  # noqa: E731
        q, k = q * cos + half(q) * sin, k * cos + half(k) * sin
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)

    for i in range(2):                                                              # DoubleStreamBlockProcessor
        p = f"double_blocks.{i}."
        mi = lin(F.silu(vec), p + "img_mod.lin")[:, None].chunk(6, dim=-1)        # shift, scale, gate x 2
        mt = lin(F.silu(vec), p + "txt_mod.lin")[:, None].chunk(6, dim=-1)
        qkv = []
        for s, x, m in (("img", img, mi), ("txt", txt, mt)):
            xm = (1 + m[1]) * norm(x) + m[0]
            q, k, v = (heads_of(lin(xm, f"{p}{s}_attn.{z}_proj")) for z in "qkv")
            qkv.append((rms(q, f"{p}{s}_attn.norm.query_norm"), rms(k, f"{p}{s}_attn.norm.key_norm"), v))
        o = attention(*(torch.cat([qkv[1][j], qkv[0][j]], dim=2) for j in range(3)))
        ot, oi = o[:, :txt.shape[1]], o[:, txt.shape[1]:]
        img = img + mi[2] * lin(oi, p + "img_attn.proj")
        img = img + mi[5] * lin(F.gelu(lin((1 + mi[4]) * norm(img) + mi[3], p + "img_mlp.0"), approximate="tanh"),
                                p + "img_mlp.2")
        txt = txt + mt[2] * lin(ot, p + "txt_attn.proj")
        txt = txt + mt[5] * lin(F.gelu(lin((1 + mt[4]) * norm(txt) + mt[3], p + "txt_mlp.0"), approximate="tanh"),
                                p + "txt_mlp.2")
    x = torch.cat([txt, img], dim=1)
    for i in range(2):                                                              # SingleStreamBlockProcessor
        p = f"single_blocks.{i}."
        shift, scale, gate = lin(F.silu(vec), p + "modulation.lin")[:, None].chunk(3, dim=-1)
        xm = (1 + scale) * norm(x) + shift
        hid = x.shape[-1]
        v, mlp = lin(xm, p + "v_mlp").split([hid, sd[p + "v_mlp.weight"].shape[0] - hid], dim=-1)
        q = rms(heads_of(lin(xm, p + "q_proj")), p + "norm.query_norm")
        k = rms(heads_of(lin(xm, p + "k_proj")), p + "norm.key_norm")
        o = attention(q, k, heads_of(v))
        x = x + gate * lin(torch.cat([o, F.gelu(mlp, approximate="tanh")], dim=2), p + "linear2")
    x = x[:, txt.shape[1]:]
    shift, scale = lin(F.silu(vec), "final_layer.adaLN_modulation.1").chunk(2, dim=1)   # LastLayer: shift, scale
    x = lin((1 + scale[:, None]) * norm(x) + shift[:, None], "final_layer.linear")
    # sampling.py unpack: "b (t h w) (c ph pw) -> b c t (h ph) (w pw)"
    return x.reshape(b, t, h // 2, w // 2, c, 2, 2).permute(0, 4, 1, 2, 5, 3, 6).reshape(b, c, t, h, w)


def coinciding_release(folder) -> HunyuanVideoTransformer3DModel:
    """diffusers' HunyuanVideo without a refiner (its num_refiner_layers 0 leaves proj_in, the toolkit's txt_in) and
    guidance embedder, theta 10000, written to `folder` as model.init_from reads it; the model."""
    theirs = random_release(
        HunyuanVideoTransformer3DModel, in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16,
        num_layers=2, num_single_layers=2, num_refiner_layers=0, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        text_embed_dim=T5, pooled_projection_dim=POOLED, rope_axes_dim=(4, 6, 6), rope_theta=10000.0,
        guidance_embeds=False)
    # the refiner's embedders that num_refiner_layers 0 leaves unused have no toolkit counterpart
    state = {k: v.contiguous() for k, v in theirs.state_dict().items()
             if not k.startswith("context_embedder.time_text_embed.")}
    save_file(state, str(folder / WEIGHTS_NAME))
    (folder / CONFIG_NAME).write_text(json.dumps({"_class_name": "HunyuanVideoTransformer3DModel",
                                                  **dict(theirs.config)}))
    return theirs


def diffusers_prediction(theirs) -> torch.Tensor:
    """diffusers' forward on inputs() with every text row a key (an all-ones encoder_attention_mask)."""
    latents, timesteps, text = inputs()
    with torch.no_grad():
        return theirs(hidden_states=latents, timestep=timesteps, encoder_hidden_states=text[..., :T5],
                      encoder_attention_mask=torch.ones(B, TEXT, dtype=torch.long),
                      pooled_projections=text[:, 0, T5:]).sample
