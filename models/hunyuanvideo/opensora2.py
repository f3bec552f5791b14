"""Open-Sora 2.0 (configs/opensora2.0.yaml): what it adds to the HunyuanVideo family, whose network it is (the same
MMDiT: dual-stream then single-stream blocks; its switches are HunyuanVideoConfig fields, docs/models.md): its
training timesteps (`HUNYUAN_TIMESTEPS`, the family's FamilySpec.timesteps) and its released checkpoint.

Checkpoint: Open-Sora 2.0's released file (hpcaitech/Open-Sora `MMDiTModel`, fused_qkv=False, use_liger_rope=True) as
this family's tensors: the name map and the two exact rewrites between them (`OPENSORA`, the family's
FamilySpec.formats.checkpoint). parallel/weights/opensora.py reads and writes the file.

    toolkit                              Open-Sora 2.0 (opensora/models/mmdit/model.py, layers.py)
    embed.patch_proj / cond_proj         img_in / cond_in                 (both (c, ph, pw)-ordered patches)
    embed.timestep_embedder / guidance_embedder / pooled_embedder .linear_{1,2}
                                         time_in / guidance_in / vector_in .{in_layer, out_layer}
    embed.refiner_proj_in                txt_in                           (model.num_refiner_layers 0)
    blocks.i (i < D)                     double_blocks.i: {img,txt}_mod.lin (norm1, norm1_context),
                                         {img,txt}_attn.{q,k,v}_proj (to_qkv, add_qkv), {img,txt}_attn.proj
                                         (to_out, to_add_out), {img,txt}_mlp.{0,2} (ff_*, ff_context_*),
                                         {img,txt}_attn.norm.{query,key}_norm.scale (norm_q, norm_k, norm_added_*)
    blocks.i (i >= D)                    single_blocks.(i - D): modulation.lin (norm), [q_proj; k_proj; v_mlp]
                                         (proj_in: v_mlp is [v; MLP]), linear2 (proj_out), norm.{query,key}_norm.scale
    final.norm_out_linear / proj_out     final_layer.adaLN_modulation.1 (halves swapped) / final_layer.linear

The two rewrites, each a permutation (so a round trip is bit for bit):
- Rotary pairing. Open-Sora's Liger rotary (math.py `liger_rope`, layers.py `LigerEmbedND`: cos, sin of the d/2
  frequencies `.repeat(1, 1, 2)`) rotates channel j of a head with channel j + d/2 (rotate-half); this family
  (diffusers') rotates 2j with 2j + 1, at the same frequency j (both concatenate the (t, h, w) axes' frequencies
  in that order). So the toolkit's head channel 2j is Open-Sora's j and 2j + 1 is j + d/2: every head's q and k
  rows (weights, biases) and the q/k RMSNorm scales are permuted so; attention scores q.k are sums over the same
  products, v and the output are untouched.
- The head's modulation: Open-Sora's `LastLayer` chunks (shift, scale), diffusers' AdaLayerNormContinuous (scale,
  shift).

Timesteps: the family's training draw (FamilySpec.timesteps), chosen by model.train_timesteps.

- uniform (HunyuanVideo): an integer timestep uniform over [0, 1000), shifted by model.schedule.shift
  (models/diffusion.py `PerSample`).
- opensora (Open-Sora 2.0, hpcaitech/Open-Sora @ 7ad6a96, scripts/diffusion/train.py:384-390): t = sigmoid(n),
  n ~ N(0, 1) (a logit-normal draw), then shifted by the sample's own resolution, s = a t / (1 + (a - 1) t) with
  a = (1 + (patches per latent frame - 256) / 1920) x sqrt(latent frames) (models/diffusion.py `open_sora_shift`),
  so each bucket gets its own shift; model.schedule.shift is not read. The draw is the noise level s itself
  (a float32 [1]): models/diffusion.py noises with it (and model.schedule.sigma_min) and the model sees 1000 s, as
  Open-Sora's time_in(sinusoid(1000 t)). Open-Sora draws the batch's n from the global generator and rounds t to
  the training dtype; here n is the sample's own draw (from its generator, after its noise), in float32.
"""
from __future__ import annotations

from typing import Optional

import torch

from models.diffusion import PER_SAMPLE, open_sora_shift, time_shift
from models.hunyuanvideo.config import HunyuanVideoConfig
from models.spec import CheckpointFormat

QK, SWAP = "qk", "swap"                   # the rewrites above

_EMBED = {"patch_proj": "img_in", "cond_proj": "cond_in", "refiner_proj_in": "txt_in",
          **{f"{ours}.linear_{k}": f"{theirs}.{layer}" for k, layer in ((1, "in_layer"), (2, "out_layer"))
             for ours, theirs in (("timestep_embedder", "time_in"), ("guidance_embedder", "guidance_in"),
                                  ("pooled_embedder", "vector_in"))}}
_DUAL = {"norm1": "img_mod.lin", "norm1_context": "txt_mod.lin", "to_out": "img_attn.proj",
         "to_add_out": "txt_attn.proj", "ff_in": "img_mlp.0", "ff_out": "img_mlp.2", "ff_context_in": "txt_mlp.0",
         "ff_context_out": "txt_mlp.2",
         "to_qkv": (("img_attn.q_proj", QK), ("img_attn.k_proj", QK), ("img_attn.v_proj", None)),
         "add_qkv": (("txt_attn.q_proj", QK), ("txt_attn.k_proj", QK), ("txt_attn.v_proj", None))}
_DUAL_NORMS = {"attn.norm_q": "img_attn.norm.query_norm.scale", "attn.norm_k": "img_attn.norm.key_norm.scale",
               "attn.norm_added_q": "txt_attn.norm.query_norm.scale",
               "attn.norm_added_k": "txt_attn.norm.key_norm.scale"}
_SINGLE = {"norm": "modulation.lin", "proj_out": "linear2",
           "proj_in": (("q_proj", QK), ("k_proj", QK), ("v_mlp", None))}
_SINGLE_NORMS = {"attn.norm_q": "norm.query_norm.scale", "attn.norm_k": "norm.key_norm.scale"}
_FINAL = {"norm_out_linear": (("final_layer.adaLN_modulation.1", SWAP),), "proj_out": "final_layer.linear"}


def problems(m) -> list[str]:
    """What keeps this model section from Open-Sora 2.0's tensors, each with the key to change."""
    if not isinstance(m, HunyuanVideoConfig):
        return [f"an Open-Sora 2.0 checkpoint loads into model.family: hunyuanvideo with its switches "
                f"(configs/opensora2.0.yaml), not model.family={m.family}"]
    out = []
    if m.num_refiner_layers:
        out.append(f"model.num_refiner_layers={m.num_refiner_layers}: Open-Sora 2.0 has no token refiner (its text "
                   f"goes through one linear, txt_in); set model.num_refiner_layers=0")
    if m.patch_size_t != 1:
        out.append(f"model.patch_size_t={m.patch_size_t}: Open-Sora 2.0 patches 1 x 2 x 2; set model.patch_size_t=1")
    return out


def sources(name: str, m: HunyuanVideoConfig) -> list[tuple[str, Optional[str]]]:
    """(Open-Sora tensor, rewrite) behind one canonical toolkit name, in row order when several are fused."""
    section, _, rest = name.partition(".")
    d = m.num_dual_layers
    if section == "blocks":
        index, _, rest = rest.partition(".")
        i = int(index)
        prefix, norms, table = (f"double_blocks.{i}.", _DUAL_NORMS, _DUAL) if i < d else \
            (f"single_blocks.{i - d}.", _SINGLE_NORMS, _SINGLE)
        if rest in norms:
            return [(prefix + norms[rest], QK)]
    else:
        prefix, table = "", {"embed": _EMBED, "final": _FINAL}.get(section, {})
    module, _, leaf = rest.rpartition(".")
    if module not in table:
        raise KeyError(f"{name} has no counterpart in Open-Sora 2.0's checkpoint")
    target = table[module]
    parts = target if isinstance(target, tuple) else ((target, None),)
    return [(f"{prefix}{t}.{leaf}", rewrite) for t, rewrite in parts]


def _rows(name: str, m: HunyuanVideoConfig, n: int) -> list[int]:
    """Row counts of the fused parts of a full toolkit tensor with n rows."""
    k = len(sources(name, m))
    if name.startswith("blocks.") and ".proj_in." in name:          # [q; k; v + MLP]
        return [m.hidden_size, m.hidden_size, n - 2 * m.hidden_size]
    return [n // k] * k


def _pairing(d: int) -> torch.Tensor:
    """Index into Open-Sora's head channels giving the toolkit's: [0, d/2, 1, d/2 + 1, ...]."""
    return torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], dim=1).flatten()


def _rewrite(t: torch.Tensor, rewrite: Optional[str], d: int, to_toolkit: bool) -> torch.Tensor:
    if rewrite == QK:                                               # rows [heads x d] (or a norm's [d])
        index = _pairing(d) if to_toolkit else torch.argsort(_pairing(d))
        return t.unflatten(0, (-1, d))[:, index].flatten(0, 1)
    if rewrite == SWAP:                                             # (shift, scale) <-> (scale, shift)
        a, b = t.chunk(2, dim=0)
        return torch.cat([b, a], dim=0)
    return t


def to_opensora(name: str, full: torch.Tensor, m: HunyuanVideoConfig) -> dict[str, torch.Tensor]:
    """One full (tp = 1) toolkit tensor as its Open-Sora tensor(s)."""
    parts = sources(name, m)
    pieces = full.split(_rows(name, m, full.shape[0]), dim=0)
    return {n: _rewrite(p, rewrite, m.head_dim, to_toolkit=False).contiguous()
            for (n, rewrite), p in zip(parts, pieces)}


def from_opensora(name: str, tensors: list[torch.Tensor], m: HunyuanVideoConfig) -> torch.Tensor:
    """The full toolkit tensor from its Open-Sora tensors (in `sources` order)."""
    pieces = [_rewrite(t, rewrite, m.head_dim, to_toolkit=True) for (_, rewrite), t in zip(sources(name, m), tensors)]
    return torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]


def shapes(name: str, shape: tuple[int, ...], m: HunyuanVideoConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the Open-Sora tensors behind one full toolkit tensor of `shape`."""
    return {n: (rows, *shape[1:]) for (n, _), rows in zip(sources(name, m), _rows(name, m, shape[0]))}


OPENSORA = CheckpointFormat(title="Open-Sora 2.0", file_name="Open_Sora_v2.safetensors", problems=problems,
                            names=lambda name, m: [n for n, _ in sources(name, m)], shapes=shapes,
                            from_checkpoint=from_opensora, to_checkpoint=to_opensora)


class HunyuanTimesteps:
    per_token = False

    @staticmethod
    def draw(generator: torch.Generator, latent_shape: tuple[int, ...], model) -> torch.Tensor:
        if model.train_timesteps == "uniform":
            return PER_SAMPLE.draw(generator, latent_shape, model)
        t = torch.sigmoid(torch.randn(1, generator=generator))             # train.py:389
        return time_shift(open_sora_shift(latent_shape), t)                # train.py:386-390


HUNYUAN_TIMESTEPS = HunyuanTimesteps()
