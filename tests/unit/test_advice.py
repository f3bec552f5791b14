"""Advice in the checker's refusals works when followed: each test runs `python -m parallel.check` (its main(),
in-process) on a config, takes the `--set KEY=VALUE` the refusal suggests, pastes them into bash as printed,
applies the arguments bash makes of them and runs it again, until the config is accepted (a bounded number of
rounds: advice that leads in circles fails)."""
import json
import re
import shlex
import shutil
import subprocess

import pytest

from parallel.check import PREPARE, main
from parallel.experiment.config import load_config
from tests.helpers.prepare_data import CAPTIONS, SETS, vae_dir, videos  # noqa: F401  (fixtures: tiny VAE, clips)
from tests.helpers.text_encoder import t5_dir  # noqa: F401  (fixture: tiny T5)

# `--set` and the word after it as printed: a quoted word whole, an unquoted one up to the sentence's punctuation
SET = re.compile(r"--set ('[^']*'|[^\s'\",;)]+)")


def suggested(err: str) -> list[str]:
    """Every `--set KEY=VALUE` of a refusal, pasted into bash as printed: the KEY=VALUE arguments bash makes of
    them (a value printed with a space in it splits into two words, and fails here)."""
    words = SET.findall(err)
    if not words:
        return []
    argv = subprocess.run(["bash", "-c", "printf '%s\\0' " + " ".join(f"--set {w}" for w in words)],
                          capture_output=True, text=True, check=True).stdout.split("\0")[:-1]
    assert argv[::2] == ["--set"] * len(words) and len(argv) == 2 * len(words), (words, argv)
    return argv[1::2]


def follow(capsys, config: str, sets: list[str], *extra: str, rounds: int = 5) -> tuple[list[str], list[str]]:
    """Run the checker, apply its advice, repeat; returns (the accepted --set list, each round's refusal)."""
    refusals = []
    for _ in range(rounds):
        argv = ["--config", config, *extra] + [a for s in sets for a in ("--set", s)]
        code = main(argv)
        out = capsys.readouterr()
        if code == 0:
            assert out.out.startswith("ok: ")
            return sets, refusals
        advice = suggested(out.err)
        assert advice, f"a refusal without advice:\n{out.err}"
        refusals.append(out.err)
        # a replacement for an unknown key takes its place (as a user edits the command line)
        keys = {a.split("=", 1)[0] for a in advice} | set(re.findall(r"unknown key ([\w.]+)", out.err))
        sets = [s for s in sets if s.split("=", 1)[0] not in keys] + advice
    raise AssertionError(f"still refused after {rounds} rounds of following the advice:\n" + "\n".join(refusals))


@pytest.fixture(scope="module")
def tiny_releases(tmp_path_factory):
    """{family: (folder, config.json)}: a tiny random diffusers transformer of each family (save_pretrained)."""
    from tests.helpers.hunyuanvideo import released_model as hunyuan_model
    from tests.helpers.hunyuanvideo15 import released_model as hunyuan15_model
    from tests.helpers.released_weights import released_model as cogvideox_model
    from tests.helpers.wan import released_model as wan_model
    from tests.helpers.wan_i2v import released_model as wan_i2v_model
    out = {}
    for family, model in (("cogvideox", cogvideox_model("sincos")), ("wan", wan_model()), ("wan-i2v", wan_i2v_model()),
                          ("hunyuanvideo", hunyuan_model()), ("hunyuanvideo15", hunyuan15_model())):
        folder = tmp_path_factory.mktemp(family)
        model.save_pretrained(folder)
        out[family] = folder, json.loads((folder / "config.json").read_text())
    return out


@pytest.mark.parametrize("preset, family", [
    ("cogvideox-5b", "cogvideox"), ("cogvideox-2b", "cogvideox"), ("cogvideox1.5-5b", "cogvideox"),
    ("cogvideox-5b-long", "cogvideox"), ("wan2.1-t2v-1.3b", "wan"), ("wan2.1-t2v-14b", "wan"),
    ("wan2.1-i2v-14b-480p", "wan-i2v"), ("hunyuanvideo-t2v", "hunyuanvideo"),
    ("hunyuanvideo1.5-t2v-480p", "hunyuanvideo15")])
def test_a_preset_pointed_at_a_release_of_another_size_is_accepted_by_following_the_advice(
        capsys, tiny_releases, preset, family):
    """The released config.json's keys, with what they imply (hidden = heads x head_dim, the FFN width of the
    release's mlp_ratio at that hidden, lists such as rope_axes_dim as one shell word) and what the preset's
    layout no longer fits (cogvideox-5b-long's tp 2 x sp 2 on 2 heads), in one round; then accepted."""
    folder, config = tiny_releases[family]
    sets, refusals = follow(capsys, preset, [f"model.init_from={folder}"])
    heads, dim = config["num_attention_heads"], config["attention_head_dim"]
    assert (f"num_attention_heads x attention_head_dim = {heads} x {dim} = {heads * dim} != model.hidden_size "
            in refusals[0]) and f"set --set model.hidden_size={heads * dim}\n" in refusals[0]
    assert len(refusals) == 1, refusals
    accepted = dict(s.split("=", 1) for s in sets)
    heads, dim = config["num_attention_heads"], config["attention_head_dim"]
    assert (accepted["model.num_heads"], accepted["model.head_dim"]) == (str(heads), str(dim))
    assert accepted["model.hidden_size"] == str(heads * dim)
    # HunyuanVideo's model.num_layers counts its dual- and single-stream blocks
    assert accepted["model.num_layers"] == str(config["num_layers"] + config.get("num_single_layers", 0))
    if "rope_axes_dim" in config:        # a list, printed as one shell word
        assert list(load_config(preset, sets).model.rope_axes_dim) == config["rope_axes_dim"]


def test_layout_refusals_suggest_the_nearest_size_that_works(capsys):
    """tp, sp and pp refusals each name the largest working size not above the one asked for."""
    sets, refusals = follow(capsys, "cogvideox-2b", ["parallel.tp_size=4", "parallel.pp_size=4"])
    assert "--set parallel.tp_size=3" in refusals[0] and "--set parallel.pp_size=3" in refusals[0]
    assert sets == ["parallel.tp_size=3", "parallel.pp_size=3"]
    # 30 heads: sp 4 runs as Ulysses 2 x ring 2 unasked; all-Ulysses asked for, the advice is the ring pair
    sets, refusals = follow(capsys, "cogvideox-2b", ["parallel.sp_size=4"])
    assert sets == ["parallel.sp_size=4"] and not refusals
    sets, refusals = follow(capsys, "cogvideox-2b", ["parallel.sp_size=4", "parallel.ring_size=1"])
    assert sets == ["parallel.sp_size=4", "parallel.ring_size=2"] and "ulysses 2 x ring 2" in refusals[0]
    # STDiT's attentions take no ring: the nearest sp its 16 heads divide
    sets, refusals = follow(capsys, "opensora-stdit3", ["parallel.sp_size=6"], "--world-size", "12")
    assert sets == ["parallel.sp_size=4"] and "sp sizes that work with parallel.tp_size=1: 1, 2, 4" in refusals[0]
    sets, refusals = follow(capsys, "debug", ["parallel.dp_size=2"], "--world-size", "4")
    assert sets == ["parallel.dp_size=4"]


@pytest.mark.parametrize("given, accepted, value", [
    # "did you mean train.min_lr?" was the closest spelling; following it set the floor, not the rate
    ("train.learning_rate=0.0003", "train.lr=0.0003", ("train", "lr", 3e-4)),
    ("train.batch_size=2", "train.micro_batch_size=2", ("train", "micro_batch_size", 2)),
    ("parallel.tp=2", "parallel.tp_size=2", ("parallel", "tp_size", 2)),
    # a floor above the rate was accepted (the cosine would climb); the advice is a tenth of train.lr (0.003)
    ("train.min_lr=0.01", "train.min_lr=0.0003", ("train", "min_lr", 3e-4)),
    # YAML reads gif,mp4 as one string: the list syntax, quoted for the shell
    ("val.formats=gif,mp4", "val.formats=[gif,mp4]", ("val", "formats", ["gif", "mp4"])),
])
def test_misleading_messages_now_lead_to_the_key_meant(capsys, given, accepted, value):
    sets, refusals = follow(capsys, "debug", [given])
    assert sets == [accepted] and len(refusals) == 1
    section, key, want = value
    assert getattr(getattr(load_config("debug", sets), section), key) == want


def test_a_learning_rate_below_its_floor_follows_to_an_accepted_pair(capsys):
    """learning_rate -> lr first; the preset's min_lr then sits above it -> a tenth of it."""
    sets, refusals = follow(capsys, "debug", ["train.learning_rate=1e-5", "train.min_lr=1e-4"])
    cfg = load_config("debug", sets)
    assert (cfg.train.lr, cfg.train.min_lr) == (1e-5, 1e-6) and len(refusals) == 2


def test_a_data_folder_with_synthetic_data_and_a_missing_folder_lead_to_prepare_data(
        capsys, tmp_path, videos, vae_dir, t5_dir): 
    """data.path with the synthetic data.kind was ignored silently: refused naming data.kind=directory. A folder
    that does not exist was "no manifest.jsonl in it": now named, with the prepare_data command that makes it;
    run as printed (placeholders filled), the checker accepts the folder it wrote."""
    folder = tmp_path / "clips"
    sets = SETS + [f"data.path={folder}"]
    code = main(["--config", "debug", *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert code == 1 and suggested(err) == ["data.kind=directory"]
    sets.append("data.kind=directory")
    flags = [a for s in sets for a in ("--set", s)]
    code = main(["--config", "debug", *flags])
    err = capsys.readouterr().err
    assert code == 1 and f"data.path={folder}: no such folder; {PREPARE.format(folder)} prepares it" in err
    command = shlex.split(PREPARE.format(folder))
    assert command[:3] == ["python", "-m", "parallel.prepare_data"]
    clips = tmp_path / "videos"          # the default captions: a .txt beside each video
    shutil.copytree(videos[0], clips)
    for name, caption in CAPTIONS.items():
        (clips / name).with_suffix(".txt").write_text(caption)
    fill = {"CONFIG": "debug", "VIDEOS": str(clips), "VAE": str(vae_dir), "T5": str(t5_dir)}
    from parallel.prepare_data.prepare import main as prepare
    assert prepare([fill.get(a, a) for a in command[3:]] + flags) == 0
    capsys.readouterr()
    assert main(["--config", "debug", *flags]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("ok: debug")
