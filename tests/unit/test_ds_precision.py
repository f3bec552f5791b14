"""bf16 / fp16 in the DeepSpeed JSON against the accelerator's support: refused before launch, the alternative named."""

import pytest

from parallel.check import DeviceDtypes, check, main
from parallel.experiment.config import load_config
from tests.helpers.ds_precision import fp16_json  # noqa: F401  (fixtures)


FP32 = "fp32 (drop the section, e.g. ds_configs/zero0_fp32.json)"


def test_this_machine_reports_deepspeeds_answer():
    """DeepSpeed's CPU accelerator: bf16 yes; fp16 only where oneDNN has fp16 kernels (not on this machine)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    here = DeviceDtypes.here()
    assert here == DeviceDtypes(acc.device_name(), bool(acc.is_fp16_supported()), bool(acc.is_bf16_supported()),
                                here.quantizer)
    if acc.device_name() == "cpu":
        assert DeviceDtypes.here().bf16


@pytest.mark.parametrize("device, ds, expected", [
    (DeviceDtypes("cpu", fp16=False, bf16=True), {"fp16": {"enabled": True}},
     'f.json: fp16.enabled=true but the cpu accelerator on this machine has no fp16 (DeepSpeed\'s '
     'is_fp16_supported() is false); use bf16 ("bf16": {"enabled": true}, e.g. ds_configs/zero1_bf16.json) or ' + FP32),
    (DeviceDtypes("cuda", fp16=True, bf16=False), {"bf16": {"enabled": True}},
     'f.json: bf16.enabled=true but the cuda accelerator on this machine has no bf16 (DeepSpeed\'s '
     'is_bf16_supported() is false); use fp16 ("fp16": {"enabled": true}) or ' + FP32),
    (DeviceDtypes("npu", fp16=False, bf16=False), {"bfloat16": {"enabled": True}},
     'f.json: bfloat16.enabled=true but the npu accelerator on this machine has no bf16 (DeepSpeed\'s '
     'is_bf16_supported() is false); use ' + FP32),
])
def test_unsupported_precision_is_refused_with_the_alternative(device, ds, expected):
    cfg = load_config("debug")
    assert check(cfg, ds, "f.json", device=device)[1] == [expected]
    assert check(cfg, ds, "f.json")[1] == []                            # no device given: not checked
    assert check(cfg, ds, "f.json", device=DeviceDtypes("cuda", fp16=True, bf16=True))[1] == []


def test_checker_refuses_fp16_here_unless_checking_for_another_machine(fp16_json, capsys):
    assert main(["--config", "debug", "--deepspeed_config", str(fp16_json)]) == 1
    err = capsys.readouterr().err
    assert f"{fp16_json}: fp16.enabled=true but the cpu accelerator on this machine has no fp16" in err
    assert main(["--config", "debug", "--deepspeed_config", str(fp16_json), "--no-device-check"]) == 0
    assert capsys.readouterr().out.startswith("ok: debug tp=1 pp=1 dp=1 (world 1), ZeRO-0 fp16")
