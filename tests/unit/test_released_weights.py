"""Released weights in the diffusers layout, at tiny random CogVideoX configs: both position variants
(sin-cos like 2B, 3D RoPE like 5B) written by `save_pretrained` (the `released` fixture); wrong configs and
incomplete folders are refused with the names. Forward in every (tp, pp) layout and the exports, in 4
gloo ranks: tests/distributed/test_released_weights_layouts.py.
"""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.check import load_and_check
from parallel.experiment.config import ConfigError, load_config
from parallel.weights.diffusers import INDEX_NAME, check_released, load_released
from tests.helpers.released_weights import overrides
from tests.helpers.released_weights import released  # noqa: F401  (fixtures)


def test_wrong_config_is_refused_with_the_keys(released):
    folder, _ = released["sincos"]
    cfg = load_config("debug", overrides("sincos", folder) + ["model.num_heads=4", "model.head_dim=8"])
    problems = check_released(cfg.model, folder)
    config = folder / "config.json"
    assert f"{config}: num_attention_heads 2 != model.num_heads 4; set --set model.num_heads=2 or use the " \
           f"matching preset" in problems
    assert any(p.startswith(f"{config}: attention_head_dim 16 != model.head_dim 8") for p in problems)
    cfg = load_config("debug", overrides("rope3d", folder))
    assert check_released(cfg.model, folder) == [
        f"{config}: sample_width 8 != model.sample_width 12; set --set model.sample_width=8 or use the matching preset",
        f"{config}: use_rotary_positional_embeddings false != model.pos_embed rope3d; set --set model.pos_embed=sincos"]
    # train.py's path: refused in load_and_check, before any process group, with the others' problems.
    with pytest.raises(ConfigError, match="num_attention_heads 2 != model.num_heads 4"):
        load_and_check("debug", overrides("sincos", folder) + ["model.num_heads=4", "model.head_dim=8"],
                       "ds_configs/zero0_fp32.json", 1)


def test_missing_and_unexpected_tensors_are_listed(released, tmp_path):
    source, _ = released["sincos"]
    folder = tmp_path / "broken"
    shutil.copytree(source, folder)
    index = json.loads((folder / INDEX_NAME).read_text())
    gone = "transformer_blocks.1.attn1.norm_k.bias"
    shard = folder / index["weight_map"][gone]
    tensors = load_file(str(shard))
    del tensors[gone]
    tensors["transformer_blocks.1.attn1.to_added.weight"] = torch.zeros(2)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    del index["weight_map"][gone]
    index["weight_map"]["transformer_blocks.1.attn1.to_added.weight"] = shard.name
    (folder / INDEX_NAME).write_text(json.dumps(index))
    cfg = load_config("debug", overrides("sincos", folder))
    assert check_released(cfg.model, folder) == [
        f"{folder}: 1 tensors of CogVideoXTransformer3DModel are missing: {gone}",
        f"{folder}: 1 tensors have no place in the toolkit's model: transformer_blocks.1.attn1.to_added.weight"]
    from parallel.model.build import layer_specs
    from parallel.distributed.pipeline import SequentialDiT
    from parallel.distributed.topology import ParallelContext
    model = SequentialDiT(layer_specs(cfg, ParallelContext.single()))
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"missing: {gone}"):
        load_released(model, ParallelContext.single(), cfg.model, folder)
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())     # nothing loaded
    (folder / INDEX_NAME).unlink()
    assert check_released(cfg.model, folder)[0].startswith(
        f"{folder}: expected diffusion_pytorch_model.safetensors, or shards with {INDEX_NAME} (found: ")
