"""The released (diffusers) names of the layers HunyuanVideo and HunyuanVideo 1.5 share (models/shared/mmdit.py,
models/shared/refiner.py): the dual- and single-stream blocks, the token refiner and the head, and the
mlp_ratio check both families' configs take.

    toolkit                              diffusers
    embed.refiner.j.*                    context_embedder.token_refiner.refiner_blocks.j.* (to_qkv: attn.to_{q,k,v};
                                         to_out: attn.to_out.0; ff_in/out: ff.net.0.proj / ff.net.2; norm_out: .linear)
    blocks.i (i < D, dual-stream)        transformer_blocks.i: norm1{,_context}.linear, attn.to_{q,k,v} (to_qkv),
                                         attn.add_{q,k,v}_proj (add_qkv), attn.to_out.0, attn.to_add_out,
                                         attn.norm_{q,k,added_q,added_k}.weight, ff{,_context}.net.{0.proj,2}
    blocks.i (i >= D, single-stream)     single_transformer_blocks.(i - D): norm.linear, attn.to_{q,k,v} + proj_mlp
                                         (proj_in, rows fused), proj_out, attn.norm_{q,k}.weight
    final.norm_out_linear / proj_out     norm_out.linear / proj_out
"""
from __future__ import annotations

from typing import Optional

_REFINER = {"norm1": "norm1", "to_out": "attn.to_out.0", "norm2": "norm2", "ff_in": "ff.net.0.proj",
            "ff_out": "ff.net.2", "norm_out": "norm_out.linear", "to_qkv": ("attn.to_q", "attn.to_k", "attn.to_v")}
_DUAL = {"norm1": "norm1.linear", "norm1_context": "norm1_context.linear", "to_out": "attn.to_out.0",
         "to_add_out": "attn.to_add_out", "ff_in": "ff.net.0.proj", "ff_out": "ff.net.2",
         "ff_context_in": "ff_context.net.0.proj", "ff_context_out": "ff_context.net.2",
         "to_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
         "add_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_SINGLE = {"norm": "norm.linear", "proj_out": "proj_out", "proj_in": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
_NORMS = {"attn.norm_q": "attn.norm_q.weight", "attn.norm_k": "attn.norm_k.weight",
          "attn.norm_added_q": "attn.norm_added_q.weight", "attn.norm_added_k": "attn.norm_added_k.weight"}
_FINAL = {"norm_out_linear": "norm_out.linear", "proj_out": "proj_out"}


def mlp_ratio_check(m, hidden: Optional[int] = None):
    """config_problems' message for mlp_ratio (HunyuanVideo and 1.5): diffusers' mlp_ratio is the toolkit's
    ffn_hidden_size / hidden_size (its MLP width: int(hidden x ratio)); `hidden`: the release's width
    (release_hidden_size), which the advice is for, default the section's."""
    def mlp_ratio(theirs, value) -> Optional[str]:
        return None if theirs == value else (f"mlp_ratio {theirs} != model.ffn_hidden_size / model.hidden_size "
                                             f"{value}; set --set model.ffn_hidden_size="
                                             f"{int((hidden or m.hidden_size) * theirs)}")
    return mlp_ratio


def mmdit_names(name: str, num_dual: int, embed: dict, class_name: str) -> list[str]:
    """A toolkit tensor name's released names: `blocks.i` (dual-stream below num_dual, single-stream from there),
    the refiner's `embed.refiner.j`, `final`; the other `embed` modules by the family's table `embed`."""
    section, _, rest = name.partition(".")
    module, _, leaf = rest.rpartition(".")
    if section == "blocks":
        index, _, rest = rest.partition(".")
        i = int(index)
        dual = i < num_dual
        prefix = f"transformer_blocks.{i}." if dual else f"single_transformer_blocks.{i - num_dual}."
        if rest in _NORMS:
            return [prefix + _NORMS[rest]]
        module, _, leaf = rest.rpartition(".")
        table = _DUAL if dual else _SINGLE
    elif section == "embed" and rest.startswith("refiner."):
        j, _, rest = rest[len("refiner."):].partition(".")
        prefix, table = f"context_embedder.token_refiner.refiner_blocks.{j}.", _REFINER
        module, _, leaf = rest.rpartition(".")
    else:
        table, prefix = {"embed": embed, "final": _FINAL}.get(section, {}), ""
    if module not in table:
        raise KeyError(f"{name} has no counterpart in diffusers' {class_name}")
    target = table[module]
    return [f"{prefix}{t}.{leaf}" for t in target] if isinstance(target, tuple) else [f"{prefix}{target}.{leaf}"]
