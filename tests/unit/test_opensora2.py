"""Open-Sora 2.0 as the HunyuanVideo family with its switches (model.num_refiner_layers 0, guidance_embed false,
text_mask false, cond_embed, rope_theta 10000), in one process:

- where the networks coincide (no cond_in), the toolkit equals diffusers' HunyuanVideoTransformer3DModel built
  without a refiner and guidance embedder and called with every text row a key (the split layouts:
  tests/distributed/test_opensora2_layouts.py);
- a tiny checkpoint written under Open-Sora's tensor names round-trips bit for bit and loads into a model that
  predicts exactly as the one that wrote it;
- where Open-Sora computes otherwise (rotate-half rotary pairing, (shift, scale) head, cond_in's zero condition,
  no text mask, no guidance term), the toolkit reading that checkpoint equals `opensora_forward` below, a
  re-statement of hpcaitech/Open-Sora's MMDiTModel (opensora/models/mmdit/model.py, layers.py, math.py) on
  the checkpoint's own tensors.
"""

import torch
from safetensors.torch import load_file

from parallel.model.build import layer_specs
from parallel.experiment.config import load_config
from parallel.distributed.pipeline import SequentialDiT
from parallel.distributed.topology import ParallelContext
from parallel.weights.diffusers import check_released, load_released
from parallel.weights.gather import full_state
from parallel.weights.opensora import check_opensora, load_opensora, write_opensora
from tests.helpers.opensora2 import (coinciding_release, config, diffusers_prediction, inputs, opensora_forward,
                                     random_model)
from tests.helpers.opensora2 import checkpoint  # noqa: F401  (fixtures)


# ---- Open-Sora 2.0's forward, re-stated on its checkpoint's tensors ----


# ---- the tests ----


def test_where_the_networks_coincide_equals_diffusers(tmp_path):
    """Open-Sora's switches but cond_in: diffusers' HunyuanVideo so built, weights read through model.init_from."""
    theirs = coinciding_release(tmp_path)
    cfg = config(f"model.init_from={tmp_path}")
    ours = SequentialDiT(layer_specs(cfg, ParallelContext.single()))
    read = load_released(ours, ParallelContext.single(), cfg.model, tmp_path)
    assert read == sum(p.numel() for n, p in theirs.named_parameters()
                       if not n.startswith("context_embedder.time_text_embed."))
    with torch.no_grad():
        torch.testing.assert_close(ours.predict(inputs()), diffusers_prediction(theirs))


def test_checkpoint_round_trips_bit_for_bit(checkpoint, tmp_path):
    path, model = checkpoint
    cfg = config("model.cond_embed=true")
    names = load_file(str(path))
    assert "double_blocks.0.img_attn.q_proj.weight" in names and "single_blocks.1.v_mlp.weight" in names
    assert "cond_in.weight" in names and not any(n.startswith("guidance_in") for n in names)
    reread = random_model(cfg, 1)
    assert check_released(cfg.model, path) == []                # model.init_from's path: a .safetensors file
    read = load_released(reread, ParallelContext.single(), cfg.model, path)
    assert read == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(reread.predict(inputs()), model.predict(inputs()))
    again = write_opensora(full_state(reread, ParallelContext.single(), cfg.model.num_layers).items(), cfg.model,
                           tmp_path / "again.safetensors")
    assert again.read_bytes() == path.read_bytes()


def test_toolkit_equals_opensora_forward(checkpoint):
    """The rewrites (rotate-half pairing, the head's (shift, scale)) and switches against Open-Sora's formulas."""
    path, _ = checkpoint
    cfg = config("model.cond_embed=true")
    ours = random_model(cfg, 2)
    load_opensora(ours, ParallelContext.single(), cfg.model, path)
    with torch.no_grad():
        torch.testing.assert_close(ours.predict(inputs()), opensora_forward(load_file(str(path)), *inputs(), heads=4))


def test_wrong_model_refused_by_key(checkpoint):
    path, _ = checkpoint
    problems = check_opensora(config().model, path)             # no cond_embed: cond_in has no place
    assert len(problems) == 1 and "cond_in.weight" in problems[0] and "model.cond_embed" in problems[0]
    problems = check_opensora(load_config("debug-hunyuan").model, path)
    assert problems == [f"{path}: model.num_refiner_layers=1: Open-Sora 2.0 has no token refiner (its text goes "
                        "through one linear, txt_in); set model.num_refiner_layers=0"]
    problems = check_released(load_config("debug-wan").model, path)
    assert problems == [f"{path}: an Open-Sora 2.0 checkpoint loads into model.family: hunyuanvideo with its "
                        "switches (configs/opensora2.0.yaml), not model.family=wan"]
