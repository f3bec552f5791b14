"""The DeepSpeed JSON through train.py as users run it: the JSON's scheduler is the lr logged and resumed,
refusals (scheduler, precision, the key table) stop before any process group, and the keys handed to
DeepSpeed show their effect (its progress line, state dump, timers, csv monitor)."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers.ds_precision import fp16_json  # noqa: F401  (a fixture)
from tests.helpers.train_cli import ROOT, train_py
from tests.dist_utils import free_port


def test_train_logs_warmup_lr_per_step(tmp_path):
    """One process under train.py: metrics.jsonl's lr is WarmupLR's log warmup, as DeepSpeed defines it:
    step k runs at min + (max - min) log(k - 1) / log(W) (step 1 at min), then max."""
    ds = json.load(open("ds_configs/zero0_fp32.json"))
    ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_type": "log"}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = tmp_path / "run"
    p = train_py("--config", "debug", "--deepspeed_config", str(tmp_path / "ds.json"), "--set", "train.max_steps=7",
                 "--set", "train.warmup_steps=4", "--set", f"train.output_dir={out}",
                 "--set", "train.memory_check=false")
    assert p.returncode == 0, p.stderr[-3000:]
    logged = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    low, high, w = 1e-4, 3e-3, 4
    expected = [low] + [low + (high - low) * min(1.0, math.log(k - 1) / math.log(w)) for k in range(2, 8)]
    assert logged == pytest.approx(expected, rel=1e-12)
    assert logged[1] == pytest.approx(low) and logged[5:] == pytest.approx([high, high])


def test_train_refuses_a_disagreeing_scheduler_before_any_process_group(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"scheduler": {"type": "WarmupLR",
                                                                "params": {"warmup_max_lr": 1e-3}}}))
    out = tmp_path / "run"
    p = train_py("--config", "debug", "--deepspeed_config", str(tmp_path / "ds.json"),
                 "--set", f"train.output_dir={out}")
    assert p.returncode == 1 and not out.exists()
    assert (f"{tmp_path / 'ds.json'}: scheduler.params.warmup_max_lr=0.001 != train.lr=0.003; set --set "
            f"train.lr=0.001 or remove scheduler.params.warmup_max_lr") in p.stderr
    assert "deepspeed" not in p.stdout.lower()


def test_resumed_run_continues_the_json_schedule_exactly(tmp_path):
    """WarmupCosineLR, stopped after 3 steps and resumed to 6 (the checkpoint carries the schedule's position):
    the lr and the loss of steps 4-6 equal one uninterrupted run's."""
    ds = json.load(open("ds_configs/zero0_fp32.json"))
    ds["scheduler"] = {"type": "WarmupCosineLR", "params": {"warmup_type": "linear", "warmup_min_ratio": 0.1}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))

    def run(out, steps):
        p = train_py("--config", "debug", "--deepspeed_config", str(tmp_path / "ds.json"), "--set",
                     f"train.max_steps={steps}", "--set", "train.decay_steps=6", "--set", "train.warmup_steps=3",
                     "--set", f"train.output_dir={out}", "--set", "train.memory_check=false")
        assert p.returncode == 0, p.stderr[-3000:]
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    whole = run(tmp_path / "whole", 6)
    run(tmp_path / "parts", 3)
    parts = run(tmp_path / "parts", 6)
    assert [r["step"] for r in parts] == [1, 2, 3, 4, 5, 6]
    assert [(r["lr"], r["loss"]) for r in parts] == [(r["lr"], r["loss"]) for r in whole]
    assert len({r["lr"] for r in whole}) == 6


def test_train_refuses_fp16_before_any_process_group(fp16_json, tmp_path):
    out = tmp_path / "run"
    p = train_py("--config", "debug", "--deepspeed_config", str(fp16_json), "--set", f"train.output_dir={out}")
    assert p.returncode == 1 and not out.exists()
    assert (f"{fp16_json}: fp16.enabled=true but the cpu accelerator on this machine has no fp16 (DeepSpeed's "
            f"is_fp16_supported() is false); use bf16") in p.stderr
    assert "Traceback" not in p.stderr and "init_distributed" not in p.stdout + p.stderr


def test_engine_keys_reach_deepspeed(tmp_path):
    """One process under train.py: DeepSpeed's progress line every steps_per_print steps (at log_level info),
    its configuration dump, and its wall-clock timers once per step."""
    ds = json.load(open(os.path.join(ROOT, "ds_configs/zero0_fp32.json")))
    ds.update(steps_per_print=2, log_level="info", dump_state=True, wall_clock_breakdown=True)
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    p = train_py("--config", "debug", "--deepspeed_config", str(tmp_path / "ds.json"), "--set", "train.max_steps=4",
                 "--set", f"train.output_dir={tmp_path / 'run'}", "--set", "train.memory_check=false")
    assert p.returncode == 0, p.stderr[-3000:]
    progress = [line.split("[Rank 0] ")[1].split(",")[0] for line in p.stdout.splitlines() if "[Rank 0] step=" in line]
    assert progress == ["step=0", "step=2", "step=4"]        # DeepSpeed also reports its step 0
    assert p.stdout.count("DeepSpeedEngine configuration:") == 1
    assert sum(1 for line in p.stdout.splitlines() if "time (ms) | fwd:" in line) == 4


def test_train_refuses_table_keys_before_any_process_group(tmp_path):
    """A refused key, a refused zero_optimization key and an unknown key, reported together by train.py."""
    ds = json.load(open(os.path.join(ROOT, "ds_configs/zero2_bf16.json")))
    ds.update(tensor_parallel={"autotp_size": 2}, wall_clock_breakdwn=True)
    ds["zero_optimization"]["stage3_max_live_parameters"] = 10**8
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    out = tmp_path / "run"
    p = train_py("--config", "debug", "--deepspeed_config", str(path), "--set", f"train.output_dir={out}")
    assert p.returncode == 1 and not out.exists()
    assert f'{path}: "tensor_parallel" is refused: DeepSpeed\'s AutoTP would re-shard the toolkit\'s ' \
           f"tensor-parallel layers; use parallel.tp_size; remove it" in p.stderr
    assert f"{path}: zero_optimization.stage3_max_live_parameters with zero_optimization.stage=2 is refused: only " \
           f"ZeRO-3 reads it; remove it or use stage 3" in p.stderr
    assert f'{path}: unknown DeepSpeed key "wall_clock_breakdwn" (did you mean "wall_clock_breakdown"?)' in p.stderr
    assert "Traceback" not in p.stderr


def _train_with(tmp_path, section: str, value: dict | None = None, steps: int = 3, sets=(), env=None,
                launched=False):
    """train.py with DeepSpeed's `section` (a monitor, by default writing under tmp_path/section) on, one process
    or (`launched`) two ranks under torchrun, which leave without the interpreter's teardown (parallel.cli.run):
    the completed process, the metrics.jsonl records and the figures they carry."""
    ds = json.load(open(os.path.join(ROOT, "ds_configs/zero0_fp32.json")))
    ds[section] = value or {"enabled": True, "output_path": str(tmp_path / section), "job_name": "job"}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = tmp_path / "run"
    args = ("--config", "debug", "--deepspeed_config", str(tmp_path / "ds.json"), "--set",
            f"train.max_steps={steps}", "--set", f"train.output_dir={out}", "--set", "train.memory_check=false",
            *(a for s in sets for a in ("--set", s)))
    if launched:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        p = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), "train.py", *args],
                           cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=300)
    else:
        p = train_py(*args, env_extra=env)
    assert p.returncode == 0, p.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    figures = sorted(k for k in records[0] if k != "step" and records[0][k] is not None)
    assert {"loss", "lr", "grad_norm", "step_time_s", "samples_per_s", "tokens_per_s"} <= set(figures)
    return p, records, figures


def test_csv_monitor_gets_every_figure_of_metrics_jsonl(tmp_path):
    _, records, figures = _train_with(tmp_path, "csv_monitor")
    for name in figures:
        csv = (tmp_path / "csv_monitor" / "job" / f"train_{name}.csv").read_text()
        rows = [line.split(",") for line in csv.splitlines()[1:]]
        assert [int(r[0]) for r in rows] == [1, 2, 3], name
        assert [float(r[1]) for r in rows] == pytest.approx([r[name] for r in records], rel=1e-12), name


def test_tensorboard_gets_every_figure_of_metrics_jsonl(tmp_path):
    """The event file read back with tensorboard's own EventAccumulator: each figure's steps and values (stored
    as float32 by the summary writer) equal metrics.jsonl's. DeepSpeed adds its own Train/Samples/lr, by
    samples seen, written after its scheduler stepped: at step k's samples, the lr step k + 1 runs at."""
    pytest.importorskip("tensorboard", reason="the test extra installs tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, records, figures = _train_with(tmp_path, "tensorboard", launched=True)
    events = EventAccumulator(str(tmp_path / "tensorboard" / "job")).Reload()
    assert sorted(events.Tags()["scalars"]) == sorted([f"train/{name}" for name in figures] + ["Train/Samples/lr"])
    samples = events.Scalars("Train/Samples/lr")
    assert [e.step for e in samples] == [samples[0].step * k for k in (1, 2, 3)]
    assert [e.value for e in samples][:-1] == pytest.approx([r["lr"] for r in records][1:], rel=1e-6)
    for name in figures:
        scalars = events.Scalars(f"train/{name}")
        assert [e.step for e in scalars] == [1, 2, 3], name
        torch.testing.assert_close(torch.tensor([e.value for e in scalars]),
                                   torch.tensor([r[name] for r in records], dtype=torch.float32), rtol=0, atol=0)


def _wandb_history(path) -> list[dict]:
    """The history rows of an offline wandb run file (`run-<id>.wandb`), as wandb's own reader would see them.

    The file is a LevelDB-style log (wandb 0.31 ships no Python reader): a 7-byte header (":W&B", magic
    0xBEE1, version 0), then 32 KiB blocks of chunks, each `crc32c (4) | length (2, little-endian) | type (1)`
    with type 1 = a whole record, 2/3/4 = its first/middle/last part; a block tail under 7 bytes is padding.
    Each record is a wandb Record protobuf."""
    from wandb.proto import wandb_internal_pb2

    data, records, parts, pos = path.read_bytes(), [], b"", 7
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:                         # block padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        parts, pos = parts + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            records.append(parts)
            parts = b""
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def test_wandb_gets_every_figure_of_metrics_jsonl(tmp_path):
    """wandb offline (WANDB_MODE=offline), its run file read back: every figure of every step, with the step as
    its x-axis ("step"), equal to metrics.jsonl's (JSON both ways: exact). wandb drops a log whose step is below
    the last it saw, and DeepSpeed logs Train/Samples/lr at the samples seen (4, 8, 12): figures logged at
    steps 1, 2, 3 would all be lost (parallel/distributed/deepspeed/monitor.py write_monitor_events). Two
    launched ranks, which leave without the interpreter's teardown: the run file is whole only where the trainer
    ended the wandb run (close_monitors; without it no row reached the file)."""
    p, records, figures = _train_with(tmp_path, "wandb", {"enabled": True, "project": "vdp"},
                                      env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}, launched=True)
    assert "Steps must be monotonically increasing" not in p.stdout + p.stderr
    [run] = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    rows = [row for row in _wandb_history(run) if "train/loss" in row]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for name in figures:
        assert [row[f"train/{name}"] for row in rows] == [r[name] for r in records], name
    samples = [row["Train/Samples/lr"] for row in _wandb_history(run) if "Train/Samples/lr" in row]
    assert samples[:-1] == pytest.approx([r["lr"] for r in records][1:], rel=1e-12)


def test_flops_profiler_prints_its_profile_at_pp1(tmp_path):
    """DeepSpeed's flops profiler at parallel.pp_size=1, one micro-batch a step: one profile in train.py's output.
    profile_step counts DeepSpeed's global steps from 0, so profile_step=2 profiles the toolkit's step 3 and
    says so; its parameter count is the model's (the planner's count). The pipeline refusal is in
    tests/unit/test_ds_keys.py."""
    from parallel.config import load_config
    from parallel.plan.search import count_params
    from parallel.plan.trace import ActivationTracer

    p, _, _ = _train_with(tmp_path, "flops_profiler", {"enabled": True, "profile_step": 2, "module_depth": 1,
                                                       "top_modules": 1}, sets=["train.grad_accum_steps=1"])
    assert p.stdout.count("DeepSpeed Flops Profiler") == 1
    assert "Profile Summary at step 3:" in p.stdout
    fields = dict(line.rsplit(":", 1) for line in p.stdout.splitlines() if line.count(":") == 1)
    n, unit = fields["params per GPU"].split()
    assert unit == "K" and float(n) * 1e3 == pytest.approx(count_params(ActivationTracer(load_config("debug"),
                                                                                         torch.float32))[0], abs=5)
    assert fields["batch size per GPU"].strip() == "2"


def test_comms_logger_prints_its_summary_at_pp1(tmp_path):
    """DeepSpeed's comms logger (prof_all) at tp = sp = pp = 1: train.py prints deepspeed.comm's summary after the
    last step, with the engine's gradient all-reduce once a step, of the model's fp32 gradients' size."""
    from deepspeed.utils.comms_logging import convert_size

    from parallel.config import load_config
    from parallel.plan.search import count_params
    from parallel.plan.trace import ActivationTracer

    p, records, _ = _train_with(tmp_path, "comms_logger", {"enabled": True, "prof_all": True})
    lines = p.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("Comm. Op"))
    assert header > max(i for i, line in enumerate(lines) if "training debug" in line)
    rows, op = {}, None
    for line in lines[header + 1:]:
        if line.strip() and not line.startswith(" "):
            op = line.strip()
        elif line.strip():
            size, count = re.match(r"\s+([\d.]+ ?[KMGT]?B)\s+(\d+)\s", line).groups()
            rows.setdefault(op, {})[size] = int(count)
    grads = count_params(ActivationTracer(load_config("debug"), torch.float32))[0] * 4
    assert rows["all_reduce"][convert_size(grads)] == len(records) == 3
    assert "broadcast" in rows       # the engine's initial parameter broadcast
