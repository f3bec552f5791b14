"""A family defined only under tests/ (tests/toy_family: per-token timesteps, two experts chosen by timestep),
registered at run time by its experiment's `families:` list, through the user's commands at tp 2 x pp 2.

- `python -m parallel.check` accepts the layout and `python -m parallel.plan` plans it (in-process, the argv a
  user types); the plan's activations are what train.py's own memory check predicted, and measured within 5%
  (the model states within 1%);
- `deepspeed --num_gpus 4 train.py` (the real launcher: every spawned rank registers the family from the
  experiment) gives the one-process run's per-step losses (fp32 tolerances);
- `python -m parallel.sample` on 4 ranks from the tp 2 x pp 2 checkpoint, and `python -m parallel.export` of it
  (the toolkit format: the family has no released one): a one-process model loaded from the export samples, in
  this process, what the four ranks sampled from the checkpoint.
That train is the module's one real launch; the one-process train, the sample and the export are forked with
torchrun's environment by tests/helpers/commands.py (each rank still reads the experiment and registers the
family itself; the real launchers are tested in test_launchers.py / test_netns_hosts.py).
One run of each command; about 1.5 min on a busy 2-core machine.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from parallel.experiment.config import load_config
from tests.helpers.family_matrix import (check_plan, experiment_args, in_process, launch, sample_args,
                                         sample_toolkit_export)
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
    launch(tmp_path, "tp2-pp2", TP2_PP2, "train.py", *args, log_name="train", launcher=True)
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "tp2-pp2")), torch.tensor(reference))

    check_plan(tmp_path / "tp2-pp2", args, TP2_PP2, "toy tp2-pp2")
    assert len(json.loads((tmp_path / "tp2-pp2" / "memory_check.json").read_text())["stages"]) == 2

    launch(tmp_path, "tp2-pp2", TP2_PP2, "-m", "parallel.sample", *args, *sample_args(tmp_path, PRESET, "tp2-pp2"),
           log_name="sample")
    sampled = load_file(str(tmp_path / "tp2-pp2" / "sample.safetensors"))["latents"]
    export = tmp_path / "tp2-pp2" / "export"
    launch(tmp_path, "tp2-pp2", TP2_PP2, "-m", "parallel.export", *args, "--out", str(export), log_name="export")

    # One process, the exported weights, the sampler parallel.sample used: the four ranks' sample.
    mine = sample_toolkit_export(PRESET, tmp_path, export, ["train.micro_batch_size=2"])
    torch.testing.assert_close(mine, sampled)
