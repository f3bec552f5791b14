"""The release's noise schedule: alphas_cumprod as diffusers' CogVideoX schedulers build it from the same
scheduler_config.json keys (2B: snr_shift_scale 3.0, 5B: 1.0), the presets carrying them, and the checker
refusing a pipeline whose scheduler/scheduler_config.json disagrees, by key."""
import json

import pytest
import torch
from diffusers import CogVideoXDDIMScheduler, CogVideoXDPMScheduler, CogVideoXTransformer3DModel

from models.diffusion import Objective
from parallel.check import load_and_check
from parallel.experiment.config import ConfigError, load_config
from parallel.weights.scheduler import check_scheduler

RELEASE = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "clip_sample": False,
           "prediction_type": "v_prediction", "rescale_betas_zero_snr": True, "set_alpha_to_one": True,
           "timestep_spacing": "trailing", "num_train_timesteps": 1000, "steps_offset": 0}


def release_scheduler(snr_shift_scale: float, kind=CogVideoXDDIMScheduler):
    return kind(**RELEASE, snr_shift_scale=snr_shift_scale)


@pytest.mark.parametrize("preset, shift", [("cogvideox-2b", 3.0), ("cogvideox-5b", 1.0), ("cogvideox-5b-long", 1.0)])
def test_alphas_cumprod_equal_diffusers_for_each_release(preset, shift):
    cfg = load_config(preset)
    assert cfg.model.schedule.snr_shift_scale == shift
    objective = Objective.of(cfg.model)
    for kind in (CogVideoXDDIMScheduler, CogVideoXDPMScheduler):
        theirs = release_scheduler(shift, kind).alphas_cumprod
        assert theirs.dtype == torch.float64
        torch.testing.assert_close(objective.alphas_cumprod64, theirs, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(objective.alphas_cumprod, theirs.float(), rtol=0, atol=0)
    assert objective.alphas_cumprod[-1] == 0                      # zero terminal SNR after the shift


def test_without_rescale_and_other_betas_too():
    cfg = load_config("debug", ["model.schedule.rescale_betas_zero_snr=false", "model.schedule.snr_shift_scale=2.0",
                                "model.schedule.beta_end=0.02"])
    theirs = CogVideoXDDIMScheduler(**{**RELEASE, "rescale_betas_zero_snr": False, "beta_end": 0.02},
                                    snr_shift_scale=2.0).alphas_cumprod
    torch.testing.assert_close(Objective.of(cfg.model).alphas_cumprod64, theirs, rtol=1e-12, atol=1e-15)


def test_default_schedule_is_the_one_before_the_schedule_section():
    """A config without model.schedule trains on the bits it trained on before (the 5B schedule)."""
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
    sqrt_ab = torch.cumprod(1.0 - betas, 0).sqrt()
    first, last = sqrt_ab[0].clone(), sqrt_ab[-1].clone()
    before = (((sqrt_ab - last) * first / (first - last)) ** 2).float()
    assert torch.equal(Objective("v_prediction").alphas_cumprod, before)
    assert torch.equal(Objective.of(load_config("debug").model).alphas_cumprod, before)


def tiny_pipeline_folder(root, snr_shift_scale: float, **scheduler):
    """A released pipeline's layout: transformer/ (tiny random CogVideoX) and scheduler/ beside it."""
    torch.manual_seed(0)
    CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                time_embed_dim=24, text_embed_dim=32, num_layers=2, sample_height=8, sample_width=8,
                                sample_frames=9, max_text_seq_length=8).save_pretrained(root / "transformer")
    CogVideoXDDIMScheduler(**{**RELEASE, **scheduler}, snr_shift_scale=snr_shift_scale).save_pretrained(
        root / "scheduler")
    return root / "transformer"


def tiny_overrides(folder) -> list[str]:
    return ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.head_dim=16",
            "model.time_embed_dim=24", "model.pos_embed=sincos", "model.sample_height=8", "model.sample_width=8",
            f"model.init_from={folder}"]


def test_checker_refuses_a_scheduler_config_that_disagrees_by_name(tmp_path):
    folder = tiny_pipeline_folder(tmp_path, 3.0)
    path = (tmp_path / "scheduler" / "scheduler_config.json").resolve()
    # Agrees: the 2B schedule.
    cfg, _, _ = load_and_check("debug", tiny_overrides(folder) + ["model.schedule.snr_shift_scale=3.0"],
                               "ds_configs/zero0_fp32.json", 1)
    assert check_scheduler(cfg.model, folder) == []
    # Disagrees: the default (5B) shift against the 2B file, refused before any process group.
    with pytest.raises(ConfigError) as e:
        load_and_check("debug", tiny_overrides(folder), "ds_configs/zero0_fp32.json", 1)
    assert f"{path}: snr_shift_scale 3.0 != model.schedule.snr_shift_scale 1.0; set --set " \
           f"model.schedule.snr_shift_scale=3.0 or use the matching preset" in str(e.value).splitlines()
    cfg = load_config("debug", tiny_overrides(folder) + ["model.schedule.snr_shift_scale=3.0",
                                                         "model.schedule.timestep_spacing=leading",
                                                         "model.objective=flow_matching"])
    assert check_scheduler(cfg.model, folder) == [
        f"{path}: prediction_type \"v_prediction\" != model.objective flow_matching; set --set "
        f"model.objective=v_prediction or use the matching preset",
        f"{path}: timestep_spacing \"trailing\" != model.schedule.timestep_spacing \"leading\"; set --set "
        f"model.schedule.timestep_spacing=trailing or use the matching preset"]


def test_absent_keys_take_the_diffusers_defaults_and_fixed_keys_are_checked(tmp_path):
    folder = tiny_pipeline_folder(tmp_path, 1.0, steps_offset=1)
    path = (tmp_path / "scheduler" / "scheduler_config.json").resolve()
    config = json.loads(path.read_text())
    del config["snr_shift_scale"]                  # diffusers' default: 3.0
    path.write_text(json.dumps(config))
    cfg = load_config("debug", tiny_overrides(folder))
    assert check_scheduler(cfg.model, folder) == [
        f"{path}: snr_shift_scale 3.0 != model.schedule.snr_shift_scale 1.0; set --set "
        f"model.schedule.snr_shift_scale=3.0 or use the matching preset",
        f"{path}: steps_offset 1 is not supported (the toolkit's schedule has steps_offset 0, as the CogVideoX "
        f"releases do)"]
    assert check_scheduler(cfg.model, tmp_path / "elsewhere" / "transformer") == []     # no pipeline around it
