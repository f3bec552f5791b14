"""The table of DeepSpeed's JSON keys: complete against DeepSpeed's own reader, rendered into the docs,
each refusal made before launch, and the engine keys passed through doing what DeepSpeed says."""
import importlib.util
import json
import os

import pytest

from parallel.check import check
from parallel.config import load_config
from parallel.ds_keys import KEYS, REFUSED, STAGE3_ONLY, ZERO_KEYS, render
from tests.test_train_cli import ROOT, train_py


def keys_deepspeed_reads(monkeypatch) -> set[str]:
    """Every top-level key DeepSpeedConfig looks up (get, [], in, keys()), from an almost empty JSON; with a
    world of one so the branch that reads sequence_parallel_size runs too."""
    from deepspeed.runtime import config as ds_config

    seen = set()

    class Keys(set):
        def __contains__(self, k):
            seen.add(k)
            return super().__contains__(k)

    class Recording(dict):
        def get(self, k, *default):
            seen.add(k)
            return super().get(k, *default)

        def __getitem__(self, k):
            seen.add(k)
            return super().__getitem__(k)

        def __contains__(self, k):
            seen.add(k)
            return super().__contains__(k)

        def keys(self):
            return Keys(super().keys())

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: 1)
    ds_config.DeepSpeedConfig(Recording({"train_batch_size": 1}))
    return seen | set(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)


def test_table_has_every_key_deepspeed_reads_and_no_other(monkeypatch):
    from deepspeed.runtime import config as ds_config

    read = keys_deepspeed_reads(monkeypatch)
    assert len(read) > 50
    assert sorted(read - KEYS.keys()) == [], "keys DeepSpeed reads that parallel/ds_keys.py does not decide"
    assert sorted(KEYS.keys() - read) == [], "keys in parallel/ds_keys.py that DeepSpeed no longer reads"
    assert [k for k in ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS if KEYS[k].verdict != REFUSED] == []


def test_docs_are_the_rendered_table():
    with open(os.path.join(ROOT, "docs", "deepspeed-keys.md")) as f:
        assert f.read() == render(), "regenerate: python -m parallel.ds_keys > docs/deepspeed-keys.md"


@pytest.mark.parametrize("key", sorted(k for k, v in KEYS.items() if v.verdict == REFUSED))
def test_every_refused_key_is_refused_with_the_reason(key):
    _, problems = check(load_config("debug"), {key: {}}, "r.json")
    assert problems == [f'r.json: "{key}" is refused: {KEYS[key].how}; remove it']


def test_unknown_keys_get_a_did_you_mean():
    _, problems = check(load_config("debug"), {"wall_clock_breakdwn": True, "monitor_config": {}}, "u.json")
    assert problems == ['u.json: unknown DeepSpeed key "wall_clock_breakdwn" (did you mean "wall_clock_breakdown"?); '
                        'DeepSpeed would ignore it silently',
                        'u.json: unknown DeepSpeed key "monitor_config"; DeepSpeed would ignore it silently']


def test_shipped_configs_pass():
    cfg = load_config("debug")
    for name in sorted(os.listdir(os.path.join(ROOT, "ds_configs"))):
        ds = json.load(open(os.path.join(ROOT, "ds_configs", name)))
        assert check(cfg, ds, name, world_size=2)[1] == [], name


HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@pytest.mark.parametrize("ds, pp, expected", [
    ({"zero_force_ds_cpu_optimizer": True}, 1, "c.json: zero_force_ds_cpu_optimizer=true is refused: it demands "
     "DeepSpeed's CPU Adam, and the toolkit builds the optimizer (torch's AdamW, which offload runs on the CPU); "
     "remove it"),
    ({"managed_gradient_accumulation": False}, 1, "c.json: managed_gradient_accumulation=false is refused"),
    ({"pipeline": {"pipe_partitioned": True}}, 2, "c.json: pipeline.pipe_partitioned=True is refused: the "
     "toolkit's stages pass two tensors and DeepSpeed partitions only the first"),
    ({"pipeline": {"partition": "uniform"}}, 2, "c.json: pipeline.partition is refused: DeepSpeed's engine does not "
     "read it from the JSON"),
    ({"flops_profiler": {"enabled": True}}, 2, "c.json: flops_profiler.enabled=true with parallel.pp_size=2 is "
     "refused: DeepSpeed's pipeline engine never prints it; profile with parallel.pp_size=1"),
    ({"steps_per_print": 10}, 1, "c.json: steps_per_print=10 would print nothing: DeepSpeed logs it at INFO and its "
     "logger is at WARNING; add \"log_level\": \"info\" (or set steps_per_print above train.max_steps=40 to say "
     "never)"),
    ({"dump_state": True, "log_level": "error"}, 1, "c.json: dump_state=true would print nothing: DeepSpeed logs it "
     "at INFO and its logger is at error"),
    ({"memory_breakdown": True}, 1, "c.json: memory_breakdown=true would print nothing"),
    pytest.param({"tensorboard": {"enabled": True, "output_path": "tb"}}, 1, "c.json: tensorboard.enabled=true but "
                 "the tensorboard package is not installed (DeepSpeed would fail in initialize); install it or use "
                 "csv_monitor", marks=pytest.mark.skipif(HAS_TENSORBOARD, reason="tensorboard is installed")),
])
def test_conditional_refusals(ds, pp, expected):
    cfg = load_config("debug", [f"parallel.pp_size={pp}"])
    _, problems = check(cfg, ds, "c.json")
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_honoured_values_of_the_same_keys_pass():
    cfg = load_config("debug", ["parallel.pp_size=2"])
    ds = {"zero_force_ds_cpu_optimizer": False, "managed_gradient_accumulation": True, "steps_per_print": 10**6,
          "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}, "flops_profiler": {"enabled": False},
          "dump_state": True, "memory_breakdown": True, "log_level": "info"}
    assert check(cfg, ds, "c.json")[1] == []
    assert check(load_config("debug"), {"flops_profiler": {"enabled": True}}, "c.json")[1] == []


def test_optimizer_params_are_checked():
    cfg = load_config("debug")
    ds = {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95], "adam_w_mode": True, "ema_decay": 0.99,
                                                    "weight_decy": 0.1}, "legacy_fusion": False}}
    assert check(cfg, ds, "o.json")[1] == [
        "o.json: optimizer.legacy_fusion is refused: the toolkit builds the optimizer from type and params only; "
        "remove it",
        "o.json: optimizer.params.adam_w_mode is refused: the toolkit's AdamW takes lr, betas, eps, weight_decay, "
        "amsgrad",
        "o.json: optimizer.params.ema_decay is refused (ema_decay needs FusedEmaAdam or EmaAdamW): the toolkit's AdamW takes lr, betas, eps, weight_decay, amsgrad",
        "o.json: optimizer.params.weight_decy is refused (did you mean \"weight_decay\"?): the toolkit's AdamW takes "
        "lr, betas, eps, weight_decay, amsgrad"]
    ds = {"optimizer": {"type": "FusedEmaAdam", "params": {"ema_decay": 0.99, "eps": 1e-8}}}
    assert check(cfg, ds, "o.json")[1] == []


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


def _first_update(rank, world_size, clips):
    """The largest weight change of the first AdamW step under each gradient_clipping value."""
    import copy

    from parallel.dist.seed import seed_all
    from parallel.dist.topology import ParallelContext, ParallelDims
    from parallel.train.engine import build_trainer
    from parallel.train.run import training_batches

    cfg = load_config("debug", ["train.warmup_steps=0"])
    ctx = ParallelContext.build(ParallelDims(tp_size=1, sp_size=1, pp_size=1, dp_size=1))
    out = []
    for clip in clips:
        ds = json.load(open(os.path.join(ROOT, "ds_configs/zero0_fp32.json")))
        ds["gradient_clipping"] = clip
        seed_all(cfg.train.seed)
        trainer = build_trainer(cfg, ds, ctx)
        before = copy.deepcopy(trainer.engine.module.state_dict())
        result = trainer.train_step(training_batches(cfg, ctx))
        after = trainer.engine.module.state_dict()
        out.append((result.lr, result.grad_norm, max(float((after[k] - v).abs().max()) for k, v in before.items())))
    return out


def test_gradient_clipping_reaches_the_step():
    """Adam's first step moves a weight by lr g / (|g| + eps): about lr unclipped, and about lr x clip-scaled g /
    eps when the gradient is clipped to a norm of 1e-12 (eps 1e-8): DeepSpeed clips with the JSON's value."""
    from tests.dist_utils import run_ranks

    (lr, norm, free), (_, norm_clipped, clipped) = run_ranks(_first_update, 1, (1e9, 1e-12))[0]
    assert norm == pytest.approx(norm_clipped) and norm > 1e-3          # the norm reported is before clipping
    assert lr * 0.5 < free <= lr * 1.0001
    assert clipped < lr * 1e-3


def test_zero_table_is_deepspeeds_zero_config():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    theirs = set(DeepSpeedZeroConfig.model_fields) | {f.alias for f in DeepSpeedZeroConfig.model_fields.values() if f.alias}
    assert sorted(theirs - ZERO_KEYS.keys()) == [], "zero_optimization keys DeepSpeed reads that the table lacks"
    assert sorted(ZERO_KEYS.keys() - theirs) == [], "zero_optimization keys in the table DeepSpeed no longer reads"


@pytest.mark.parametrize("key", sorted(k for k, v in ZERO_KEYS.items() if v.verdict == REFUSED))
def test_every_refused_zero_key_is_refused_with_the_reason(key):
    _, problems = check(load_config("debug"), {"zero_optimization": {"stage": 3, key: 1}}, "z.json")
    assert problems == [f"z.json: zero_optimization.{key} is refused: {ZERO_KEYS[key].how.removesuffix('; remove it')}; "
                        f"remove it"]


def test_zero_keys_against_the_stage():
    cfg = load_config("debug")
    for key in sorted(STAGE3_ONLY):
        assert check(cfg, {"zero_optimization": {"stage": 3, key: 1}}, "z.json")[1] == [], key
        assert check(cfg, {"zero_optimization": {"stage": 2, key: 1}}, "z.json")[1] == [
            f"z.json: zero_optimization.{key} with zero_optimization.stage=2 is refused: only ZeRO-3 reads it; "
            f"remove it or use stage 3"], key
    offload = {"offload_optimizer": {"device": "cpu"}}
    assert check(cfg, {"zero_optimization": {"stage": 2, **offload}}, "z.json")[1] == []
    assert check(cfg, {"zero_optimization": {"stage": 0, **offload}}, "z.json")[1] == [
        "z.json: zero_optimization.offload_optimizer with zero_optimization.stage=0 is refused: DeepSpeed offloads "
        "only under ZeRO 1-3; use stage 1 or 2"]
    assert check(cfg, {"zero_optimization": {"stage": 2, "reduce_bucket_sz": 1}}, "z.json")[1] == [
        'z.json: unknown key zero_optimization.reduce_bucket_sz (did you mean "reduce_bucket_size"?); DeepSpeed '
        'would refuse it inside initialize']
    assert check(cfg, {"zero_optimization": {"stage": 2, "compute_grad_norm": False}}, "z.json")[1] == [
        "z.json: zero_optimization.compute_grad_norm=false is refused: the toolkit logs grad_norm and clips with it; "
        "remove it"]


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
