"""Elastic runs (launch.sh --nnodes MIN:MAX, torchrun's agent): every world size a restart may land on,
checked when the run starts, before any process group, so that a lost node never meets a refusal.

launch.sh exports VDP_ELASTIC_WORLDS, the ranks of MIN..MAX nodes ("2,4" for --nnodes 1:2 --nproc 2). The
run keeps one global batch G, the largest world's: G = train.micro_batch_size x train.grad_accum_steps x
dp_max. After a lost node it resumes (train.py, checkpoint.resume_accumulation) at a world w with

    dp_w = w / (tp x sp x pp)        accum_w = G / (micro x dp_w)

so that step N names the same samples and the same point of the schedule. A world where tp x sp x pp does
not divide the ranks, where no whole accumulation reaches G, or where the experiment and the DeepSpeed JSON
refuse accum_w (a fixed `gradient_accumulation_steps`, a fixed `parallel.dp_size`) is refused by name now.
DeepSpeed's own `elasticity` section is refused (parallel/experiment/ds_keys.py): DeepSpeed 0.19 removed it, and the
micro-batch stays fixed here so that a step's samples do not depend on the world.
"""
from __future__ import annotations

import os
from typing import Optional

from parallel.check import load_and_check
from parallel.experiment.config import ConfigError, ExperimentConfig
from parallel.distributed.topology import Layout

ENV = "VDP_ELASTIC_WORLDS"


def elastic_worlds(environ: Optional[dict] = None) -> list[int]:
    """The world sizes of an elastic run (launch.sh sets ENV), [] for any other run."""
    text = (os.environ if environ is None else environ).get(ENV, "")
    return sorted({int(w) for w in text.split(",") if w.strip()})


def check_elastic(config: str, overrides: list[str], deepspeed_config: Optional[str], cfg: ExperimentConfig,
                  layout: Layout, worlds: list[int]) -> tuple[list[str], list[str]]:
    """(one line per world: its dp and accumulation, problems) for the worlds an elastic run may restart at,
    `cfg`/`layout` being this start's (checked already). Each world's experiment is checked whole
    (load_and_check with its accumulation), its problems prefixed with the world."""
    model = layout.tp_size * layout.sp_size * layout.pp_size
    top = max(worlds)
    if top % model:
        return [], [f"{ENV}={','.join(map(str, worlds))}: the largest world {top} is not a multiple of tp x sp x pp "
                    f"= {model}"]
    micro = cfg.train.micro_batch_size
    batch = micro * cfg.train.grad_accum_steps * (top // model)
    lines, problems = [], []
    for w in worlds:
        where = f"elastic world {w} ({ENV})"
        if w % model:
            problems.append(f"{where}: tp x sp x pp = {model} does not divide {w} ranks; give --nnodes MIN:MAX "
                            f"whose node counts hold a multiple of {model} ranks, or smaller parallel sizes")
            continue
        dp = w // model
        if batch % (micro * dp):
            problems.append(f"{where}: dp {dp}: no train.grad_accum_steps keeps the global batch {batch} "
                            f"(train.micro_batch_size {micro} x dp {dp} does not divide it); choose "
                            f"train.micro_batch_size and train.grad_accum_steps whose global batch every "
                            f"micro_batch_size x dp of the range divides, or another --nnodes range")
            continue
        accum = batch // (micro * dp)
        lines.append(f"world {w}: dp {dp}, accum {accum}")
        if w == layout.world_size and accum == cfg.train.grad_accum_steps:
            continue                      # this start's, checked already
        try:
            load_and_check(config, [*overrides, f"train.grad_accum_steps={accum}"], deepspeed_config, w, False)
        except ConfigError as e:
            problems += [f"{where} (dp {dp}, train.grad_accum_steps={accum} keeping the global batch {batch}): {p}"
                         for p in str(e).splitlines()]
    return [f"elastic: global batch {batch} at " + "; ".join(lines)] if lines else [], problems
