"""LTX-2's training objective as released: one noise level for both streams, shifted by the video's length, and
the velocity loss of each stream.

Schedule (diffusers 0.42 `LTX2Pipeline.__call__`): the sigmas are FlowMatchEulerDiscreteScheduler's with dynamic
shifting at mu = calculate_shift(S) (S the packed video tokens; base_image_seq_len 1024, max_image_seq_len 4096,
base_shift 0.95, max_shift 2.05, the pipeline's defaults), the exponential time shift

    s = e^mu / (e^mu + (1 / u - 1))          u the unshifted level, here r = t / 1000 of the toolkit's uniform draw

and the audio stream is denoised by a copy of the same scheduler at the same sigmas ("for now, duplicate the
scheduler for use with the audio latents"): the transformer gets `timestep = audio_timestep = 1000 s` (its
audio_timestep defaults to timestep). Noising, as the pipeline's _create_noised_state and Lightricks' ltx-trainer
(TextToVideoStrategy, `with_audio`): x_t = (1 - s) x0 + s e and a_t = (1 - s) a0 + s e_a with noise of its own,
targets e - x0 and e_a - a0. Loss (ltx-trainer's compute_loss): mse(video) + mse(audio), each the mean over its
own elements, equal weights.

Not matched: the release's scheduler_config.json is not read (the shift constants are the pipeline's defaults,
which `.get` falls back to), its `shift_terminal` stretches an inference grid and has no training counterpart, and
ltx-trainer's own sigma draw (a shifted logit-normal) is not the pipeline's schedule this follows.

Under sequence parallelism the video stream is split and the audio whole on every sp rank: each rank counts its
video share sp times and its whole audio loss once (`AudioStream.loss`), so DeepSpeed's average over dp x sp
is the serial loss and gradient.
"""
from __future__ import annotations

import math

import torch

from models.diffusion import NUM_TRAIN_TIMESTEPS, PER_SAMPLE, mse_loss
from models.ltx2.audio import AudioEncoder, audio_vae_problems
from models.ltx2.image import token_timesteps
from models.ltx2.sampling import GUIDANCE_RESCALE, MIN_STEPS, sample, shift_mu


def shifted_sigma(u: torch.Tensor, video_tokens: int) -> torch.Tensor:
    """FlowMatchEulerDiscreteScheduler._time_shift_exponential(mu, 1, u), fp32; u = 0 gives 0."""
    e = math.exp(shift_mu(video_tokens))
    return (e / (e + (1 / u.double() - 1))).float()


class LTX2Timesteps:
    """FlowMatch's noise level of one sample (FamilySpec.timesteps): the toolkit's uniform draw t in [0, 1000)
    (PER_SAMPLE's) shifted at the sample's video tokens, a floating-point [1] (models/diffusion.py then noises at
    it and the model sees 1000 s); image-to-video (model.image_condition) that level on every latent position [1, T,
    H, W] (the condition puts frame 0 at 0 in the samples it conditions: models/ltx2/image.py `timesteps`)."""

    @staticmethod
    def per_token(model) -> bool:
        return model.image_condition

    @staticmethod
    def draw(generator: torch.Generator, latent_shape, model) -> torch.Tensor:
        t = PER_SAMPLE.draw(generator, latent_shape, model)
        s = shifted_sigma(t / NUM_TRAIN_TIMESTEPS, math.prod(latent_shape[1:]))       # patch 1: T H W tokens
        return s.view(1, 1, 1, 1).repeat(1, *latent_shape[1:]) if model.image_condition else s


class AudioStream:
    """FamilySpec.second_stream of LTX-2: the audio stream of a training batch. A sample carries, after its video
    latent and caption, its packed audio latents [A, audio_in_channels] and audio caption [L, audio_caption_dim]
    (`shapes`); the batch adds (a_t, audio caption, audio timesteps) to the inputs and the audio target to the
    video's. Sampling draws its noise after the video's, and steps both streams together (`sample`)."""

    def __init__(self, model, data):
        self.model, self.data = model, data

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(audio latents, audio caption) of one sample of the data section's clip."""
        return tuple(self.model.clip_input_shapes(self.data)[:2])

    @staticmethod
    def noise(generator: torch.Generator, stored: list) -> torch.Tensor:
        """The audio noise of one sample, from its generator after its video noise and timestep."""
        return torch.randn(stored[0].shape, generator=generator)

    @staticmethod
    def batch(objective, sigmas: torch.Tensor, stored: list, noises: list) -> tuple[tuple, torch.Tensor]:
        """((a_t [B, A, Ca], audio caption [B, L, C], audio timesteps [B]), audio target [B, A, Ca]) at the
        video's noise levels sigmas [B] (floating point), or [B, T, H, W] (image-to-video: the later frames')."""
        a0, text = (torch.stack(z) for z in zip(*stored))
        sigmas = sigmas if sigmas.dim() == 1 else sigmas.flatten(1)[:, -1]
        s = objective.flow_sigmas(sigmas).view(-1, 1, 1)
        e = torch.stack(noises)
        return ((1 - s) * a0 + s * e, text, objective.model_timesteps(sigmas)), e - a0

    @staticmethod
    def loss(video_loss, prediction: tuple, target: tuple, sp: int) -> torch.Tensor:
        """video_loss(video prediction, video target[, the samples whose first frame is an input]) (the video MSE, or
        this sp rank's share of it times sp) plus the whole audio MSE, once on every sp rank."""
        return video_loss(prediction[0], target[0], *target[2:]) + mse_loss(prediction[1], target[1])

    # Sampling (parallel/train/sampling.py sample_batch): the stream's noise, the model's inputs at both streams,
    # and the sampler that steps both (LTX2Pipeline's loop, models/ltx2/sampling.py).

    def sampling_noise(self, generator: torch.Generator) -> torch.Tensor:
        """The audio noise [1, A, Ca] of one sample, from its generator after its video noise."""
        return torch.randn((1, *self.shapes()[0]), generator=generator)

    def sampling_inputs(self, x: tuple, t: torch.Tensor, text: tuple) -> tuple:
        """EmbedStage's inputs at x = (video, audio) and captions (video, audio): both streams at t, as
        LTX2Pipeline calls the transformer (audio_timestep = timestep); image-to-video the video's first frame at
        0 (LTX2ImageToVideoPipeline's t (1 - mask))."""
        video = token_timesteps(t, x[0].shape[2:]) if self.model.image_condition else t
        return x[0], video, text[0], x[1], text[1], t

    sample = staticmethod(sample)
    min_steps = MIN_STEPS
    guidance_rescale = GUIDANCE_RESCALE          # parallel.sample's default --guidance-rescale (the pipeline's)

    # Data preparation (parallel/prepare_data/audio.py): the clip, taken at the stream's frame rate, and its sound
    # track encoded by the release's audio VAE (models/ltx2/audio.py) into the sample's "audio".

    @property
    def frame_rate(self) -> float:
        return self.model.frame_rate

    def tokens(self) -> int:
        """The clip's audio tokens A (LTX2Config.audio_tokens)."""
        return self.shapes()[0][0]

    source_problems = staticmethod(audio_vae_problems)    # (folder, model) -> what keeps it from the model
    load_source = staticmethod(AudioEncoder)               # (folder, device) -> .sample_rate, .encode(wave, A, g)
