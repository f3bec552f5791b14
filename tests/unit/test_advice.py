"""Advice in the checker's refusals works when followed: each test runs `python -m parallel.check` (its main(),
in-process) on a config, takes the `--set KEY=VALUE` the refusal suggests, applies them and runs it again,
until the config is accepted (a bounded number of rounds: advice that leads in circles fails)."""
import json
import re

import pytest

from parallel.check import main

SET = re.compile(r"--set '?([\w.]+=[^\s',;]+|[\w.]+=\[[^\]]*\])'?")


def suggested(err: str) -> list[str]:
    """Every `--set KEY=VALUE` of a refusal (quoted or not, without the sentence's punctuation)."""
    return SET.findall(err)


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
        keys = {a.split("=", 1)[0] for a in advice}
        sets = [s for s in sets if s.split("=", 1)[0] not in keys] + advice
    raise AssertionError(f"still refused after {rounds} rounds of following the advice:\n" + "\n".join(refusals))


@pytest.fixture(scope="module")
def tiny_releases(tmp_path_factory):
    """{family: (folder, config.json)}: a tiny random diffusers transformer of each family (save_pretrained)."""
    from tests.unit.test_released_weights import released_model as cogvideox_model
    from tests.unit.test_wan import released_model as wan_model
    out = {}
    for family, model in (("cogvideox", cogvideox_model("sincos")), ("wan", wan_model())):
        folder = tmp_path_factory.mktemp(family)
        model.save_pretrained(folder)
        out[family] = folder, json.loads((folder / "config.json").read_text())
    return out


@pytest.mark.parametrize("preset, family", [
    ("cogvideox-5b", "cogvideox"), ("cogvideox-2b", "cogvideox"), ("cogvideox1.5-5b", "cogvideox"),
    ("cogvideox-5b-long", "cogvideox"), ("wan2.1-t2v-1.3b", "wan"), ("wan2.1-t2v-14b", "wan")])
def test_a_preset_pointed_at_a_release_of_another_size_is_accepted_by_following_the_advice(
        capsys, tiny_releases, preset, family):
    """The released config.json's keys first; then what they imply (hidden = heads x head_dim) and what the
    preset's layout no longer fits (cogvideox-5b-long's tp 2 x sp 2 on 2 heads); then accepted."""
    folder, config = tiny_releases[family]
    sets, refusals = follow(capsys, preset, [f"model.init_from={folder}"])
    assert len(refusals) >= 2                       # the release's keys, then what they imply
    accepted = dict(s.split("=", 1) for s in sets)
    heads, dim = config["num_attention_heads"], config["attention_head_dim"]
    assert (accepted["model.num_heads"], accepted["model.head_dim"]) == (str(heads), str(dim))
    assert accepted["model.hidden_size"] == str(heads * dim)
    assert accepted["model.num_layers"] == str(config["num_layers"])


def test_layout_refusals_suggest_the_nearest_size_that_works(capsys):
    """tp, sp and pp refusals each name the largest working size not above the one asked for."""
    sets, refusals = follow(capsys, "cogvideox-2b", ["parallel.tp_size=4", "parallel.pp_size=4"])
    assert "--set parallel.tp_size=3" in refusals[0] and "--set parallel.pp_size=3" in refusals[0]
    assert sets == ["parallel.tp_size=3", "parallel.pp_size=3"]
    sets, refusals = follow(capsys, "cogvideox-2b", ["parallel.sp_size=4"])
    assert sets == ["parallel.sp_size=3"]
    sets, refusals = follow(capsys, "debug", ["parallel.dp_size=2"], "--world-size", "4")
    assert sets == ["parallel.dp_size=4"]
