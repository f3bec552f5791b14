"""Caption dropout and the unconditional embedding: the same samples dropped in every layout (here: the
batches of dp 1 and dp 2; tests/distributed/test_release_dropout_layouts.py: dp 2 and tp 2 training against
one process), the unconditional
embedding from the data (synthetic: its own; prepared: uncond.safetensors), refused by name when missing,
and used by guided validation sampling."""
import json
import types

import pytest
import torch
from safetensors.torch import save_file

from models.diffusion import Objective
from parallel.check import check_unconditional, load_and_check
from parallel.experiment.config import ConfigError, load_config
from parallel.distributed.topology import ParallelContext
from parallel.train.data import DiffusionBatches, DirectoryLatents, SyntheticLatents
from parallel.train.run import build_val_dataset

P = 0.5


def _texts_by_position(dataset, dp_size, mb, accum, steps, p=P):
    """{(step, global position): (text, timestep, x_t)} over every data-parallel rank."""
    out = {}
    for dp_rank in range(dp_size):
        batches = DiffusionBatches(dataset, Objective("v_prediction"), seed=7, micro_batch=mb, grad_accum=accum,
                                   dp_rank=dp_rank, dp_size=dp_size, caption_dropout=p)
        for step in range(steps):
            for micro in range(accum):
                (x_t, t, text), _ = batches.micro_batch(step, micro)
                first = step * batches.global_batch + (micro * dp_size + dp_rank) * mb
                for j in range(mb):
                    out[(step, first + j)] = (text[j], t[j], x_t[j])
    return out


def test_same_samples_dropped_at_dp1_and_dp2_and_only_the_text_changes():
    dataset = SyntheticLatents(16, 4, (3, 8, 8), 8, 32, seed=7)
    uncond = dataset.unconditional()
    one = _texts_by_position(dataset, 1, 4, 1, 4)
    two = _texts_by_position(dataset, 2, 1, 2, 4)
    assert one.keys() == two.keys() and len(one) == 16
    for key, (text, t, x_t) in one.items():
        assert torch.equal(text, two[key][0]) and torch.equal(t, two[key][1]) and torch.equal(x_t, two[key][2])
    dropped = [k for k, (text, _, _) in one.items() if torch.equal(text, uncond)]
    assert 0 < len(dropped) < len(one)
    # Without dropout: the same noise and timesteps, the captions' own embeddings everywhere.
    off = _texts_by_position(dataset, 1, 4, 1, 4, p=0.0)
    for key, (text, t, x_t) in off.items():
        assert torch.equal(t, one[key][1]) and torch.equal(x_t, one[key][2])
        assert torch.equal(text, one[key][0]) != (key in dropped)


def test_synthetic_unconditional_is_its_own_and_from_the_seed():
    a, b = SyntheticLatents(8, 4, (3, 8, 8), 8, 32, seed=7), SyntheticLatents(8, 4, (3, 8, 8), 8, 32, seed=8)
    assert torch.equal(a.unconditional(), SyntheticLatents(4, 4, (3, 8, 8), 8, 32, seed=7).unconditional())
    assert not torch.equal(a.unconditional(), b.unconditional())
    assert all(not torch.equal(a.unconditional(), a.text(k)) for k in range(a.num_classes))
    val = build_val_dataset(load_config("debug"))
    assert torch.equal(val.unconditional(), SyntheticLatents(1, 4, (3, 8, 8), 8, 32, 1234).unconditional())


def _prepared(root, with_uncond: bool):
    root.mkdir(parents=True, exist_ok=True)
    save_file({"latent": torch.randn(4, 3, 8, 8)}, str(root / "a.safetensors"))
    save_file({"text": torch.randn(8, 32)}, str(root / "a_text.safetensors"))
    (root / "manifest.jsonl").write_text(json.dumps({"latent": "a.safetensors", "text": "a_text.safetensors"}) + "\n")
    if with_uncond:
        save_file({"text": torch.full((8, 32), 0.25)}, str(root / "uncond.safetensors"))
    return root


def test_missing_unconditional_is_refused_by_name_before_training(tmp_path):
    bare, ready = _prepared(tmp_path / "bare", False), _prepared(tmp_path / "ready", True)
    sets = ["data.kind=directory", f"data.path={bare}", "data.caption_dropout=0.1"]
    with pytest.raises(ConfigError) as e:                 # train.py's checks, before any process group
        load_and_check("debug", sets, "ds_configs/zero0_fp32.json", 1)
    assert str(e.value) == (
        f"{bare / 'uncond.safetensors'} does not exist: data.caption_dropout=0.1 needs the unconditional text "
        f"embedding (T5 of the empty prompt); python -m parallel.prepare_data --t5 writes it, or set "
        f"data.text_encoder to encode it, or set data.caption_dropout=0")
    cfg = load_config("debug", ["data.kind=directory", f"data.path={ready}", "data.caption_dropout=0.1",
                                "val.every=5", "val.num_prompts=1", "val.guidance_scale=6", f"val.path={bare}"])
    problems = check_unconditional(cfg)
    assert [p.split(":")[0] for p in problems] == [f"{bare / 'uncond.safetensors'} does not exist"]
    assert "val.guidance_scale=6.0 needs" in problems[0]
    assert check_unconditional(load_config("debug", ["data.kind=directory", f"data.path={bare}"])) == []
    # The dataset's own start-up check names it too; a prepared folder's file is what it reads.
    with pytest.raises(FileNotFoundError, match=f"{bare / 'uncond.safetensors'} does not exist"):
        DiffusionBatches(DirectoryLatents(bare), Objective("v_prediction"), seed=0, micro_batch=1, grad_accum=1,
                         dp_rank=0, dp_size=1, caption_dropout=0.1)
    assert torch.equal(DirectoryLatents(ready).unconditional(), torch.full((8, 32), 0.25))


def test_guided_validation_samples_feed_the_unconditional_embedding():
    from parallel.validation.validate import sample_latents

    cfg = load_config("debug", ["val.every=1", "val.num_prompts=1", "val.guidance_scale=4", "val.sample_steps=2",
                                "val.sampler=dpm"])
    dataset, seen = build_val_dataset(cfg), []

    def predict(inputs, like):
        seen.append(inputs[2])
        return torch.zeros_like(inputs[0])

    forward = types.SimpleNamespace(lockstep=False, predict=predict)
    sample_latents(forward, dataset, Objective.of(cfg.model), cfg, ParallelContext.single())
    assert len(seen) == 4                                  # 2 steps x (conditional, unconditional)
    assert torch.equal(seen[0][0], dataset[0][1]) and torch.equal(seen[1][0], dataset.unconditional())
