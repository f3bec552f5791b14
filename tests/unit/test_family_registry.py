"""Families registered at run time (models.registry.register, the experiment's `families:` list) and the
FamilySpec rules every family obeys. The toy family of tests/toy_family is the one registered here; each test
leaves the registry as it found it (`toy_registry`), so the built-in families' messages stay as they are."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from parallel.experiment.config import ConfigError, load_config
from tests.helpers.family_registry import toy_registry

TOY = "tests/toy_family/debug-toy.yaml"


@pytest.fixture
def registry():
    with toy_registry():
        yield


def test_every_builtin_spec_names_its_own_pipeline():
    """No format left to a default: each family names its VAE format, text encoder, released format, timesteps and
    samplers (a FamilySpec without them is refused by the dataclass), and the formats are the families' own. A
    family fills at most 10 required fields: the rest is grouped by concern (network, planner costs, wording,
    formats), each group's fields required unless most families share a value."""
    from models.registry import FAMILIES, text_encoder_formats, vae_formats
    from models.spec import Costs, FamilySpec, Formats, Network, Wording

    def fields(cls, required):
        return [f.name for f in dataclasses.fields(cls)
                if (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING) == required]
    assert fields(FamilySpec, True) == ["name", "config", "network", "costs", "wording", "formats", "timesteps",
                                        "sampling"]
    assert len(fields(FamilySpec, True)) <= 10
    # optional: text-to-video; one transformer unless a family lists experts; one noised stream unless two (LTX-2)
    assert fields(FamilySpec, False) == ["condition", "experts", "second_stream"]
    assert {cls.__name__: fields(cls, False) for cls in (Network, Costs, Wording, Formats)} == {
        "Network": ["streams"], "Costs": ["attentions_per_layer"], "Wording": ["layer_noun"],
        "Formats": ["checkpoint"]}
    assert fields(Formats, True) == ["vae", "text_encoder", "released"]
    assert {n: s.formats.vae.class_name for n, s in FAMILIES.items()} == {
        "cogvideox": "AutoencoderKLCogVideoX", "hunyuanvideo": "AutoencoderKLHunyuanVideo",
        "hunyuanvideo15": "AutoencoderKLHunyuanVideo15", "ltx2": "AutoencoderKLLTX2Video",
        "stdit": "AutoencoderKLCogVideoX", "wan": "AutoencoderKLWan"}
    assert sorted(vae_formats()) == ["AutoencoderKLCogVideoX", "AutoencoderKLHunyuanVideo",
                                     "AutoencoderKLHunyuanVideo15", "AutoencoderKLLTX2Video", "AutoencoderKLWan"]
    assert sorted(text_encoder_formats()) == ["T5EncoderModel", "UMT5EncoderModel"]     # HunyuanVideo's: not yet


def test_register_refuses_a_taken_name_and_a_config_of_another_family(registry):
    from models.registry import FAMILIES, register
    from models.stdit.config import STDiTConfig
    spec = FAMILIES["stdit"]
    assert register(spec) is spec                                      # the same spec again: nothing changes
    with pytest.raises(ValueError, match="a family named 'stdit' is already registered; choose another name"):
        register(dataclasses.replace(spec, condition=lambda m, d: None))
    with pytest.raises(ValueError, match=r"its config STDiTConfig must declare family: Literal\['other'\] = 'other'"):
        register(dataclasses.replace(spec, name="other", config=STDiTConfig))


def test_experts_are_chosen_by_timestep(registry):
    from models.spec import Expert
    from tests.toy_family import SPEC
    t = torch.tensor([999, 500, 499.5, 0])
    assert SPEC.expert(t).tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="must fall strictly, ending at 0"):
        dataclasses.replace(SPEC, experts=(Expert("a", 0), Expert("b", 500)))


def test_a_family_outside_models_is_named_by_the_experiment(registry, tmp_path):
    """model.family of an unregistered family names the families: key; a module that does not import is
    named with the file and the key; following either piece of advice loads the experiment."""
    tree = yaml.safe_load(open(TOY))
    without = tmp_path / "without.yaml"
    without.write_text(yaml.safe_dump({k: v for k, v in tree.items() if k != "families"}))
    with pytest.raises(ConfigError) as e:
        load_config(without)
    assert str(e.value).startswith(f"{without}: model.family='toy' is not a model family; families: cogvideox, "
                                   "hunyuanvideo, hunyuanvideo15, ltx2, stdit, wan (a family kept outside models/ is registered by a module the "
                                   "experiment names under families:")
    missing = tmp_path / "missing.yaml"
    missing.write_text(yaml.safe_dump({**tree, "families": ["tests.no_such_family"]}))
    with pytest.raises(ConfigError) as e:
        load_config(missing)
    assert str(e.value).startswith(f"{missing}: families: cannot import 'tests.no_such_family' (No module named "
                                   "'tests.no_such_family'); give a module importable from the working directory "
                                   "or PYTHONPATH that calls models.registry.register")
    cfg = load_config(without, ["families=[tests.toy_family]"])          # the advice, followed
    assert cfg.model.family == "toy" and type(cfg.model).__name__ == "ToyConfig"
    assert load_config(TOY).model == cfg.model


def test_the_checker_refuses_an_objective_the_family_does_not_sample(registry):
    """A family that samples v_prediction only: flow_matching is refused by the checker, and the --set it
    names is accepted."""
    from models.registry import FAMILIES
    from models.spec import Sampling
    from parallel.check import check
    load_config(TOY)
    FAMILIES["toy"] = dataclasses.replace(FAMILIES["toy"], sampling=Sampling({"v_prediction": ("ddim",)}, None))
    _, problems = check(load_config(TOY, ["model.objective=flow_matching"]), world_size=1)
    assert problems == ["model.objective=flow_matching: model.family=toy samples v_prediction only; set --set "
                        "model.objective=v_prediction"]
    _, problems = check(load_config(TOY, ["model.objective=flow_matching", "model.objective=v_prediction"]),
                        world_size=1)
    assert problems == []


def test_python_m_models_names_a_familys_timesteps_and_experts(registry, capsys):
    from models.__main__ import main
    assert main(["--config", TOY]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("[")]   # DeepSpeed's log
    assert lines[0].startswith("model: debug-toy (toy), 2 blocks (2 timestep experts in each MLP)")
    assert lines[-1] == ("timesteps: one per token; experts by timestep: high_noise (t >= 500), "
                                    "low_noise (t >= 0)")
    assert main(["--config", "debug-stdit"]) == 0
    assert "timesteps:" not in capsys.readouterr().out          # the built-ins: one per sample, no experts
