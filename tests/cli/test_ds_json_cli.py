"""The DeepSpeed JSON through train.py as users run it: the JSON's scheduler is the lr logged and resumed,
refusals (scheduler, precision, the key table) stop before any process group, and the keys handed to
DeepSpeed show their effect (its progress line, state dump, timers, monitors, profilers).

One run serves several checks (the fixtures below): seven runs of train.py in all, one of them on two ranks (forked
with torchrun's environment by tests/helpers/commands.py; the real launchers are tested in test_launchers.py /
test_netns_hosts.py)."""
import json
import math
import os
import re
import pytest
import torch

from tests.helpers.commands import run_command
from tests.helpers.train_cli import ROOT, train_py


def _train_with(folder, sections: dict, steps: int = 3, sets=(), env=None, base=None, launched=False):
    """train.py with DeepSpeed's `sections` on (a monitor's None: on, writing under folder/<section>) over `base`
    (ds_configs/zero0_fp32.json by default), one process or (`launched`) two ranks with torchrun's environment
    (forked by tests/helpers/commands.py: their output is rank 0's, then rank 1's), which leave without the
    interpreter's teardown (WORLD_SIZE 2: parallel.experiment.cli.run's os._exit): the completed process, the
    metrics.jsonl records and the figures they carry."""
    ds = base or json.load(open(os.path.join(ROOT, "ds_configs/zero0_fp32.json")))
    for section, value in sections.items():
        ds[section] = value or {"enabled": True, "output_path": str(folder / section), "job_name": "job"}
    (folder / "ds.json").write_text(json.dumps(ds))
    out = folder / "run"
    args = ("--config", "debug", "--deepspeed_config", str(folder / "ds.json"), "--set",
            f"train.max_steps={steps}", "--set", f"train.output_dir={out}", "--set", "train.memory_check=false",
            *(a for s in sets for a in ("--set", s)))
    p = run_command(["train.py", *args], ranks=2 if launched else 1, env_extra=env, timeout=600 if launched else 300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    figures = sorted(k for k in records[0] if k != "step" and records[0][k] is not None)
    assert {"loss", "lr", "grad_norm", "step_time_s", "samples_per_s", "tokens_per_s"} <= set(figures)
    return p, records, figures


@pytest.fixture(scope="module")
def warmup_lr(tmp_path_factory):
    """One process, 7 steps: WarmupLR's log warmup over 4 steps, with DeepSpeed's progress line, state dump and
    timers on."""
    folder = tmp_path_factory.mktemp("warmup_lr")
    ds = json.load(open(os.path.join(ROOT, "ds_configs/zero0_fp32.json")))
    ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_type": "log"}}
    ds.update(steps_per_print=2, log_level="info", dump_state=True, wall_clock_breakdown=True)
    return _train_with(folder, {}, steps=7, sets=["train.warmup_steps=4"], base=ds)


def test_train_logs_warmup_lr_per_step(warmup_lr):
    """One process under train.py: metrics.jsonl's lr is WarmupLR's log warmup, as DeepSpeed defines it:
    step k runs at min + (max - min) log(k - 1) / log(W) (step 1 at min), then max."""
    _, records, _ = warmup_lr
    logged = [r["lr"] for r in records]
    low, high, w = 1e-4, 3e-3, 4
    expected = [low] + [low + (high - low) * min(1.0, math.log(k - 1) / math.log(w)) for k in range(2, 8)]
    assert logged == pytest.approx(expected, rel=1e-12)
    assert logged[1] == pytest.approx(low) and logged[5:] == pytest.approx([high, high])


def test_engine_keys_reach_deepspeed(warmup_lr):
    """One process under train.py (the warmup run, 7 steps of 2 micro-batches): DeepSpeed's progress line every
    steps_per_print steps (at log_level info), its configuration dump, and its wall-clock timers once per step."""
    p, records, _ = warmup_lr
    progress = [line.split("[Rank 0] ")[1].split(",")[0] for line in p.stdout.splitlines() if "[Rank 0] step=" in line]
    assert progress == ["step=0", "step=2", "step=4", "step=6"]        # DeepSpeed also reports its step 0
    assert p.stdout.count("DeepSpeedEngine configuration:") == 1
    assert sum(1 for line in p.stdout.splitlines() if "time (ms) | fwd:" in line) == len(records) == 7


def test_train_refuses_the_jsons_problems_together_before_any_process_group(tmp_path):
    """One train.py run of a JSON with every kind of refusal: a scheduler key that disagrees with the experiment,
    fp16 where the accelerator has none (this CPU machine), a key the key table refuses, a ZeRO-3 key at stage 2
    and an unknown key: each reported by train.py, together, exit status 1, before any process group (DeepSpeed
    never started: nothing of its in the output, no run folder)."""
    from parallel.check import DeviceDtypes

    ds = json.load(open(os.path.join(ROOT, "ds_configs/zero2_bf16.json")))
    del ds["bf16"]
    ds.update(tensor_parallel={"autotp_size": 2}, wall_clock_breakdwn=True, fp16={"enabled": True},
              scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}})
    ds["zero_optimization"]["stage3_max_live_parameters"] = 10**8
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    out = tmp_path / "run"
    p = train_py("--config", "debug", "--deepspeed_config", str(path), "--set", f"train.output_dir={out}")
    assert p.returncode == 1 and not out.exists()
    fp16 = not DeviceDtypes.here().fp16
    assert f"train.py refused ({4 + fp16} problems):" in p.stderr
    assert (f"{path}: scheduler.params.warmup_max_lr=0.001 != train.lr=0.003; set --set "
            f"train.lr=0.001 or remove scheduler.params.warmup_max_lr") in p.stderr
    assert (f"{path}: fp16.enabled=true but the cpu accelerator on this machine has no fp16 (DeepSpeed's "
            f"is_fp16_supported() is false); use bf16") in p.stderr or not fp16
    assert f'{path}: "tensor_parallel" is refused: DeepSpeed\'s AutoTP would re-shard the toolkit\'s ' \
           f"tensor-parallel layers; use parallel.tp_size; remove it" in p.stderr
    assert f"{path}: zero_optimization.stage3_max_live_parameters with zero_optimization.stage=2 is refused: only " \
           f"ZeRO-3 reads it; remove it or use stage 3" in p.stderr
    assert f'{path}: unknown DeepSpeed key "wall_clock_breakdwn" (did you mean "wall_clock_breakdown"?)' in p.stderr
    assert "Traceback" not in p.stderr and "init_distributed" not in p.stdout + p.stderr
    assert "deepspeed" not in p.stdout.lower()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process, 6 steps of one micro-batch under WarmupCosineLR: the CSV monitor, the flops profiler
    (profile_step=2) and the comms logger at once; the uninterrupted run the resume test compares with."""
    folder = tmp_path_factory.mktemp("one_process")
    return folder, *_train_with(folder, {
        "scheduler": COSINE,
        "csv_monitor": None,
        "flops_profiler": {"enabled": True, "profile_step": 2, "module_depth": 1, "top_modules": 1},
        "comms_logger": {"enabled": True, "prof_all": True}}, steps=6, sets=COSINE_SETS)


COSINE = {"type": "WarmupCosineLR", "params": {"warmup_type": "linear", "warmup_min_ratio": 0.1}}
COSINE_SETS = ["train.grad_accum_steps=1", "train.decay_steps=6", "train.warmup_steps=3"]


def test_resumed_run_continues_the_json_schedule_exactly(one_process, tmp_path):
    """WarmupCosineLR, stopped after 3 steps and resumed to 6 (the checkpoint carries the schedule's position):
    the lr and the loss of steps 4-6 equal one uninterrupted run's (one_process's: the monitors and profilers it
    also carries do not touch the numbers)."""
    _, _, whole, _ = one_process
    parts = tmp_path / "parts"
    parts.mkdir()
    run = lambda steps: _train_with(parts, {"scheduler": COSINE}, steps=steps, sets=COSINE_SETS)[1]
    run(3)
    resumed = run(6)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [(r["lr"], r["loss"]) for r in resumed] == [(r["lr"], r["loss"]) for r in whole]
    assert len({r["lr"] for r in whole}) == 6


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Two ranks (torchrun's environment), 3 steps of CogVideo's zero2.yaml as shipped (bf16, ZeRO-2, its batch
    keys 1 and 1: the experiment says so too): tensorboard and wandb (offline) at once."""
    folder = tmp_path_factory.mktemp("launched")
    return folder, *_train_with(folder, {"tensorboard": None, "wandb": {"enabled": True, "project": "vdp"}},
                                sets=["train.micro_batch_size=1", "train.grad_accum_steps=1", "train.warmup_steps=2"],
                                env={"WANDB_MODE": "offline", "WANDB_DIR": str(folder)},
                                base=json.loads(COGVIDEO["zero2.yaml"]), launched=True)


def test_csv_monitor_gets_every_figure_of_metrics_jsonl(one_process):
    folder, _, records, figures = one_process
    for name in figures:
        csv = (folder / "csv_monitor" / "job" / f"train_{name}.csv").read_text()
        rows = [line.split(",") for line in csv.splitlines()[1:]]
        assert [int(r[0]) for r in rows] == [r["step"] for r in records] == [1, 2, 3, 4, 5, 6], name
        assert [float(r[1]) for r in rows] == pytest.approx([r[name] for r in records], rel=1e-12), name


def test_tensorboard_gets_every_figure_of_metrics_jsonl(launched):
    """The event file read back with tensorboard's own EventAccumulator: each figure's steps and values (stored
    as float32 by the summary writer) equal metrics.jsonl's. DeepSpeed adds its own Train/Samples/lr, by
    samples seen, written after its scheduler stepped: at step k's samples, the lr step k + 1 runs at."""
    pytest.importorskip("tensorboard", reason="the test extra installs tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, _, records, figures = launched
    events = EventAccumulator(str(folder / "tensorboard" / "job")).Reload()
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


def test_wandb_gets_every_figure_of_metrics_jsonl(launched):
    """wandb offline (WANDB_MODE=offline), its run file read back: every figure of every step, with the step as
    its x-axis ("step"), equal to metrics.jsonl's (JSON both ways: exact). wandb drops a log whose step is below
    the last it saw, and DeepSpeed logs Train/Samples/lr at the samples seen (2, 4, 6 here): figures logged at
    steps 1, 2, 3 would be lost (parallel/distributed/deepspeed/monitor.py write_monitor_events). Two
    launched ranks, which leave without the interpreter's teardown: the run file is whole only where the trainer
    ended the wandb run (close_monitors; without it no row reached the file)."""
    folder, p, records, figures = launched
    assert "Steps must be monotonically increasing" not in p.stdout + p.stderr
    [run] = list((folder / "wandb").glob("offline-run-*/run-*.wandb"))
    rows = [row for row in _wandb_history(run) if "train/loss" in row]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for name in figures:
        assert [row[f"train/{name}"] for row in rows] == [r[name] for r in records], name
    samples = [row["Train/Samples/lr"] for row in _wandb_history(run) if "Train/Samples/lr" in row]
    assert samples[:-1] == pytest.approx([r["lr"] for r in records][1:], rel=1e-12)


def test_flops_profiler_prints_its_profile_at_pp1(one_process):
    """DeepSpeed's flops profiler at parallel.pp_size=1, one micro-batch a step: one profile in train.py's output.
    profile_step counts DeepSpeed's global steps from 0, so profile_step=2 profiles the toolkit's step 3 and
    says so; its parameter count is the model's (the planner's count). The pipeline refusal is in
    tests/unit/test_ds_keys.py."""
    from parallel.experiment.config import load_config
    from parallel.plan.search import count_params
    from parallel.plan.trace import ActivationTracer

    _, p, _, _ = one_process
    assert p.stdout.count("DeepSpeed Flops Profiler") == 1
    assert "Profile Summary at step 3:" in p.stdout
    fields = dict(line.rsplit(":", 1) for line in p.stdout.splitlines() if line.count(":") == 1)
    n, unit = fields["params per GPU"].split()
    assert unit == "K" and float(n) * 1e3 == pytest.approx(count_params(ActivationTracer(load_config("debug"),
                                                                                         torch.float32))[0], abs=5)
    assert fields["batch size per GPU"].strip() == "2"


def test_comms_logger_prints_its_summary_at_pp1(one_process):
    """DeepSpeed's comms logger (prof_all) at tp = sp = pp = 1: train.py prints deepspeed.comm's summary after the
    last step, with the engine's gradient all-reduce once a step, of the model's fp32 gradients' size."""
    from deepspeed.utils.comms_logging import convert_size

    from parallel.experiment.config import load_config
    from parallel.plan.search import count_params
    from parallel.plan.trace import ActivationTracer

    _, p, records, _ = one_process
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
    assert rows["all_reduce"][convert_size(grads)] == len(records) == 6
    assert "broadcast" in rows       # the engine's initial parameter broadcast


# CogVideo's finetune/configs (zai-org/CogVideo), as shipped: JSON in .yaml files, HF-style "auto" filled by
# accelerate; ZeRO-3's sections repeat two keys ("auto", then a number: JSON's last one wins, as in HF's reader).
COGVIDEO_BASE = """{
    "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": true,
                                              "adam_w_mode": true}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {%s},
    "gradient_accumulation_steps": 1,
    "train_micro_batch_size_per_gpu": 1,
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "wall_clock_breakdown": false
}"""
ZERO2 = """"stage": 2, "allgather_partitions": true, "allgather_bucket_size": 2e8, "overlap_comm": true,
        "reduce_scatter": true, "reduce_bucket_size": 5e8, "contiguous_gradients": true"""
OFFLOAD_OPTIMIZER = """"offload_optimizer": {"device": "cpu", "pin_memory": true}"""
ZERO3 = """"stage": 3,%s "overlap_comm": true, "contiguous_gradients": true, "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto", "sub_group_size": 1e9,
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": "auto", "stage3_prefetch_bucket_size": 5e8,
        "stage3_param_persistence_threshold": %s"""
COGVIDEO = {
    "zero2.yaml": COGVIDEO_BASE % ZERO2,
    "zero2_offload.yaml": COGVIDEO_BASE % f"{ZERO2}, {OFFLOAD_OPTIMIZER}",
    "zero3.yaml": COGVIDEO_BASE % (ZERO3 % ("", "1e5")),
    "zero3_offload.yaml": COGVIDEO_BASE % (ZERO3 % (f' {OFFLOAD_OPTIMIZER}, "offload_param": {{"device": "cpu", '
                                                    f'"pin_memory": true}},', "1e6")),
}


def _write(folder, name, text):
    (folder / name).write_text(text)
    return str(folder / name)


def test_cogvideo_finetune_configs_pass_the_checker(tmp_path, capsys):
    """CogVideo's four DeepSpeed files with the CogVideoX-2B preset on 8 ranks: accepted, each "auto" filled from
    the experiment and the summary naming the key it came from; an "auto" the toolkit cannot fill is refused by
    name (not `could not convert string to float`)."""
    from parallel.check import main
    cfg = ["--config", "cogvideox-2b", "--world-size", "8"]
    common = ('optimizer.params.lr=0.0001 (train.lr), optimizer.params.weight_decay=0.0 (HF TrainingArguments\' '
              'default, and the toolkit\'s when the key is absent), scheduler.params.warmup_min_lr=0.0 (DeepSpeed\'s '
              'default, as HF fills it), scheduler.params.warmup_max_lr=0.0001 (train.lr), '
              'scheduler.params.warmup_num_steps=100 (train.warmup_steps), scheduler.params.total_num_steps=100 '
              '(train.max_steps), ')
    tail = ("train_batch_size=8 (train.micro_batch_size x train.grad_accum_steps x dp = 1 x 1 x 8), "
            "gradient_clipping=1.0 (HF TrainingArguments' max_grad_norm default, as ds_configs/ set it)\n")
    gather = ("zero_optimization.stage3_gather_16bit_weights_on_model_save=false (accelerate's default; python -m "
              "parallel.export writes the weights), ")
    for name, text in COGVIDEO.items():
        path = _write(tmp_path, name, text)
        assert main([*cfg, "--deepspeed_config", path]) == 0, capsys.readouterr().err
        stage = 3 if name.startswith("zero3") else 2
        assert capsys.readouterr().out == (
            f"ok: cogvideox-2b tp=1 pp=1 dp=8 (world 8), ZeRO-{stage} bf16, global batch 8 = micro 1 x accum 1 x dp 8; "
            f"tp splits num_heads 30/1, hidden_size 1920/1, ffn_hidden_size 7680/1; \"auto\" filled in {path}: "
            + common + (gather if stage == 3 else "") + tail)
    ds = json.loads(COGVIDEO["zero3.yaml"])
    ds["steps_per_print"], ds["zero_optimization"]["stage"] = "auto", "auto"
    ds["optimizer"]["params"]["adam_w_mode"] = False
    path = _write(tmp_path, "unfillable.json", json.dumps(ds))
    assert main([*cfg, "--deepspeed_config", path]) == 1
    err = capsys.readouterr().err
    fillable = ("train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps, gradient_clipping, "
                "optimizer.params.lr, optimizer.params.betas, optimizer.params.eps, optimizer.params.weight_decay, "
                "scheduler.params.warmup_min_lr, scheduler.params.warmup_max_lr, scheduler.params.warmup_num_steps, "
                "scheduler.params.total_num_steps, scheduler.params.warmup_min_ratio, scheduler.params.cos_min_ratio, "
                "bf16.enabled, bfloat16.enabled, fp16.enabled, zero_optimization.reduce_bucket_size, "
                "zero_optimization.stage3_prefetch_bucket_size, zero_optimization.stage3_param_persistence_threshold, "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save")
    for key in ("zero_optimization.stage", "steps_per_print"):
        assert f"  - {path}: {key}=\"auto\": the toolkit fills \"auto\" from the experiment only for {fillable}; " \
               f"give {key} a value\n" in err
    assert f"  - {path}: optimizer.params.adam_w_mode=false (Adam with L2 weight decay) is refused: the toolkit " \
           f"builds AdamW (decoupled weight decay); remove it or set it true\n" in err
    assert "Traceback" not in err


def test_cogvideo_zero2_trains_the_debug_model_on_two_ranks(launched):
    """CogVideo's zero2.yaml as shipped (its batch keys are 1 and 1: the experiment says so too) trains the debug
    model on 2 ranks (the monitors' run): WarmupDecayLR filled from train.lr / train.warmup_steps /
    train.max_steps runs DeepSpeed's log warmup (step k at log(k - 1) / log(2) of train.lr, from warmup_min_lr 0;
    three steps, since the first two both run at 0)."""
    _, p, records, _ = launched
    assert "ZeRO-2 bf16, global batch 2, 3 steps" in p.stdout       # train_batch_size "auto": 1 x 1 x dp 2
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["lr"] for r in records] == pytest.approx([0.0, 0.0, 3e-3], abs=1e-15)
    assert all(math.isfinite(r["loss"]) for r in records)


HF_AUTO = {    # the HF Trainer's DeepSpeed ZeRO-2 example: standard keys and "auto"
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": "auto",
                          "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def test_hf_auto_json_is_filled_and_a_plan_that_does_not_fit_is_refused_unless_allowed(tmp_path, capsys):
    """An HF Trainer DeepSpeed file of "auto" values: --check-only names what filled each; a run whose memory plan
    does not fit train.device_memory is refused before any process group (train.main in this process), naming the
    flag that starts it anyway; with that flag train.py trains, at the filled lr (three steps: DeepSpeed's log
    warmup runs the first two at 0)."""
    import torch.distributed as dist

    import train
    path = _write(tmp_path, "hf.json", json.dumps(HF_AUTO))
    out = tmp_path / "run"
    args = ["--config", "debug", "--deepspeed_config", path, "--set", "train.max_steps=3", "--set",
            "train.warmup_steps=2", "--set", f"train.output_dir={out}", "--set", "train.memory_check=false",
            "--set", "train.device_memory=1MiB"]
    assert train.main([*args, "--check-only"]) == 0
    assert capsys.readouterr().out == (
        f"ok: debug tp=1 pp=1 dp=1 (world 1), ZeRO-2 bf16, global batch 4 = micro 2 x accum 2 x dp 1; tp splits "
        f"num_heads 4/1, hidden_size 64/1, ffn_hidden_size 256/1; \"auto\" filled in {path}: "
        f"fp16.enabled=false (fp16 only when set true; bf16 is the toolkit's reduced precision), "
        f"bf16.enabled=true (the toolkit trains in bf16 unless told otherwise: set false for fp32), "
        f"optimizer.params.lr=0.003 (train.lr), optimizer.params.betas=[0.9, 0.999] (HF TrainingArguments' default, "
        f"and the toolkit's when the key is absent), optimizer.params.eps=1e-08 (HF TrainingArguments' default, and "
        f"the toolkit's when the key is absent), optimizer.params.weight_decay=0.0 (HF TrainingArguments' default, "
        f"and the toolkit's when the key is absent), scheduler.params.warmup_min_lr=0.0 (DeepSpeed's default, as HF "
        f"fills it), scheduler.params.warmup_max_lr=0.003 (train.lr), scheduler.params.warmup_num_steps=2 "
        f"(train.warmup_steps), scheduler.params.total_num_steps=3 (train.max_steps), "
        f"zero_optimization.reduce_bucket_size=4096 (model.hidden_size^2, as HF fills it), "
        f"gradient_accumulation_steps=2 (train.grad_accum_steps), gradient_clipping=1.0 (HF TrainingArguments' "
        f"max_grad_norm default, as ds_configs/ set it), train_batch_size=4 (train.micro_batch_size x "
        f"train.grad_accum_steps x dp = 2 x 2 x 1), train_micro_batch_size_per_gpu=2 (train.micro_batch_size)\n")
    assert train.main(args) == 1
    err = capsys.readouterr().err
    assert not out.exists() and not dist.is_initialized(), err[-3000:]
    refusal = err[err.index("train.py refused"):]
    assert re.fullmatch(
        r"train.py refused \(1 problem\):\n  - memory plan: the worst rank \(stage 0\) needs [\d.]+ \w+ "
        r"of train.device_memory=1MiB, short by [\d.]+ \w+: tp=1 pp=1 dp=1 ZeRO-2 bf16 does not fit; python -m "
        r"parallel.plan --world-size 1 --device-memory 1.0MiB --search \(with this run's --config, "
        r"--deepspeed-config and --set\) lists the layouts that do; or set --set train.allow_oversubscribe=true to "
        r"start anyway\n", refusal), refusal
    p = train_py(*args, "--set", "train.allow_oversubscribe=true")
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(r"memory plan: worst rank \(stage 0\) [\d.]+ \w+ of 1.0 MiB \(DOES NOT FIT;", p.stdout)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records] == pytest.approx([0.0, 0.0, 3e-3], abs=1e-15)
