"""Experiment config: presets load, overrides apply, and bad input is refused naming file and key."""
import pytest
import yaml

from parallel.experiment.config import CONFIG_DIR, ConfigError, ExperimentConfig, load_config


def test_presets_carry_the_published_dimensions():
    m2 = load_config("cogvideox-2b").model
    assert (m2.num_layers, m2.hidden_size, m2.num_heads, m2.head_dim, m2.ffn_size) == (30, 1920, 30, 64, 7680)
    m5 = load_config("cogvideox-5b").model
    assert (m5.num_layers, m5.hidden_size, m5.num_heads, m5.pos_embed) == (42, 3072, 48, "rope3d")
    st = load_config("opensora-stdit3").model
    assert (st.num_layers, st.hidden_size, st.num_heads, st.head_dim) == (28, 1152, 16, 72)
    assert (st.family, st.pos_embed) == ("stdit", "sincos2d_rope1d")
    assert load_config("debug").model.num_layers == 4


def test_overrides_are_typed_and_nested():
    cfg = load_config("configs/debug.yaml", ["parallel.tp_size=2", "train.lr=3e-4", "parallel.pp_partition=[1, 3]"])
    assert cfg.parallel.tp_size == 2 and cfg.train.lr == 3e-4 and cfg.parallel.pp_partition == [1, 3]


@pytest.mark.parametrize("override, expected", [
    ("parallel.tp_sise=2", "--set: unknown key parallel.tp_sise (did you mean parallel.tp_size?)"),
    ("model.num_heads=four", "--set: model.num_heads: Input should be a valid integer"),
    ("train.lr=-1", "--set: train.lr: Input should be greater than 0"),
    ("parallel.tp_size=0", "--set: parallel.tp_size: Input should be greater than or equal to 1"),
    ("model.head_dim=17", "model.num_heads x model.head_dim = 4 x 17 = 68 must equal model.hidden_size=64"),
    ("data.kind=directory", "data.kind=directory needs data.path"),
    ("tp_size", "expected dotted.key=value"),
    ("model.pos_embed=sincos2d_rope1d", "model.pos_embed=sincos2d_rope1d does not fit model.family=cogvideox; "
                                        "use model.pos_embed=sincos or rope3d"),
])
def test_bad_overrides_name_the_key(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config("debug", [override])
    assert expected in str(e.value)


def test_unknown_key_in_file_names_the_file(tmp_path):
    path = tmp_path / "exp.yaml"
    text = (CONFIG_DIR / "debug.yaml").read_text()
    path.write_text(text.replace("  tp_size: 1", "  tp_size: 1\n  tensor_parallel: 2"))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert f"{path}: unknown key parallel.tensor_parallel" in str(e.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as e:
        load_config("debug", ["parallel.tp_size=x", "train.max_steps=-3", "model.bogus=1"])
    assert len(str(e.value).splitlines()) == 3


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  num_layers: 2\n  hidden_size: [64\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path}:4:")


def test_missing_file_lists_presets():
    with pytest.raises(ConfigError) as e:
        load_config("cogvideox-3b")
    assert "cogvideox-2b" in str(e.value) and "debug" in str(e.value)


def test_stdit_positions_default_to_its_own_and_refuse_cogvideox_ones(tmp_path):
    path = tmp_path / "stdit.yaml"
    path.write_text((CONFIG_DIR / "debug-stdit.yaml").read_text().replace("  pos_embed: sincos2d_rope1d\n", ""))
    assert load_config(path).model.pos_embed == "sincos2d_rope1d"
    with pytest.raises(ConfigError) as e:
        load_config(path, ["model.pos_embed=rope3d"])
    assert "model.pos_embed=rope3d does not fit model.family=stdit; use model.pos_embed=sincos2d_rope1d" in str(e.value)


def test_the_model_section_is_its_familys_own():
    """Each family's `model:` section has its own keys (models/<family>/config.py): a key of another
    family is refused naming both families, an unknown family naming the ones there are, and the
    family defaults to cogvideox when left out."""
    from models.cogvideox.config import CogVideoXConfig
    from models.stdit.config import STDiTConfig
    assert type(load_config("debug").model) is CogVideoXConfig and type(load_config("debug-stdit").model) is STDiTConfig
    with pytest.raises(ConfigError) as e:
        load_config("debug-stdit", ["model.sample_height=30"])
    assert str(e.value) == ("--set: model.sample_height is a key of model.family=cogvideox, not of "
                            "model.family=stdit; remove it")
    with pytest.raises(ConfigError) as e:
        load_config("debug", ["model.family=sora"])
    assert str(e.value) == ("--set: model.family='sora' is not a model family; families: cogvideox, hunyuanvideo, "
                            "hunyuanvideo15, ltx2, stdit, wan (a family kept outside models/ is registered by a module the "
                            "experiment names under families:, docs/architecture.md)")
    tree = yaml.safe_load((CONFIG_DIR / "debug.yaml").read_text())
    del tree["model"]["family"]
    assert ExperimentConfig.model_validate(tree).model == load_config("debug").model
