"""Wan 2.1 as diffusers publishes it (`WanTransformer3DModel`): config translation and tensor names.

    toolkit                         diffusers
    embed.patch_embedding           patch_embedding (Conv3d [H, C, pt, p, p] = our Linear [H, (C pt p q)], reshaped)
    embed.time_linear_{1,2}         condition_embedder.time_embedder.linear_{1,2}
    embed.time_proj                 condition_embedder.time_proj
    embed.text_linear_{1,2}         condition_embedder.text_embedder.linear_{1,2}
    embed.image_norm{1,2}           condition_embedder.image_embedder.norm{1,2} (image-to-video)
    embed.image_linear_{1,2}        condition_embedder.image_embedder.ff.net.0.proj / ff.net.2
    blocks.i.scale_shift_table      blocks.i.scale_shift_table ([6, H] = [1, 6, H])
    blocks.i.attn1.to_qkv           blocks.i.attn1.to_{q,k,v} (fused: rows [q; k; v])
    blocks.i.attn{1,2}.norm_{q,k}   blocks.i.attn{1,2}.norm_{q,k} (RMSNorm over all heads)
    blocks.i.attn{1,2}.to_out       blocks.i.attn{1,2}.to_out.0
    blocks.i.norm2                  blocks.i.norm2 (the cross-attention's affine LayerNorm)
    blocks.i.attn2.to_q             blocks.i.attn2.to_q
    blocks.i.attn2.to_kv            blocks.i.attn2.to_{k,v} (fused: rows [k; v])
    blocks.i.attn2.add_kv           blocks.i.attn2.add_{k,v}_proj (image-to-video; fused: rows [k; v])
    blocks.i.attn2.norm_added_k     blocks.i.attn2.norm_added_k
    blocks.i.ffn_in / ffn_out       blocks.i.ffn.net.0.proj / ffn.net.2
    final.scale_shift_table         scale_shift_table ([2, H] = [1, 2, H])
    final.proj_out                  proj_out

Wan 2.2 A14B (model.experts): `model.init_from` is the release folder. Both experts (train both): toolkit
`<stage>.experts.0.<rest>` is `transformer/<released name>`, `<stage>.experts.1.<rest>` `transformer_2/<...>`
(`folders`: the released name's prefix -> its subfolder); one expert alone: plain names read from that expert's
subfolder. A Wan 2.1 folder, a missing transformer_2/ or another boundary_ratio is refused (`check_folder`). Both
experts are written with the pipeline's model_index.json beside them (`pipeline_index`: its boundary_ratio).

Reading and writing the folders is parallel/weights/'s job, for every family.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch

from models.geometry import latent_shape
from models.spec import DiffusersFormat, config_problems, show
from models.wan.config import I2V_TEXT_LEN, WanConfig
from models.wan.experts import NAMES, both

FOLDERS = ("transformer", "transformer_2")          # diffusers' WanPipeline: high noise, low noise
_EXPERT = re.compile(r"^(embed|final|blocks\.\d+)\.experts\.(\d+)\.(.*)$")


def split_expert(name: str) -> tuple[str, str]:
    """A toolkit name -> (its released folder prefix, the one-expert toolkit name):
    `blocks.3.experts.1.ffn_in.weight` -> ("transformer_2/", "blocks.3.ffn_in.weight"); plain names -> ("", name)."""
    match = _EXPERT.match(name)
    if match is None:
        return "", name
    stage, index, rest = match.groups()
    return FOLDERS[int(index)] + "/", f"{stage}.{rest}"

_EMBED = {"patch_embedding": "patch_embedding", "time_linear_1": "condition_embedder.time_embedder.linear_1",
          "time_linear_2": "condition_embedder.time_embedder.linear_2", "time_proj": "condition_embedder.time_proj",
          "text_linear_1": "condition_embedder.text_embedder.linear_1",
          "text_linear_2": "condition_embedder.text_embedder.linear_2",
          "image_norm1": "condition_embedder.image_embedder.norm1",
          "image_linear_1": "condition_embedder.image_embedder.ff.net.0.proj",
          "image_linear_2": "condition_embedder.image_embedder.ff.net.2",
          "image_norm2": "condition_embedder.image_embedder.norm2"}
_BLOCK = {"attn1.norm_q": "attn1.norm_q", "attn1.norm_k": "attn1.norm_k", "attn1.to_out": "attn1.to_out.0",
          "norm2": "norm2", "attn2.to_q": "attn2.to_q", "attn2.norm_q": "attn2.norm_q", "attn2.norm_k": "attn2.norm_k",
          "attn2.to_out": "attn2.to_out.0", "ffn_in": "ffn.net.0.proj", "ffn_out": "ffn.net.2",
          "attn2.norm_added_k": "attn2.norm_added_k"}
_FUSED = {"attn1.to_qkv": ("attn1.to_q", "attn1.to_k", "attn1.to_v"), "attn2.to_kv": ("attn2.to_k", "attn2.to_v"),
          "attn2.add_kv": ("attn2.add_k_proj", "attn2.add_v_proj")}
_FINAL = {"proj_out": "proj_out"}
PATCH_WEIGHT = "embed.patch_embedding.weight"
ROPE_MAX_SEQ_LEN = 1024     # the release's rotary table: frames, rows and columns of patches up to 1024 each


# diffusers' WanTransformer3DModel arguments: (config.json key, its default, our key or None, ours).
def _config_pairs(m: WanConfig) -> list[tuple[str, object, Optional[str], object]]:
    return [
        ("num_attention_heads", 40, "model.num_heads", m.num_heads),
        ("attention_head_dim", 128, "model.head_dim", m.head_dim),
        ("num_layers", 40, "model.num_layers", m.num_layers),
        ("ffn_dim", 13824, "model.ffn_hidden_size", m.ffn_size),
        ("in_channels", 16, "model.image_condition", m.transformer_in_channels),
        ("out_channels", 16, "model.in_channels", m.in_channels),
        ("text_dim", 4096, "model.text_embed_dim", m.text_embed_dim),
        ("freq_dim", 256, "model.time_embed_dim", m.time_embed_dim),
        ("patch_size", [1, 2, 2], "model.patch_size_t, model.patch_size", [m.patch_size_t, m.patch_size, m.patch_size]),
        ("image_dim", None, "model.image_dim", m.image_dim),
        ("added_kv_proj_dim", None, "model.added_kv_proj_dim", m.added_kv_proj_dim),
        # What the toolkit's Wan model always is (Wan 2.1): these have no model.* key.
        ("cross_attn_norm", True, None, True),
        ("qk_norm", "rms_norm_across_heads", None, "rms_norm_across_heads"),
        ("eps", 1e-6, None, 1e-6),
        ("rope_max_seq_len", 1024, None, ROPE_MAX_SEQ_LEN),
        ("pos_embed_seq_len", None, None, None),
    ]


class WanDiffusers(DiffusersFormat):
    """The `ReleasedFormat` (models/spec.py) of diffusers' WanTransformer3DModel."""

    class_name = "WanTransformer3DModel"

    def check_config(self, m: WanConfig, config: dict, path: str) -> list[str]:
        def patch_size(theirs, value) -> Optional[str]:
            if theirs == value:
                return None
            fix = (f"set --set model.patch_size_t={theirs[0]} --set model.patch_size={theirs[1]}"
                   if len(theirs) == 3 and theirs[1] == theirs[2] else "square patches only")
            return f"patch_size {show(theirs)} != (model.patch_size_t, model.patch_size) {show(value)}; {fix}"

        def in_channels(theirs, value) -> Optional[str]:
            out = config.get("out_channels", 16)
            if m.expand_timesteps:      # TI2V: the image is in the latent; the out_channels line names the fix
                return None if theirs == out else (
                    f"in_channels {show(theirs)} != out_channels {show(out)}: model.expand_timesteps (Wan 2.2 TI2V) "
                    f"takes the latent alone; a Wan 2.1 / 2.2 A14B image-to-video transformer needs --set "
                    f"model.expand_timesteps=false or its preset")
            i2v = 2 * out + m.vae_scale_temporal
            if theirs == value or ((theirs == i2v) == m.image_condition and out != m.in_channels):
                return None       # equal, or the out_channels line says what to set
            return (
                f"in_channels {show(theirs)} != {value} (model.image_condition {show(m.image_condition)}); set "
                f"--set model.image_condition={show(theirs == i2v)} (image-to-video releases take 2 x out_channels + "
                f"{m.vae_scale_temporal}: noise, mask, image latents) or use the matching preset")

        def image_dim(theirs, value) -> Optional[str]:
            if theirs == value:
                return None
            fix = ("--set model.image_dim=null --set model.added_kv_proj_dim=null" if theirs is None else
                   f"--set model.image_dim={theirs} --set model.added_kv_proj_dim="
                   f"{config.get('added_kv_proj_dim') or m.hidden_size} --set "
                   f"model.image_condition=true --set model.max_text_len={I2V_TEXT_LEN}")
            return (f"image_dim {show(theirs)} != model.image_dim {show(value)}; set {fix} or use the matching preset "
                    f"(wan2.1-i2v-14b-480p, wan2.1-i2v-14b-720p: image-to-video)")

        def added_kv_proj_dim(theirs, value) -> Optional[str]:
            if theirs == value or config.get("image_dim") != m.image_dim:
                return None       # equal, or the image_dim line says what to set
            return (f"added_kv_proj_dim {show(theirs)} with image_dim {show(m.image_dim)} is not supported (the "
                    f"toolkit's Wan model has {show(value)}: the image cross-attention's k/v take the image tokens "
                    f"the image embedder projects to hidden_size, or none without image_dim)")

        return config_problems(_config_pairs(m), config, path, "the toolkit's Wan model has {}; Wan 2.1 "
                               "transformers, text- and image-to-video, qualify",
                               {"patch_size": patch_size, "in_channels": in_channels, "image_dim": image_dim,
                                "added_kv_proj_dim": added_kv_proj_dim})

    def config(self, m: WanConfig, data) -> dict:
        return {key: value for key, _, _, value in _config_pairs(m)}

    def folders(self, m: WanConfig) -> dict[str, str]:
        """Released-name prefix -> the subfolder of model.init_from holding those tensors ("" : the folder)."""
        if m.experts is None:
            return {"": ""}
        if both(m):
            return {f + "/": f for f in FOLDERS}
        return {"": FOLDERS[NAMES.index(m.experts.train)]}

    def pipeline_index(self, m: WanConfig) -> dict | None:
        """Both experts: the pipeline's model_index.json beside transformer/ and transformer_2/, with the
        boundary_ratio between them (read back by `check_folder` and `reference`, and by diffusers'
        from_pretrained, given the pipeline's other components); None for one transformer."""
        if not both(m):
            return None
        return {"_class_name": "WanImageToVideoPipeline" if m.image_condition else "WanPipeline",
                "boundary_ratio": m.experts.boundary_ratio, **{sub: ["diffusers", self.class_name] for sub in FOLDERS}}

    def check_folder(self, m: WanConfig, folder: Path) -> list[str]:
        """A Wan 2.2 A14B release folder for model.experts: transformer/ (and transformer_2/) with their
        config.json, and model_index.json's boundary_ratio equal to model.experts.boundary_ratio."""
        if m.experts is None:
            return []
        what = ("model.experts needs a Wan 2.2 A14B release folder (model_index.json, transformer/ and "
                "transformer_2/, as Wan-AI/Wan2.2-T2V-A14B-Diffusers)")
        if (folder / "config.json").is_file():
            return [f"model.init_from={folder}: a single transformer folder (Wan 2.1, or one expert of a release); "
                    f"{what}; or drop model.experts for a Wan 2.1 transformer"]
        problems = [f"model.init_from={folder}: no {sub}/config.json; {what}"
                    for sub in sorted(set(self.folders(m).values())) if not (folder / sub / "config.json").is_file()]
        if not (folder / "transformer_2").is_dir() and not any("transformer_2" in p for p in problems):
            problems.append(f"model.init_from={folder}: no transformer_2/ (a Wan 2.1 pipeline has one transformer); "
                            f"{what}")
        index = folder / "model_index.json"
        if index.is_file():
            try:
                ratio = json.loads(index.read_text()).get("boundary_ratio")
            except json.JSONDecodeError as e:
                return problems + [f"{index}:{e.lineno}:{e.colno}: malformed JSON: {e.msg}"]
            if ratio is None:
                problems.append(f"{index}: no boundary_ratio (a Wan 2.1 pipeline); {what}")
            elif abs(ratio - m.experts.boundary_ratio) > 1e-9:
                problems.append(f"{index}: boundary_ratio {ratio} != model.experts.boundary_ratio "
                                f"{m.experts.boundary_ratio}; set --set model.experts.boundary_ratio={ratio} or use "
                                f"the matching preset")
        return problems

    def names(self, name: str) -> list[str]:
        prefix, name = split_expert(name)
        return [prefix + n for n in self._names(name)]

    def _names(self, name: str) -> list[str]:
        section, _, rest = name.partition(".")
        if section == "blocks":
            index, _, rest = rest.partition(".")
            prefix = f"blocks.{index}."
            if rest == "scale_shift_table":
                return [prefix + rest]
            module, _, leaf = rest.rpartition(".")
            if module in _FUSED:
                return [f"{prefix}{part}.{leaf}" for part in _FUSED[module]]
            table = _BLOCK
        elif name == "final.scale_shift_table":
            return ["scale_shift_table"]
        else:
            table, prefix = {"embed": _EMBED, "final": _FINAL}.get(section, {}), ""
            module, _, leaf = rest.rpartition(".")
        if module not in table:
            raise KeyError(f"{name} has no counterpart in diffusers' {self.class_name}")
        return [f"{prefix}{table[module]}.{leaf}"]

    def shapes(self, name: str, shape: tuple[int, ...], m: WanConfig) -> dict[str, tuple[int, ...]]:
        sources = self.names(name)
        if split_expert(name)[1] == PATCH_WEIGHT:
            return {sources[0]: (m.hidden_size, m.transformer_in_channels, m.patch_size_t, m.patch_size, m.patch_size)}
        if name.endswith("scale_shift_table"):
            return {sources[0]: (1, *shape)}
        rows = shape[0] // len(sources)
        return {s: (rows, *shape[1:]) for s in sources}

    def reference(self, folder: str, inputs: tuple, place=None) -> torch.Tensor:
        """diffusers' prediction; a Wan 2.2 A14B release folder: each row by the transformer its timestep picks
        (t >= model_index.json's boundary_ratio x 1000: transformer/, else transformer_2/), as WanPipeline."""
        root = Path(folder)
        if not (root / FOLDERS[1]).is_dir():
            return super().reference(folder, inputs, place)
        ratio = json.loads((root / "model_index.json").read_text())["boundary_ratio"]
        high, low = (super(WanDiffusers, self).reference(str(root / sub), inputs, place) for sub in FOLDERS)
        return torch.where((inputs[1] >= ratio * 1000).view(-1, 1, 1, 1, 1), high, low)

    def example_inputs(self, m: WanConfig, data, batch: int, generator) -> tuple:
        """DiffusersFormat's batch; Wan 2.2 TI2V (model.expand_timesteps): a timestep per token, [B, T, H, W] on
        the latent grid (constant within a patch), as training draws them."""
        inputs = super().example_inputs(m, data, batch, generator)
        if not m.expand_timesteps:
            return inputs
        t, h, w = latent_shape(m, data)
        tokens = torch.randint(0, 1000, (batch, t, h // m.patch_size, w // m.patch_size), generator=generator)
        return (inputs[0], tokens.repeat_interleave(m.patch_size, 2).repeat_interleave(m.patch_size, 3), *inputs[2:])

    def reference_call(self, model: torch.nn.Module, inputs: tuple, kwargs: dict) -> torch.Tensor:
        """diffusers' Wan takes and returns [B, C, T, H, W], as the toolkit; image-to-video: the CLIP states
        [B, I, image_dim] as encoder_hidden_states_image; timesteps per latent position [B, T, H, W] (TI2V) as
        the [B, S] per token it takes."""
        latents, timesteps, text, *image = inputs
        if timesteps.dim() == 4:
            pt, ph, pw = model.config.patch_size
            timesteps = timesteps[:, ::pt, ::ph, ::pw].flatten(1)
        return model(hidden_states=latents, timestep=timesteps, encoder_hidden_states=text,
                     encoder_hidden_states_image=image[0] if image else None, **kwargs).sample


DIFFUSERS = WanDiffusers()
