"""The table of DeepSpeed's JSON keys: complete against DeepSpeed's own reader, rendered into the docs,
each refusal made before launch, and the engine keys passed through doing what DeepSpeed says."""
import importlib.util
import json
import os

import pytest

from parallel.check import check
from parallel.experiment.config import load_config
from parallel.experiment.ds_keys import KEYS, REFUSED, STAGE3_ONLY, SUBKEYS, ZERO_KEYS, render

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def keys_deepspeed_reads(monkeypatch, section=None) -> set[str]:
    """Every top-level key DeepSpeedConfig looks up (get, [], in, keys()), from an almost empty JSON; with a
    world of one so the branch that reads sequence_parallel_size runs too. With `section`: the keys it
    looks up inside that (empty) section."""
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
    if section is not None:
        ds_config.DeepSpeedConfig({"train_batch_size": 1, section: Recording()})
        return seen
    ds_config.DeepSpeedConfig(Recording({"train_batch_size": 1}))
    return seen | set(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)


def test_table_has_every_key_deepspeed_reads_and_no_other(monkeypatch):
    from deepspeed.runtime import config as ds_config

    read = keys_deepspeed_reads(monkeypatch)
    assert len(read) > 50
    assert sorted(read - KEYS.keys()) == [], "keys DeepSpeed reads that parallel/experiment/ds_keys.py does not decide"
    assert sorted(KEYS.keys() - read) == [], "keys in parallel/experiment/ds_keys.py that DeepSpeed no longer reads"
    assert [k for k in ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS if KEYS[k].verdict != REFUSED] == []


def test_docs_are_the_rendered_table():
    with open(os.path.join(ROOT, "docs", "deepspeed-keys.md")) as f:
        assert f.read() == render(), "regenerate: python -m parallel.experiment.ds_keys > docs/deepspeed-keys.md"


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
    ({"comms_logger": {"enabled": True}}, 2, "c.json: comms_logger.enabled=true with parallel.tp_size=1, "
     "sp_size=1, pp_size=2 is refused: DeepSpeed's summary divides busbw by the whole world's size"),
    ({"comms_logger": {"enabled": True, "verbose": True}}, 1, "c.json: comms_logger.verbose=true would print "
     "nothing"),
    ({"comms_logger": {"enabled": True, "prof_al": True}}, 1, "c.json: unknown key comms_logger.prof_al (did you "
     "mean \"prof_all\"?); DeepSpeed would refuse it inside initialize"),
])
def test_conditional_refusals(ds, pp, expected):
    cfg = load_config("debug", [f"parallel.pp_size={pp}"])
    _, problems = check(cfg, ds, "c.json")
    assert len(problems) == 1 and problems[0].startswith(expected), problems


@pytest.mark.parametrize("monitor, package", [("tensorboard", "tensorboard"), ("wandb", "wandb"),
                                              ("comet", "comet_ml")])
def test_monitor_without_its_package_is_refused(monitor, package, monkeypatch):
    """Whatever this environment has installed: the package looked up as missing."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else find_spec(name, *a))
    cfg = load_config("debug")
    ds = {monitor: {"enabled": True}}
    expected = (f"c.json: {monitor}.enabled=true but the {package} package is not installed (DeepSpeed would fail in "
                f"initialize); install it or use csv_monitor")
    assert check(cfg, ds, "c.json")[1] == [expected]


def test_honoured_values_of_the_same_keys_pass():
    cfg = load_config("debug", ["parallel.pp_size=2"])
    ds = {"zero_force_ds_cpu_optimizer": False, "managed_gradient_accumulation": True, "steps_per_print": 10**6,
          "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}, "flops_profiler": {"enabled": False},
          "dump_state": True, "memory_breakdown": True, "log_level": "info"}
    assert check(cfg, ds, "c.json")[1] == []
    assert check(load_config("debug"), {"flops_profiler": {"enabled": True}}, "c.json")[1] == []
    comms = {"comms_logger": {"enabled": True, "prof_all": True, "verbose": True}, "log_level": "info"}
    assert check(load_config("debug"), comms, "c.json")[1] == []
    tp2 = check(load_config("debug", ["parallel.tp_size=2"]), comms, "c.json", world_size=2)[1]
    assert [p.split(" is refused")[0] for p in tp2] == ["c.json: comms_logger.enabled=true with parallel.tp_size=2, "
                                                        "sp_size=1, pp_size=1"]


def test_optimizer_params_are_checked():
    cfg = load_config("debug")
    takes = "lr, betas, eps, weight_decay, amsgrad, torch_adam, adam_w_mode"
    ds = {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95], "adam_w_mode": False, "ema_decay": 0.99,
                                                    "weight_decy": 0.1, "torch_adam": "yes"}, "legacy_fusion": False}}
    assert check(cfg, ds, "o.json")[1] == [
        "o.json: optimizer.legacy_fusion is refused: the toolkit builds the optimizer from type and params only; "
        "remove it",
        "o.json: optimizer.params.adam_w_mode=false (Adam with L2 weight decay) is refused: the toolkit builds AdamW "
        "(decoupled weight decay); remove it or set it true",
        "o.json: optimizer.params.ema_decay is refused (ema_decay needs FusedEmaAdam or EmaAdamW): the toolkit's "
        f"AdamW takes {takes}",
        "o.json: optimizer.params.weight_decy is refused (did you mean \"weight_decay\"?): the toolkit's AdamW takes "
        f"{takes}",
        "o.json: optimizer.params.torch_adam='yes': give true or false"]
    ds = {"optimizer": {"type": "FusedEmaAdam", "params": {"ema_decay": 0.99, "eps": 1e-8}}}
    assert check(cfg, ds, "o.json")[1] == []
    # DeepSpeed's Adam switches as CogVideo's finetune configs set them: the toolkit's AdamW either way
    ds = {"optimizer": {"type": "AdamW", "params": {"torch_adam": True, "adam_w_mode": True}}}
    assert check(cfg, ds, "o.json")[1] == []


def test_zero_table_is_deepspeeds_zero_config():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = DeepSpeedZeroConfig.model_fields
    theirs = set(fields) | {f.alias for f in fields.values() if f.alias}
    assert sorted(theirs - ZERO_KEYS.keys()) == [], "zero_optimization keys DeepSpeed reads that the table lacks"
    assert sorted(ZERO_KEYS.keys() - theirs) == [], "zero_optimization keys in the table DeepSpeed no longer reads"


@pytest.mark.parametrize("key", sorted(k for k, v in ZERO_KEYS.items() if v.verdict == REFUSED))
def test_every_refused_zero_key_is_refused_with_the_reason(key):
    _, problems = check(load_config("debug"), {"zero_optimization": {"stage": 3, key: 1}}, "z.json")
    how = ZERO_KEYS[key].how.removesuffix("; remove it")
    assert problems == [f"z.json: zero_optimization.{key} is refused: {how}; remove it"]


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


def test_keys_inside_sections_are_deepspeeds(monkeypatch):
    """Dict-style sections: the keys DeepSpeed looks up in them; pydantic ones: the model's fields."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.monitor.config import DeepSpeedMonitorConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config

    models = {"fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config, "bfloat16": DeepSpeedBF16Config,
              "comms_logger": CommsLoggerConfig,
              **{k: f.annotation for k, f in DeepSpeedMonitorConfig.model_fields.items()}}
    for section, (known, silently) in SUBKEYS.items():
        if silently:
            assert keys_deepspeed_reads(monkeypatch, section) == set(known), section
        else:
            fields = models[section].model_fields
            assert set(fields) | {f.alias for f in fields.values() if f.alias} == set(known), section
    assert sorted(set(models) - SUBKEYS.keys()) == []


def test_unknown_keys_inside_sections_are_refused():
    ds = {"activation_checkpointing": {"partition_activation": True}, "bf16": {"enabled": True, "loss_scale": 0}}
    assert check(load_config("debug"), ds, "s.json")[1] == [
        's.json: unknown key activation_checkpointing.partition_activation (did you mean "partition_activations"?); '
        "DeepSpeed would ignore it silently; it reads partition_activations, contiguous_memory_optimization, "
        "cpu_checkpointing, number_checkpoints, synchronize_checkpoint_boundary, profile",
        "s.json: unknown key bf16.loss_scale; DeepSpeed would refuse it inside initialize; it reads enabled, "
        "immediate_grad_update, check_grad_overflow, bf16_master_weights_and_grads, bf16_optimizer_states"]
