"""A family defined only under tests/ (tests/toy_family: per-token timesteps, two experts chosen by timestep),
registered at run time by its experiment's `families:` list, through the user's commands at tp 2 x pp 2.

- `python -m parallel.check` accepts the layout and `python -m parallel.plan` plans it (in-process, the argv a
  user types); the plan's activations are what train.py's own memory check predicted, and measured within 5%;
- `deepspeed --num_gpus 4 train.py` (the real launcher: every spawned rank registers the family from the
  experiment) gives the one-process run's per-step losses (fp32 tolerances);
- `deepspeed --module parallel.sample` from the tp 2 x pp 2 checkpoint, and `deepspeed --module parallel.export`
  of it (the toolkit format: the family has no released one): a one-process model loaded from the export
  samples, in this process, what the four ranks sampled from the checkpoint.
One spawn of each command; about 1.5 min on a busy 2-core machine.
"""
from __future__ import annotations

import json
import types

import pytest
import torch
from safetensors.torch import load_file

from parallel.experiment.config import load_config
from tests.helpers.family_matrix import experiment_args, in_process, launch, run_module, sample_args
from tests.helpers.launchers import losses
from tests.helpers.family_registry import toy_registry

PRESET = "tests/toy_family/debug-toy.yaml"
ONE = (1, ["train.micro_batch_size=2"], 0)
TP2_PP2 = (4, ["parallel.tp_size=2", "parallel.pp_size=2", "train.micro_batch_size=2"], 0)


@pytest.fixture(autouse=True)
def _registry():
    """The toy family registered by this test's in-process commands is gone after it."""
    with toy_registry():
        yield


def test_toy_family_is_checked_planned_trained_sampled_and_exported(tmp_path):
    from parallel.check import main as check_main
    from parallel.plan.cli import main as plan_main

    # The family exists only once its experiment is read: its traits, as the training batches carry them.
    cfg = load_config(PRESET)
    from models.registry import family
    from parallel.distributed.topology import ParallelContext
    from parallel.train.run import training_batches
    spec = family(cfg.model)
    assert spec.name == "toy" and spec.timesteps.per_token and len(spec.experts) == 2
    (latents, t, _), _ = next(training_batches(cfg, ParallelContext.single()))
    assert t.shape == (latents.shape[0], *latents.shape[2:])               # a timestep per latent position ...
    assert len(t.unique()) > 2 and spec.expert(t).unique().tolist() == [0, 1]    # ... spread over both experts

    one = experiment_args(PRESET, tmp_path, "one", ONE)
    launch(tmp_path, "one", ONE, "train.py", *one, log_name="train")
    reference = losses(tmp_path / "one")
    assert len(reference) == 2 and len(set(reference)) == 2

    args = experiment_args(PRESET, tmp_path, "tp2-pp2", TP2_PP2)
    code, out = in_process(check_main, [*args, "--world-size", "4"])
    assert code == 0, f"the checker refused what train.py is about to run:\n{out}"
    launch(tmp_path, "tp2-pp2", TP2_PP2, "train.py", *args, log_name="train")
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "tp2-pp2")), torch.tensor(reference))

    check = json.loads((tmp_path / "tp2-pp2" / "memory_check.json").read_text())
    code, out = in_process(plan_main, [*args, "--world-size", "4", "--device-memory", "80GiB", "--format", "json"])
    assert code == 0, out
    plan = json.loads(out)
    assert len(plan["stages"]) == len(check["stages"]) == 2
    for stage, measured in zip(plan["stages"], check["stages"]):
        acts = measured["activations_per_micro_batch"]
        assert stage["lines"]["activations"] // stage["micro_batches_in_flight"] == acts["predicted"]
        assert acts["measured"] == pytest.approx(acts["predicted"], rel=0.05), acts

    run_module(tmp_path, "tp2-pp2", TP2_PP2, "parallel.sample", *args, *sample_args(tmp_path, PRESET, "tp2-pp2"),
               log_name="sample")
    sampled = load_file(str(tmp_path / "tp2-pp2" / "sample.safetensors"))["latents"]
    export = tmp_path / "tp2-pp2" / "export"
    run_module(tmp_path, "tp2-pp2", TP2_PP2, "parallel.export", *args, "--out", str(export), log_name="export")

    # One process, the exported weights, the sampler parallel.sample used: the four ranks' sample.
    from models.diffusion import Objective
    from models.geometry import latent_shape
    from models.sampling import check_sampler
    from parallel.model.build import build_model
    from parallel.train.sampling import sample_batch
    from parallel.validation.validate import StageForward
    cfg = load_config(PRESET, ["train.micro_batch_size=2"])
    ctx = ParallelContext.single()
    model = build_model(cfg, {}, ctx)
    model.load_state_dict(load_file(str(export / "model.safetensors")), strict=True)
    forward = StageForward(types.SimpleNamespace(module=model.eval(), device=torch.device("cpu")), ctx)
    text = load_file(str(tmp_path / "prompt.safetensors"))["embeds"]
    uncond = load_file(str(tmp_path / "negative.safetensors"))["embeds"].expand_as(text).contiguous()
    sampler = check_sampler(cfg.model.objective, None, spec.sampling.samplers)
    shape = (cfg.model.in_channels, *latent_shape(cfg.model, cfg.data))
    mine = sample_batch(forward, ctx, Objective.of(cfg.model), text, uncond, None, shape, 5, 3, sampler, 3.0, False)
    torch.testing.assert_close(mine, sampled)
