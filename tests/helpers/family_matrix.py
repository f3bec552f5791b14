"""The family x layout matrix of tests/cli/test_family_matrix*.py (`run_family`: one family's debug preset through
the user's commands), and its helpers that other test modules use too: `check_plan`, `experiment_args`,
`in_process`, `launch`, `run_module`, `sample_args`, `sample_toolkit_export` (a test module imports no other test
module)."""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
import types
from typing import Callable, NamedTuple, Optional

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.experiment.config import load_config
from tests.helpers.commands import run_command
from tests.helpers.launchers import finish, losses, run_env, start
from tests.dist_utils import free_port


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")
STEPS = 2
SAMPLING = {"steps": 3, "guidance": 3.0, "seed": 5}     # parallel.sample's flags in every sample of the matrix

# name -> (processes, overrides, ZeRO stage); every layout at global batch 4 = micro-batch x 2 x dp.
LAYOUTS = {
    "tp2-dp2": (4, ["parallel.tp_size=2", "train.micro_batch_size=1"], 0),
    "tp2-pp2": (4, ["parallel.tp_size=2", "parallel.pp_size=2", "train.micro_batch_size=2"], 0),
    "tp2-sp2": (4, ["parallel.tp_size=2", "parallel.sp_size=2", "train.micro_batch_size=2"], 0),
    "dp2-zero3": (2, ["train.micro_batch_size=1"], 3),
}
ONE = (1, ["train.micro_batch_size=2"], 0)


class Prepared(NamedTuple):
    """A family's training data as the user makes it: `python -m parallel.prepare_data`'s arguments, the overrides
    that train from its folder (data.kind=directory, data.path, and any the release's sizes need), and the prepared
    caption files parallel.sample takes as its prompts and negative prompt; `says`: a line of its log (what it
    prepared and skipped)."""
    argv: list[str]
    sets: list[str]
    prompts: list
    negative: object
    says: str


class Runs(NamedTuple):
    """What the matrix runs of one family: the layouts trained (each against one process), the one whose
    checkpoint `parallel.sample` samples, the one whose checkpoint `parallel.export` exports (both among train);
    `data`: tmp_path -> Prepared, the data the runs train from (None: the preset's synthetic data, and random
    prompts)."""
    train: tuple[str, ...]
    sample: str
    export: str
    data: Optional[Callable[..., Prepared]] = None


def replicas(layout) -> int:
    """A layout's data-parallel size: its processes over tp x pp x sp."""
    split = [int(o.split("=")[1]) for o in layout[1] if o.split("=")[0] in
             ("parallel.tp_size", "parallel.pp_size", "parallel.sp_size")]
    return layout[0] // math.prod(split)


def ds_config(tmp_path, stage: int) -> str:
    path = tmp_path / f"zero{stage}_fp32.json"
    if not path.exists():
        ds = json.load(open(os.path.join(ROOT, "ds_configs/zero0_fp32.json")))
        ds["zero_optimization"] = {"stage": stage}
        path.write_text(json.dumps(ds))
    return str(path)


def experiment_args(preset, tmp_path, name, layout, sets=()) -> list[str]:
    """The commands' experiment flags of one layout; `sets`: the data's overrides (Prepared.sets)."""
    _, overrides, stage = layout
    args = ["--config", preset, "--deepspeed_config", ds_config(tmp_path, stage),
            "--set", "train.grad_accum_steps=2", "--set", f"train.max_steps={STEPS}", "--set", "train.warmup_steps=0",
            "--set", f"train.output_dir={tmp_path / name}"]
    for o in [*overrides, *sets]:
        args += ["--set", o]
    return args


def launch(tmp_path, name, layout, *command, log_name, launcher=False):
    """`python <command>` in the layout's N processes, forked with torchrun's environment (tests/helpers/commands.py:
    no interpreter starts afresh), or with `launcher`, `deepspeed --num_gpus N <command>` (N = 1: plain `python
    <command>`); its log, asserting exit 0."""
    n = layout[0]
    log = tmp_path / f"{name}.{log_name}.log"
    if not launcher:
        p = run_command(command, ranks=n, env=run_env(), timeout=300)
        log.write_text(p.stdout + p.stderr)
        assert p.returncode == 0, f"{' '.join(command)} in {n} forked processes\n{(p.stdout + p.stderr)[-4000:]}"
        return p.stdout + p.stderr
    if n == 1:
        cmd = [sys.executable, *command]
    else:
        cmd = [DEEPSPEED, "--num_gpus", str(n), "--master_port", str(free_port()), *command]
    code, = finish([start(cmd, log, run_env())], str(tmp_path / name), timeout=300)
    text = log.read_text()
    assert code == 0, f"{' '.join(cmd)}\n{text[-4000:]}"
    return text


def run_module(tmp_path, name, layout, mod, *args, log_name, launcher=False):
    """`python -m mod` (forked, see launch); with `launcher`, `deepspeed --module mod` for more than one process."""
    if layout[0] == 1 or not launcher:
        return launch(tmp_path, name, layout, "-m", mod, *args, log_name=log_name, launcher=launcher)
    return launch(tmp_path, name, layout, "--module", mod, *args, log_name=log_name, launcher=True)


def in_process(main, argv) -> tuple[int, str]:
    """A command's main(argv) as `python -m` runs it: exit code and stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def sample_args(tmp_path, preset, name, data: Optional[Prepared] = None) -> list[str]:
    """parallel.sample's flags for two random prompts (and zeros as the negative one) of the preset's model, written
    once under tmp_path: the second stream's captions beside them (LTX-2's "audio_text"), an image-to-video model's
    first-frame latents (Wan 2.2 TI2V); with `data`, its prepared captions and negative prompt instead."""
    from models.geometry import latent_shape
    from models.registry import family
    from parallel.train.data import STREAM_KEYS

    cfg = load_config(preset, data.sets if data else [])
    m, spec = cfg.model, family(cfg.model)
    embeds, negative, image = (tmp_path / f"{f}.safetensors" for f in ("prompt", "negative", "image"))
    condition = spec.training_condition(m, cfg.data)
    if not embeds.exists():
        g = torch.Generator().manual_seed(7)
        stream = spec.training_stream(m, cfg.data)
        shapes = {"text": (m.max_text_len, m.text_embed_dim), **({STREAM_KEYS[1][1]: stream.shapes()[1]} if stream else {})}
        save_file({k: torch.randn(2, *s, generator=g) for k, s in shapes.items()}, str(embeds))
        save_file({k: torch.zeros(1, *s) for k, s in shapes.items()}, str(negative))
        if condition is not None:
            shape = condition.stored_shapes([m.in_channels, *latent_shape(m, cfg.data)])["image"]
            save_file({"image": torch.randn(shape, generator=g)}, str(image))
    prompts = [embeds]
    if data is not None:
        prompts, negative = data.prompts, data.negative
    return [*(a for f in prompts for a in ("--prompt-embeds", str(f))), "--negative-embeds", str(negative),
            *(["--image-latents", str(image)] if condition is not None else []),
            *(a for k, v in SAMPLING.items() for a in (f"--{k}", str(v))),
            "--out", str(tmp_path / name / "sample.safetensors")]


def sampled(tmp_path, name) -> dict[str, torch.Tensor]:
    """parallel.sample's output: "latents" (and a second stream's, LTX-2's "audio")."""
    return load_file(str(tmp_path / name / "sample.safetensors"))


def exported(folder) -> dict[str, torch.Tensor]:
    """Every tensor of an export folder (model.safetensors, or a diffusers folder's shards; Wan 2.2 A14B's in
    transformer/ and transformer_2/), named by the subfolder's path and the tensor's name."""
    files = [folder / "model.safetensors"] if (folder / "model.safetensors").exists() else \
        sorted(folder.rglob("diffusion_pytorch_model*.safetensors"))
    assert files, f"{folder}: nothing exported"
    return {f"{path.parent.relative_to(folder)}/{k}": v for path in files for k, v in load_file(str(path)).items()}


def sample_toolkit_export(preset, tmp_path, export, overrides=()) -> torch.Tensor:
    """In this process, one model loaded from a toolkit-format export (model.safetensors: a family with no released
    format, which model.init_from cannot name) samples what `sample_args` asks parallel.sample for: the latents."""
    from models.diffusion import Objective
    from models.geometry import latent_shape
    from models.registry import family
    from models.sampling import check_sampler
    from parallel.distributed.topology import ParallelContext
    from parallel.model.build import build_model
    from parallel.train.sampling import sample_batch
    from parallel.validation.validate import StageForward

    cfg = load_config(preset, list(overrides))
    ctx = ParallelContext.single()
    model = build_model(cfg, {}, ctx)
    model.load_state_dict(load_file(str(export / "model.safetensors")), strict=True)
    forward = StageForward(types.SimpleNamespace(module=model.eval(), device=torch.device("cpu")), ctx)
    text = load_file(str(tmp_path / "prompt.safetensors"))["text"]
    uncond = load_file(str(tmp_path / "negative.safetensors"))["text"].expand_as(text).contiguous()
    sampler = check_sampler(cfg.model.objective, cfg.val.sampler, family(cfg.model).sampling.samplers)
    shape = (cfg.model.in_channels, *latent_shape(cfg.model, cfg.data))
    return sample_batch(forward, ctx, Objective.of(cfg.model), text, uncond, None, shape, SAMPLING["seed"],
                        SAMPLING["steps"], sampler, SAMPLING["guidance"], False)


def check_plan(run, args, layout, label) -> None:
    """`python -m parallel.plan` (in this process) of the layout train.py ran to `run` with `args` plans the
    activations train.py's own memory check predicted, and that check measured them within 5% and the model
    states within 1%."""
    from parallel.plan.cli import main as plan_main

    check = json.loads((run / "memory_check.json").read_text())
    code, out = in_process(plan_main, [*args, "--world-size", str(layout[0]), "--device-memory", "80GiB",
                                       "--format", "json"])
    assert code == 0, out
    plan = json.loads(out)
    assert len(plan["stages"]) == len(check["stages"]), label
    for stage, measured in zip(plan["stages"], check["stages"]):
        acts = measured["activations_per_micro_batch"]
        assert stage["lines"]["activations"] // stage["micro_batches_in_flight"] == acts["predicted"], label
        assert acts["measured"] == pytest.approx(acts["predicted"], rel=0.05), f"{label}: {acts}"
        states = measured["model_states"]
        assert states["measured"] == pytest.approx(states["predicted"], rel=0.01), f"{label}: {states}"


def run_family(preset, runs: Runs, tmp_path) -> None:
    """One family's debug preset through the commands: with runs.data, `python -m parallel.prepare_data` first
    writes the folder every run trains from (else synthetic data); one process trains (the reference losses); each
    layout of runs.train is accepted by the checker, trains to those losses and measures the plan's activations;
    runs.sample's checkpoint samples (parallel.sample) and runs.export's exports (parallel.export: diffusers where
    the family has a released format, else the toolkit's); in this process, one process samples from the export
    what the layout sampled (the export holds the checkpoint's weights) and, released, `parallel.verify` finds
    diffusers' model loaded from it predicting as the toolkit's."""
    from parallel import sample, verify
    from parallel.check import main as check_main

    from models.registry import family

    data = runs.data(tmp_path) if runs.data else None
    sets = data.sets if data else []
    if data is not None:
        log = run_module(tmp_path, "prepare", ONE, "parallel.prepare_data", *data.argv, log_name="prepare")
        assert data.says in log, log[-2000:]
    released = family(load_config(preset).model).formats.released is not None    # a diffusers format to export to
    one = experiment_args(preset, tmp_path, "one", ONE, sets)
    launch(tmp_path, "one", ONE, "train.py", *one, log_name="train")
    reference = losses(tmp_path / "one")
    assert len(reference) == STEPS and len(set(reference)) == STEPS

    for i, name in enumerate(runs.train):
        layout = LAYOUTS[name]
        args = experiment_args(preset, tmp_path, name, layout, sets)
        code, out = in_process(check_main, [*args, "--world-size", str(layout[0])])
        assert code == 0, f"{preset} {name}: the checker refused what train.py is about to run:\n{out}"
        launch(tmp_path, name, layout, "train.py", *args, log_name="train", launcher=i == 0)
        torch.testing.assert_close(torch.tensor(losses(tmp_path / name)), torch.tensor(reference),
                                   msg=lambda m: f"{preset} {name} losses vs one process: {m}")
        check_plan(tmp_path / name, args, layout, f"{preset} {name}")

    name, layout = runs.sample, LAYOUTS[runs.sample]
    log = run_module(tmp_path, name, layout, "parallel.sample", *experiment_args(preset, tmp_path, name, layout, sets),
                     *sample_args(tmp_path, preset, name, data), log_name="sample")
    steps = SAMPLING["steps"] * 2 // replicas(layout)        # rank 0's bar: its share of the 2 prompts x 3 steps
    assert "sampling: 100%" in log and f"{steps}/{steps}" in log, log[-2000:]
    want = sampled(tmp_path, name)

    name, layout = runs.export, LAYOUTS[runs.export]
    export = tmp_path / name / "export"
    log = run_module(tmp_path, name, layout, "parallel.export", *experiment_args(preset, tmp_path, name, layout, sets),
                     *(["--format", "diffusers"] if released else []), "--out", str(export), log_name="export")
    assert "exporting: 100%" in log, log[-2000:]
    # The export holds the checkpoint's weights: one process samples from it what the layout sampled from its
    # checkpoint (when runs.sample is another layout, its checkpoint: layouts train to the same weights, within
    # fp32 rounding: Adam's first steps divide by sqrt(v), and a gradient within rounding of zero moves its weight
    # by up to lr either way; the samples agree at fp32 tolerances).
    if released:
        again = [*experiment_args(preset, tmp_path, "from-export", ONE, sets), "--set", f"model.init_from={export}",
                 *sample_args(tmp_path, preset, "from-export", data)]
        code, out = in_process(sample.main, again)
        assert code == 0, out
        got = sampled(tmp_path, "from-export")
    else:
        got = {"latents": sample_toolkit_export(preset, tmp_path, export, sets)}
    assert got.keys() == want.keys(), f"{preset}: {sorted(got)} vs {sorted(want)}"
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, msg=lambda m: f"{preset} {key} sampled from the export: {m}")
    if released:
        # diffusers' model loaded from the export predicts what the toolkit predicts from it (exit 0: within
        # --tolerance 1e-4)
        code, out = in_process(verify.main, ["--config", preset, "--set", f"model.init_from={export}",
                                             *(a for o in sets for a in ("--set", o))])
        assert code == 0 and "max relative difference" in out, out
