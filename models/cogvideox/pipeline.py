"""What CogVideoX's released pipeline feeds its transformer and samples it with (FamilySpec.formats.vae, text_encoder,
sampling): the VAE latents and the T5 text input (models/shared/pipeline.py: STDiT trains on them too) and the
DDPM schedulers.

- Schedulers: CogVideoXDDIMScheduler (2B) / CogVideoXDPMScheduler (5B), v-prediction: models/sampling.py's
  ddim and dpm; their constructor defaults (the same in both) fill keys absent from scheduler_config.json.
"""
from __future__ import annotations

from models.scheduler_config import DiffusersScheduler
from models.spec import Sampling


# diffusers' CogVideoXDDIMScheduler / CogVideoXDPMScheduler constructor defaults (the same in both).
SCHEDULER = DiffusersScheduler(
    defaults={"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
              "trained_betas": None, "set_alpha_to_one": True, "steps_offset": 0, "prediction_type": "epsilon",
              "timestep_spacing": "leading", "rescale_betas_zero_snr": False, "snr_shift_scale": 3.0},
    release="the CogVideoX releases")

# v_prediction: the pipelines' DDIM (2B) and DPM (5B); flow_matching (a toolkit option): the flow samplers.
SAMPLING = Sampling(samplers={"v_prediction": ("ddim", "dpm"), "flow_matching": ("euler", "flow_euler", "unipc")},
                    scheduler=SCHEDULER)
