"""DeepSpeed sections the toolkit hands on: the monitors get metrics.jsonl's figures, and optimizer offload
trains like the one-process run."""
import copy
import json
import os

import pytest

from tests.test_train_cli import ROOT, train_py
from tests.train_utils import assert_matches, fp32_config, train


def test_csv_monitor_gets_every_figure_of_metrics_jsonl(tmp_path):
    ds = json.load(open(os.path.join(ROOT, "ds_configs/zero0_fp32.json")))
    ds["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "job"}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = tmp_path / "run"
    p = train_py("--config", "debug", "--deepspeed_config", str(tmp_path / "ds.json"), "--set", "train.max_steps=3",
                 "--set", f"train.output_dir={out}", "--set", "train.memory_check=false")
    assert p.returncode == 0, p.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    figures = sorted(k for k in records[0] if k != "step" and records[0][k] is not None)
    assert {"loss", "lr", "grad_norm", "step_time_s", "samples_per_s", "tokens_per_s"} <= set(figures)
    for name in figures:
        rows = [line.split(",") for line in (tmp_path / "csv" / "job" / f"train_{name}.csv").read_text().splitlines()[1:]]
        assert [int(r[0]) for r in rows] == [1, 2, 3], name
        assert [float(r[1]) for r in rows] == pytest.approx([r[name] for r in records], rel=1e-12), name


def _offloaded(rank, world_size, ds):
    from parallel.config import load_config
    from parallel.dist.topology import ParallelContext, ParallelDims
    from parallel.train.engine import build_trainer

    ctx = ParallelContext.build(ParallelDims(tp_size=1, sp_size=1, pp_size=1, dp_size=world_size))
    zero = build_trainer(load_config("debug"), ds, ctx).engine.optimizer
    return type(zero).__name__, zero.cpu_offload


def test_zero2_cpu_optimizer_offload_trains_like_one_process():
    """ZeRO-2 at dp 2 with the optimizer states and step on the CPU (DeepSpeed's offload_optimizer, running
    the toolkit's torch AdamW): per-step losses on both ranks and the final weights equal one process's."""
    ds = fp32_config(stage=2)
    ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    from tests.dist_utils import run_ranks

    assert run_ranks(_offloaded, 1, copy.deepcopy(ds)) == [("DeepSpeedZeroOptimizer", True)]
    reference = train(1, 1, 1, fp32_config())
    assert_matches(train(1, 1, 2, copy.deepcopy(ds)), reference)
