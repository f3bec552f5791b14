"""Elastic runs (parallel/elastic.py): every world size launch.sh --nnodes MIN:MAX may restart at keeps the
global batch by accumulation, or is refused by name at start; DeepSpeed's `elasticity` section is refused."""
import json

import pytest

from parallel.check import load_and_check
from parallel.experiment.config import ConfigError
from parallel.elastic import ENV, check_elastic, elastic_worlds

TP2 = ["parallel.tp_size=2"]


def elastic(overrides, worlds, ds=None):
    cfg, _, layout = load_and_check("debug", overrides, ds, max(worlds), False)
    return check_elastic("debug", overrides, ds, cfg, layout, worlds)


def test_each_world_keeps_the_global_batch_by_accumulation():
    """debug (micro 2 x accum 2) at tp 2 on 1 or 2 nodes of 2 ranks: global batch 8 = 2 x 4 x dp 1 = 2 x 2 x dp 2;
    at tp 1 on 1 to 3 nodes: 24 = 2 x 6 x 2 = 2 x 3 x 4 = 2 x 2 x 6."""
    assert elastic(TP2, [2, 4]) == (["elastic: global batch 8 at world 2: dp 1, accum 4; world 4: dp 2, accum 2"], [])
    assert elastic([], [2, 4, 6]) == (
        ["elastic: global batch 24 at world 2: dp 2, accum 6; world 4: dp 4, accum 3; world 6: dp 6, accum 2"], [])
    assert elastic_worlds({ENV: "4,2"}) == [2, 4] and elastic_worlds({}) == []


def test_worlds_that_cannot_keep_it_are_refused_by_name(tmp_path):
    """Global batch 16 at dp 4 has no accumulation at dp 3; tp 2 does not divide 3 ranks; a DeepSpeed JSON that
    fixes gradient_accumulation_steps refuses the 4 that dp 1 needs; a fixed parallel.dp_size any other world."""
    _, problems = elastic([], [3, 4])
    assert problems == [f"elastic world 3 ({ENV}): dp 3: no train.grad_accum_steps keeps the global batch 16 "
                        "(train.micro_batch_size 2 x dp 3 does not divide it); choose train.micro_batch_size and "
                        "train.grad_accum_steps whose global batch every micro_batch_size x dp of the range divides, "
                        "or another --nnodes range"]
    _, problems = elastic(TP2, [2, 3, 4])
    assert problems == [f"elastic world 3 ({ENV}): tp x sp x pp = 2 does not divide 3 ranks; give --nnodes MIN:MAX "
                        "whose node counts hold a multiple of 2 ranks, or smaller parallel sizes"]
    ds = tmp_path / "fixed.json"
    ds.write_text(json.dumps({"gradient_accumulation_steps": 2}))
    _, problems = elastic(TP2, [2, 4], str(ds))
    assert problems == [f"elastic world 2 ({ENV}) (dp 1, train.grad_accum_steps=4 keeping the global batch 8): "
                        f"{ds}: gradient_accumulation_steps=2 != train.grad_accum_steps=4; remove it from the JSON "
                        "(the toolkit fills it in from the experiment) or set it to 4"]
    _, problems = elastic([*TP2, "parallel.dp_size=2"], [2, 4])
    assert len(problems) == 1 and problems[0].startswith(f"elastic world 2 ({ENV}) (dp 1, ") \
        and "parallel.dp_size=2 but world size 2" in problems[0], problems


def test_deepspeed_elasticity_is_refused_by_name(tmp_path):
    ds = tmp_path / "elastic.json"
    ds.write_text(json.dumps({"elasticity": {"enabled": True, "max_train_batch_size": 64,
                                             "micro_batch_sizes": [2, 4], "min_gpus": 1, "max_gpus": 4}}))
    with pytest.raises(ConfigError, match=r'"elasticity" is refused: elastic training, removed from DeepSpeed 0.19 '
                                          r".*use launch.sh --nnodes MIN:MAX \(torchrun's elastic agent\)"):
        load_and_check("debug", [], str(ds), 2, False)
