"""The checker's verdicts for the presets and each refusal, through the CLI as users run it."""
import json

import pytest

from parallel.check import check, main, valid_tp_sizes
from parallel.experiment.config import load_config

TP4_MESSAGE = ("model.num_heads=30 is not divisible by parallel.tp_size=4; tp sizes that divide every split "
               "dimension of this model: 1, 2, 3, 5, 6, 10, 15, 30")


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cogvideox_2b_tp4_is_refused_with_working_sizes(capsys):
    code, out, err = run(capsys, "--config", "configs/cogvideox-2b.yaml", "--set", "parallel.tp_size=4")
    assert code == 1 and TP4_MESSAGE in err and out == ""


def test_cogvideox_2b_tp2_passes_with_one_line(capsys):
    code, out, err = run(capsys, "--config", "configs/cogvideox-2b.yaml", "--set", "parallel.tp_size=2",
                         "--deepspeed_config", "ds_configs/zero1_bf16.json", "--world-size", "8")
    assert code == 0 and err == ""
    assert out.strip().splitlines() == [out.strip()]
    assert out.startswith("ok: cogvideox-2b tp=2 pp=1 dp=4 (world 8), ZeRO-1 bf16, global batch 4")


@pytest.mark.parametrize("preset, expected", [
    ("cogvideox-2b", [1, 2, 3, 5, 6, 10, 15, 30]),
    ("cogvideox-5b", [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]),
    ("opensora-stdit3", [1, 2, 4, 8, 16]),
    ("debug", [1, 2, 4]),
    ("debug-stdit", [1, 2, 4]),
    ("wan2.1-i2v-14b-480p", [1, 2, 4, 8]),           # the image k/v and norm_added_k split as the text's
    ("debug-wan-i2v", [1, 2, 4]),
])
def test_valid_tp_sizes_per_preset(preset, expected):
    assert valid_tp_sizes(load_config(preset).model) == expected


def test_all_ds_configs_pass_at_pp1_and_pipeline_safe_one_at_pp2():
    cfg = load_config("debug")
    for name in ("zero0_fp32", "zero1_bf16", "zero2_bf16", "zero2_bf16_ema", "zero3_bf16", "zero3_bf16_offload"):
        ds = json.load(open(f"ds_configs/{name}.json"))
        assert check(cfg, ds, name, world_size=2)[1] == [], name
    cfg = load_config("debug", ["parallel.pp_size=2", "parallel.tp_size=2"])
    for name in ("zero0_fp32", "zero1_bf16"):
        assert check(cfg, json.load(open(f"ds_configs/{name}.json")), name, world_size=8)[1] == [], name


def test_every_violation_is_reported_at_once():
    cfg = load_config("cogvideox-2b", ["parallel.tp_size=4", "parallel.pp_size=4", "train.micro_batch_size=2"])
    ds = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "fp16": {"enabled": True},
          "train_batch_size": 64, "activation_checkpoint": {}}
    layout, problems = check(cfg, ds, "my.json", world_size=24)
    text = "\n".join(problems)
    assert TP4_MESSAGE in text
    assert "model.num_layers=30 is not divisible by parallel.pp_size=4; pp sizes with equal stages: 1, 2, 3, 5, 6, 10, 15, 30" in text
    assert "world size 24 is not divisible by parallel.tp_size x parallel.pp_size = 4 x 4 = 16" in text
    assert "my.json: train_batch_size=64 != train.micro_batch_size x train.grad_accum_steps x dp_size = 2 x 1 x 1 = 2" in text
    assert "my.json: zero_optimization.stage=2 with parallel.pp_size=4" in text
    assert "my.json: bf16.enabled and fp16.enabled are both true" in text
    assert 'my.json: unknown DeepSpeed key "activation_checkpoint" (did you mean "activation_checkpointing"?)' in text
    assert len(problems) == 7


def test_bf16_pipeline_needs_zero1_and_fp32_accumulation():
    cfg = load_config("debug", ["parallel.pp_size=2"])
    _, problems = check(cfg, {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}, "x.json", 2)
    assert problems == ['x.json: bf16.enabled=true with parallel.pp_size=2 needs zero_optimization.stage=1 and '
                        'data_types.grad_accum_dtype="fp32" on DeepSpeed 0.19 (found stage=1, grad_accum_dtype=None); '
                        'see ds_configs/zero1_bf16.json']


def test_bf16_zero0_with_fp32_accumulation_is_refused():
    _, problems = check(load_config("debug"), {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
                        "z.json", 1)
    assert problems == ['z.json: bf16 with zero_optimization.stage=0 and data_types.grad_accum_dtype="fp32" is not '
                        'implemented in DeepSpeed 0.19; use stage 1 (ds_configs/zero1_bf16.json) or drop '
                        'grad_accum_dtype']


def test_dp_and_batch_keys_must_agree():
    cfg = load_config("debug", ["parallel.dp_size=2", "train.grad_accum_steps=2"])
    layout, problems = check(cfg, {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"},
                             "d.json", world_size=4)
    assert layout.dp_size == 2 and layout.global_batch == 2 * 2 * 2
    assert problems == [
        "parallel.dp_size=2 but world size 4 = tp 1 x pp 1 x dp 4; set --set parallel.dp_size=4 (or null), or "
        "launch 2 processes",
        "d.json: train_micro_batch_size_per_gpu=4 != train.micro_batch_size=2; remove it from the JSON (the toolkit "
        "fills it in from the experiment) or set it to 2"]


def test_optimizer_type_and_lr_are_checked():
    cfg = load_config("debug")
    ds = {"optimizer": {"type": "Lamb", "params": {"lr": 0.5}}}
    _, problems = check(cfg, ds, "o.json")
    assert problems == [
        "o.json: optimizer.type='Lamb' is not built by the toolkit; use AdamW, Adam, FusedEmaAdam or EmaAdamW "
        "(the last two keep an EMA of the weights)",
        "o.json: optimizer.params.lr=0.5 != train.lr=0.003; the schedule starts from train.lr: set "
        "--set train.lr=0.5 or remove optimizer.params.lr"]


def test_pp_partition_is_checked():
    assert check(load_config("debug", ["parallel.pp_size=3", "parallel.pp_partition=[1, 2, 1]"]))[1] == []
    _, problems = check(load_config("debug", ["parallel.pp_size=2", "parallel.pp_partition=[1, 2]"]))
    assert problems == ["parallel.pp_partition=[1, 2] must list 2 stage sizes (parallel.pp_size), each >= 1, "
                        "summing to model.num_layers=4"]


def test_malformed_json_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "ds.json"
    bad.write_text('{\n  "bf16": {"enabled": true},\n  "zero_optimization": {"stage": 1,}\n}\n')
    code, _, err = run(capsys, "--config", "debug", "--deepspeed_config", str(bad))
    assert code == 1 and f"{bad}:3:" in err and "malformed JSON" in err


def test_config_and_json_errors_reported_together(tmp_path, capsys):
    bad = tmp_path / "ds.json"
    bad.write_text("[1, 2]")
    code, _, err = run(capsys, "--config", "debug", "--set", "parallel.tp_size=x", "--deepspeed_config", str(bad))
    assert code == 1 and "2 problems" in err and "parallel.tp_size" in err and "expected a JSON object" in err


def test_sequence_parallel_sizes_are_checked_against_heads_and_the_padding_stated(capsys):
    """sp = ulysses x ring: Ulysses splits the heads of a tp rank inside attention, ring attention takes any
    head count; the token sequence (text included) is split outside, padded to a multiple of sp. With
    parallel.ring_size unset, sp is all Ulysses where that divides the heads, ring for the rest."""
    code, out, err = run(capsys, "--config", "configs/cogvideox-2b.yaml", "--set", "parallel.sp_size=4")
    assert code == 0 and out.startswith("ok: cogvideox-2b tp=1 sp=4 (ulysses 2 x ring 2) pp=1 dp=1 (world 4)")
    assert out.rstrip().endswith("; (ulysses, ring) pairs for sp 4: ulysses 1 x ring 4, ulysses 2 x ring 2")
    code, _, err = run(capsys, "--config", "configs/cogvideox-2b.yaml", "--set", "parallel.sp_size=4",
                       "--set", "parallel.ring_size=1")
    assert code == 1 and ("model.num_heads=30 / parallel.tp_size=1 = 30 heads per tp rank is not divisible by the "
                          "Ulysses degree parallel.sp_size / parallel.ring_size = 4 / 1 = 4; (ulysses, ring) pairs "
                          "that work for sp 4: ulysses 1 x ring 4, ulysses 2 x ring 2; set --set "
                          "parallel.ring_size=2") in err
    code, out, _ = run(capsys, "--config", "configs/cogvideox-2b.yaml", "--set", "parallel.sp_size=4", "--set",
                       "parallel.ring_size=2")                          # the advice, followed
    assert code == 0 and "sp=4 (ulysses 2 x ring 2)" in out
    code, _, err = run(capsys, "--config", "configs/cogvideox-2b.yaml", "--set", "parallel.sp_size=4",
                       "--set", "parallel.ring_size=3")
    assert code == 1 and "parallel.ring_size=3 does not divide parallel.sp_size=4" in err
    # 226 text + 13 x 48 x 85 video tokens = 53,266 = 2 x 26,633: sp 4 divides the 48 / 2 heads, and the
    # tokens are padded to 4 x 13,317.
    code, out, err = run(capsys, "--config", "configs/cogvideox-5b-long.yaml", "--set", "parallel.sp_size=4")
    assert code == 0 and err == "" and out.startswith("ok: cogvideox-5b-long tp=2 sp=4 pp=1 dp=1 (world 8)")
    assert "; sp pads the sequence: 53,266 tokens padded to 53,268 for sp 4; (ulysses, ring) pairs for sp 4: " \
           "ulysses 1 x ring 4, ulysses 2 x ring 2, ulysses 4 x ring 1" in out
    code, out, err = run(capsys, "--config", "configs/cogvideox-5b-long.yaml", "--set", "parallel.sp_size=16")
    assert code == 0 and "sp=16 (ulysses 8 x ring 2)" in out
    # STDiT's spatial and temporal attentions regroup the sequence: its ring splits whole frames. At 3 latent
    # frames (48 tokens) sp 3 runs as ring 3 (a frame a rank), sp 5 neither divides the heads nor the frames, and
    # ring 2 is refused; at 4 frames ring 2 runs.
    code, out, _ = run(capsys, "--config", "configs/debug-stdit.yaml", "--set", "parallel.sp_size=3")
    assert code == 0 and "sp=3 (ulysses 1 x ring 3)" in out
    code, _, err = run(capsys, "--config", "configs/debug-stdit.yaml", "--set", "parallel.sp_size=5")
    assert code == 1 and ("model.num_heads=4 / parallel.tp_size=1 = 4 heads per tp rank is not divisible by "
                          "parallel.sp_size=5 (attention splits them over sp ranks); sp sizes that work with "
                          "parallel.tp_size=1: 1, 2, 3, 4, 6, 12; set --set parallel.sp_size=4") in err
    code, _, err = run(capsys, "--config", "configs/debug-stdit.yaml", "--set", "parallel.sp_size=2", "--set",
                       "parallel.ring_size=2")
    assert code == 1 and ("parallel.ring_size=2: model.family=stdit's ring attention splits whole frames (spatial "
                          "attention within a frame, temporal across frames): parallel.ring_size must divide the 3 "
                          "latent frames and parallel.sp_size=2 the 48 tokens; (ulysses, ring) pairs for sp 2: "
                          "ulysses 2 x ring 1") in err
    code, out, _ = run(capsys, "--config", "configs/debug-stdit.yaml", "--set", "parallel.sp_size=4", "--set",
                       "data.num_frames=13")
    assert code == 0 and ("(ulysses, ring) pairs for sp 4: ulysses 1 x ring 4, ulysses 2 x ring 2, ulysses 4 x "
                          "ring 1") in out
    code, out, _ = run(capsys, "--config", "configs/cogvideox-5b-long.yaml", "--set", "parallel.sp_size=1")
    assert code == 0 and "pads" not in out                  # nothing to pad without sp
    # The world size counts sp: tp 2 x sp 2 needs a multiple of 4 processes, and dp is what is left.
    code, out, err = run(capsys, "--config", "configs/cogvideox-5b-long.yaml", "--world-size", "6")
    assert code == 1 and "world size 6 is not divisible by parallel.tp_size x parallel.pp_size x parallel.sp_size = " \
                         "2 x 1 x 2 = 4" in err
    code, out, _ = run(capsys, "--config", "configs/cogvideox-5b-long.yaml", "--world-size", "8",
                       "--deepspeed_config", "ds_configs/zero2_bf16_long.json")
    assert code == 0 and out.startswith("ok: cogvideox-5b-long tp=2 sp=2 pp=1 dp=2 (world 8), ZeRO-2 bf16")
    layout, problems = check(load_config("debug", ["parallel.sp_size=2", "parallel.tp_size=2"]), world_size=8)
    assert problems == [] and (layout.dp_size, layout.world_size) == (2, 8)


def test_a_ring_of_whole_frames_is_checked_in_every_bucket(tmp_path):
    """STDiT at ring 3 (sp 3): the config's 3 latent frames split, the manifest's 2-frame and 1-frame buckets do not,
    and the checker names them (at runtime they would stop training at their first step)."""
    from parallel.check import check_data_files
    from tests.buckets_utils import write_buckets
    write_buckets(tmp_path)
    cfg = load_config("debug-stdit", ["parallel.sp_size=3", "data.kind=directory", f"data.path={tmp_path}"])
    layout, problems = check(cfg, world_size=3)
    assert layout.ring_size == 3 and problems == []                        # the config's own shape splits
    assert check_data_files(cfg) == [f"{tmp_path}: parallel.ring_size=3: model.family=stdit's ring attention splits whole frames, "
                        f"and these buckets do not split into 3 (or their tokens into parallel.sp_size=3): 5x48x80 "
                        f"(2 latent frames, 30 tokens), 1x48x48 (1 latent frames, 9 tokens); set --set "
                        f"parallel.ring_size=1 (Ulysses only) or keep those shapes out of the manifest"]
    assert check_data_files(load_config("debug-stdit", ["parallel.sp_size=2", "data.kind=directory",
                                                        f"data.path={tmp_path}"])) == []   # Ulysses: any bucket
