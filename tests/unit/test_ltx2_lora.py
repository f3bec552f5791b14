"""LTX-2 LoRA in one process: random non-zero adapters on the tiny releases (LTX-2.0 and the LTX-2.3 flags), on every
kind of tensor-parallel linear layer (the six attentions of a block: video and audio self-attention, their caption
cross-attentions, audio-to-video and video-to-audio; both FFNs; LTX-2.3's per-head gates) or on some parts of the
fused ones, written as `--format diffusers-lora` writes them (parallel/weights/lora_export.py), are read by
`LTX2Pipeline.load_lora_weights` (LTX2LoraLoaderMixin + peft), and the adapted diffusers model predicts what the
toolkit's model with the same adapters predicts, video and audio (fp32); `--merge-lora`'s tensors (the adapters
folded into the base, parallel/model/lora.py) under diffusers' names predict the same. The checker refuses a target
LTX-2 does not have, naming those it has. Training at tp 2 x sp 2: tests/distributed/test_ltx2_layouts.py.
"""
import copy
import re

import pytest
import torch
from safetensors.torch import load_file

from parallel.distributed.topology import ParallelContext
from parallel.model.lora import LORA_WEIGHTS_NAME, apply_lora, merged_tensors
from parallel.weights.diffusers_export import to_diffusers
from parallel.weights.lora_export import lora_tensors, write_lora
from tests.helpers.ltx2 import diffusers_forward, inputs, overrides, release
from tests.released_utils import nonzero_adapters, read_release, save_release

ATTENTIONS = ["attn1", "audio_attn1", "attn2", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn"]
# Lightricks' ltx-trainer's targets (every attention's q, k, v, out) and its optional FFN ones, video and audio
TRAINER = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2"]
# some parts of the fused layers: the video self-attention's q (of [q; k; v]), the audio's v, video-to-audio's k and
# audio-to-video's v (of [k; v]); the audio caption cross-attention's output
PARTS = ["attn1.to_q", "audio_attn1.to_v", "video_to_audio_attn.to_k", "audio_to_video_attn.to_v",
         "audio_attn2.to_out.0"]
CASES = {"ltx2": TRAINER, "ltx2.3": [*TRAINER, "to_gate_logits"], "parts": PARTS}


def expected_modules(targets: list[str]) -> set[str]:
    """The released modules peft adapts for `targets` (block indices dropped), from the names of the class."""
    modules = [f"{a}.{leaf}" for a in ATTENTIONS for leaf in ("to_q", "to_k", "to_v", "to_out.0", "to_gate_logits")]
    modules += [f"{ff}.{leaf}" for ff in ("ff", "audio_ff") for leaf in ("net.0.proj", "net.2")]
    return {f"transformer_blocks.{n}" for n in modules if any(n == t or n.endswith("." + t) for t in targets)}


@pytest.mark.parametrize("case", list(CASES))
def test_adapters_load_into_the_pipeline_and_predict_the_same(tmp_path, case):
    from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel

    variant = "ltx2" if case == "parts" else case
    theirs = release(variant)
    folder, _ = save_release(tmp_path / "release", theirs, "40KB")
    targets = CASES[case]
    cfg, ours, _ = read_release("debug-ltx2", [*overrides(folder, variant), "model.lora.rank=4", "model.lora.alpha=8",
                                               f"model.lora.targets=[{','.join(targets)}]"], folder)
    apply_lora(ours, cfg.model, cfg.train.seed)
    nonzero_adapters(ours)

    written = write_lora(lora_tensors(ours, ParallelContext.single(), cfg.model), tmp_path / "lora", cfg.model)
    assert written == [tmp_path / "lora" / LORA_WEIGHTS_NAME]
    keys = load_file(str(written[0])).keys()
    assert all(k.startswith("transformer.transformer_blocks.") for k in keys)
    assert {re.sub(r"blocks\.\d+\.", "blocks.", k.split(".", 1)[1].rsplit(".", 2)[0]) for k in keys} \
        == expected_modules([t for t in targets if variant == "ltx2.3" or t != "to_gate_logits"])

    plain = copy.deepcopy(theirs)
    pipe = LTX2Pipeline(scheduler=None, vae=None, audio_vae=None, text_encoder=None, tokenizer=None, connectors=None,
                        transformer=theirs, vocoder=None)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    want = diffusers_forward(theirs, variant)
    with torch.no_grad():
        got = ours.predict(inputs())
    for stream, g, w, p in zip(("video", "audio"), got, want, diffusers_forward(plain, variant)):
        assert not torch.allclose(w, p, atol=1e-3), f"{stream}: the adapters do not act"
        torch.testing.assert_close(g, w, msg=lambda m: f"{case} {stream}: {m}")

    # --merge-lora: W + alpha/r B A, part by part of the fused layers, under diffusers' names (what export writes)
    merged = {k: v for name, t in merged_tensors(iter(ours.state_dict().items()), ours, cfg.model, True)
              for k, v in to_diffusers(name, t, cfg.model).items()}
    plain.load_state_dict(merged, strict=True)
    for stream, g, w in zip(("video", "audio"), diffusers_forward(plain, variant), want):
        torch.testing.assert_close(g, w, msg=lambda m: f"{case} merged {stream}: {m}")
    assert isinstance(plain, LTX2VideoTransformer3DModel)


def test_the_checker_refuses_a_target_ltx2_does_not_have():
    """HunyuanVideo's text-stream name on LTX-2: refused by train.py's checks (load_and_check), with LTX-2's released
    names (the audio and cross-modal attentions' among them), before any process group; ltx-trainer's targets pass."""
    from parallel.check import load_and_check
    from parallel.experiment.config import ConfigError

    with pytest.raises(ConfigError) as refused:
        load_and_check("debug-ltx2", ["model.lora.rank=4", "model.lora.targets=[to_q,add_q_proj]"], None, 1)
    message = str(refused.value)
    assert message.startswith("model.lora.targets: add_q_proj match no tensor-parallel linear layer of "
                              "model.family=ltx2; targets that exist (released module names): attn1.to_k, "
                              "attn1.to_out.0, attn1.to_q, attn1.to_v, attn2.to_k"), message
    names = message.split(": ", 2)[2].split(", ")
    for name in ("audio_to_video_attn.to_q", "video_to_audio_attn.to_out.0", "audio_ff.net.2", "ff.net.0.proj"):
        assert name in names, name
    load_and_check("debug-ltx2", ["model.lora.rank=4", f"model.lora.targets=[{','.join(TRAINER)}]"], None, 1)
