"""HunyuanVideo and HunyuanVideo 1.5 LoRA exports load into diffusers, in one process: random non-zero adapters on
the attention of both kinds of block (dual-stream image and text streams, single-stream fused q/k/v + MLP rows and
output; the token refiner is replicated and takes none, docs/lora.md), written as --format diffusers-lora writes them
(parallel/weights/lora_export.py), are read by diffusers + peft (HunyuanVideoPipeline.load_lora_weights;
HunyuanVideo15Transformer3DModel.load_lora_adapter, its pipeline has no LoRA loader in diffusers 0.42.1), and the
adapted diffusers model predicts what the toolkit's model with the same adapters predicts (fp32).
"""
import copy
import re

import pytest
import torch
from safetensors.torch import load_file

from parallel.model.build import layer_specs
from parallel.experiment.config import load_config
from parallel.distributed.pipeline import SequentialDiT
from parallel.distributed.topology import ParallelContext
from parallel.model.lora import LORA_WEIGHTS_NAME, apply_lora
from parallel.weights.diffusers import load_released
from parallel.weights.lora_export import lora_tensors, write_lora
from tests.released_utils import nonzero_adapters
from tests.helpers import hunyuanvideo as hy
from tests.helpers import hunyuanvideo15 as hy15

# the defaults, the text stream's q/k/v and output (dual-stream blocks), the single-stream blocks' MLP rows and output
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "proj_mlp",
           "proj_out"]
# some parts of each fused layer, not in a row: to_qkv's q and v, add_qkv's k, the single blocks' q, v and MLP rows
PARTS = ["to_q", "to_v", "add_k_proj", "proj_mlp", "to_out.0"]
DUAL = {"to_q": "attn.to_q", "to_k": "attn.to_k", "to_v": "attn.to_v", "to_out.0": "attn.to_out.0",
        "add_q_proj": "attn.add_q_proj", "add_k_proj": "attn.add_k_proj", "add_v_proj": "attn.add_v_proj",
        "to_add_out": "attn.to_add_out"}
SINGLE = {"to_q": "attn.to_q", "to_k": "attn.to_k", "to_v": "attn.to_v", "proj_mlp": "proj_mlp",
          "proj_out": "proj_out"}


def adapted(preset: str, folder, extra: list[str], targets: list[str]):
    """(toolkit model loaded from the release folder with adapters, B made non-zero; its config)."""
    cfg = load_config(preset, [*extra, "model.lora.rank=4", "model.lora.alpha=8",
                               f"model.lora.targets=[{','.join(targets)}]"])
    ours = SequentialDiT(layer_specs(cfg, ParallelContext.single()))
    load_released(ours, ParallelContext.single(), cfg.model, folder)
    apply_lora(ours, cfg.model, cfg.train.seed)
    nonzero_adapters(ours)
    return ours, cfg


def export(ours, cfg, out) -> set[str]:
    """Write the adapters as --format diffusers-lora does; the adapted released modules, block indices dropped
    (`transformer_blocks.attn.to_q`): the token refiner's attention (replicated, not tensor-parallel) has none."""
    written = write_lora(lora_tensors(ours, ParallelContext.single(), cfg.model), out, cfg.model)
    assert written == [out / LORA_WEIGHTS_NAME]
    keys = load_file(str(written[0])).keys()
    assert all(k.startswith("transformer.") for k in keys)
    return {re.sub(r"blocks\.\d+\.", "blocks.", k.split(".", 1)[1].rsplit(".", 2)[0]) for k in keys}


@pytest.mark.parametrize("targets", [TARGETS, PARTS], ids=["all", "parts"])
def test_hunyuanvideo_adapters_load_into_the_pipeline_and_predict_the_same(tmp_path, targets):
    from diffusers import HunyuanVideoPipeline

    release = hy.released_model()
    release.save_pretrained(tmp_path / "release")
    ours, cfg = adapted("debug-hunyuan", tmp_path / "release", hy.overrides(tmp_path / "release"), targets)
    assert export(ours, cfg, tmp_path / "lora") == {
        *(f"transformer_blocks.{DUAL[t]}" for t in targets if t in DUAL),
        *(f"single_transformer_blocks.{SINGLE[t]}" for t in targets if t in SINGLE)}
    plain = copy.deepcopy(release)
    pipe = HunyuanVideoPipeline(text_encoder=None, tokenizer=None, transformer=release, vae=None, scheduler=None,
                                text_encoder_2=None, tokenizer_2=None)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    want = hy.diffusers_forward(release, *hy.inputs())
    assert not torch.allclose(want, hy.diffusers_forward(plain, *hy.inputs()), atol=1e-3)     # the adapters act
    with torch.no_grad():
        torch.testing.assert_close(ours.predict(hy.inputs()), want)


def test_hunyuanvideo15_adapters_load_into_the_transformer_and_predict_the_same(tmp_path):
    """Every block dual-stream; text-to-video and image-to-video inputs."""
    release = hy15.released_model()
    release.save_pretrained(tmp_path / "release")
    ours, cfg = adapted("debug-hunyuan15", tmp_path / "release", hy15.overrides(tmp_path / "release"), TARGETS)
    assert export(ours, cfg, tmp_path / "lora") == {f"transformer_blocks.{n}" for n in DUAL.values()}
    plain = copy.deepcopy(release)
    release.load_lora_adapter(str(tmp_path / "lora"), prefix="transformer", weight_name=LORA_WEIGHTS_NAME)
    for i2v in (False, True):
        want = hy15.diffusers_forward(release, hy15.inputs(i2v))
        assert not torch.allclose(want, hy15.diffusers_forward(plain, hy15.inputs(i2v)), atol=1e-3)
        with torch.no_grad():
            torch.testing.assert_close(ours.predict(hy15.inputs(i2v)), want, msg=lambda m: f"i2v={i2v}: {m}")
