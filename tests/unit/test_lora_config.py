"""model.lora: typed keys, targets checked against the model before any process group (parallel/model/lora.py)."""
import pytest

from parallel.check import load_and_check
from parallel.experiment.config import ConfigError, load_config


def test_unknown_lora_key_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown key model\.lora\.rnak \(did you mean model\.lora\.rank\?\)"):
        load_config("debug", ["model.lora.rank=4", "model.lora.rnak=4"])


def test_default_is_full_fine_tuning_and_alpha_defaults_to_rank():
    assert load_config("debug").model.lora is None
    lora = load_config("debug", ["model.lora.rank=8"]).model.lora
    assert lora.scaling == 1.0 and lora.targets == ["to_q", "to_k", "to_v", "to_out.0"]
    assert load_config("debug", ["model.lora.rank=8", "model.lora.alpha=32"]).model.lora.scaling == 4.0


def test_a_target_matching_nothing_is_named_with_the_names_that_exist():
    with pytest.raises(ConfigError) as e:
        load_and_check("debug", ["model.lora.rank=4", "model.lora.targets=[to_q, to_x, proj_out]"], None, 1)
    message = str(e.value)
    assert "model.lora.targets: to_x, proj_out match no tensor-parallel linear layer" in message
    for name in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "ff.net.0.proj", "ff.net.2"):
        assert name in message
    load_and_check("debug", ["model.lora.rank=4", "model.lora.targets=[to_q, ff.net.2]"], None, 1)   # no error


def test_adapters_start_as_peft_starts_them():
    """A from the seed and the layer's name (the same in every layout), B zero; the base frozen."""
    from parallel.model.build import build_model
    from parallel.distributed.topology import ParallelContext
    cfg = load_config("debug", ["model.lora.rank=4"])
    one, two = (build_model(cfg, {}, ParallelContext.single()) for _ in range(2))
    adapters = {n: p for n, p in one.named_parameters() if p.requires_grad}
    assert sorted({n.rsplit(".", 2)[-2] for n in adapters}) == ["to_out", "to_qkv"] and len(adapters) == 16
    for name, p in two.named_parameters():
        assert p.requires_grad == (name in adapters)
        if name.endswith("lora_B"):
            assert not p.any()
        elif name.endswith("lora_A"):
            assert p.equal(adapters[name]) and p.std() > 0
