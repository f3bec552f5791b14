"""LTX-2 image-to-video (model.image_condition): the first latent frame is the picture, as LTX2ImageToVideoPipeline
(diffusers 0.42 `pipeline_ltx2_image2video.py`) conditions the same transformer that does text-to-video; LTX-2
publishes no separate image-to-video weights. At denoising timestep t the pipeline builds

    mask      [B, S]           1 on latent frame 0's h w tokens, 0 after
    latents   image latent on frame 0, x_t after            (prepare_latents: init mask + noise (1 - mask))
    timestep  t (1 - mask)     [B, S]: 0 on the first frame's tokens; audio_timestep and sigma stay t

steps frames 1.. only (frame 0 stays the picture's latent) and returns it in frame 0. The toolkit's model takes the
video timesteps per latent position [B, T, H, W] (models/ltx2/embed.py: frame 0's and the later frames' rows).

Training as Lightricks' ltx-trainer trains it (the `first_frame` condition, `flexible.py`
`_apply_intrinsic_condition`): in a conditioned sample the first frame's tokens are clean and at timestep 0
(`timesteps`: LTX2Timesteps draws the sample's level on every position) and left out of the video loss
(`loss_skip_frames`: ltx-trainer's loss mask); the picture is the clip's own first latent frame (the causal VAE's
frame 0 encodes the first picture frame alone, as the pipeline encodes the picture), so nothing is stored beside
the latents. Which samples are conditioned: each with probability 1 - model.image_dropout, drawn per sample as
ltx-trainer draws its `probability` (a Bernoulli per batch element), here from (seed, step, global position) like
every condition's dropout (parallel/train/data.py), so every layout conditions the same samples; the others train
as text-to-video (every frame noised, at their timestep, in the loss). The video loss is then ltx-trainer's: each
sample's mean over the elements its mask keeps, averaged over the batch (SequenceLoss with the batch's `keep`).
"""
from __future__ import annotations

import torch


def first_frame(x: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
    """x [B, C, T, H, W] with latent frame 0 replaced by image [B, C, 1, H, W]."""
    return torch.cat([image.to(x.dtype), x[:, :, 1:]], dim=2)


def token_timesteps(t: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """[B] -> [B, T, H, W]: t on every latent position but frame 0's, 0 there (the pipeline's t (1 - mask))."""
    tokens = t.float().view(-1, 1, 1, 1).repeat(1, *grid)
    tokens[:, 0] = 0
    return tokens


class FirstFrame:
    """FamilySpec.condition of LTX-2 image-to-video. The latents are (video, audio) pairs in sampling."""

    image_encoder = False        # no image states
    loss_skip_frames = 1         # latent frames the loss leaves out (parallel/model/build.py SequenceLoss)

    def __init__(self, model, data):
        self.model, self.data = model, data
        self.dropout = model.image_dropout      # probability of a sample trained as text-to-video (keep False)

    def __call__(self, x_t: torch.Tensor, x0: torch.Tensor, keep: torch.Tensor, *stream) -> torch.Tensor:
        """Training: x_t [B, C, T, H, W] with x0's first frame in the samples kept (already there: `timesteps` put
        their frame 0 at noise level 0). `stream`: the audio stream's stored tensors (the condition stores none)."""
        return torch.where(keep.view(-1, 1, 1, 1, 1), first_frame(x_t, x0[:, :, :1]), x_t)

    @staticmethod
    def timesteps(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Training: the drawn levels t [B, T, H, W] with latent frame 0 at 0 in the samples kept [B] (ltx-trainer's
        `(1 - mask) * timesteps`), before the batch is noised."""
        t = t.clone()
        t[keep, 0] = 0
        return t

    def stored_shapes(self, latent: list[int]) -> dict[str, list[int]]:
        """Nothing beside a sample's latent: its own first frame is the picture's."""
        return {}

    @staticmethod
    def stored_tensors(*_) -> dict:
        """What data preparation stores beside the latent: nothing (its own first frame is the picture's)."""
        return {}

    def sampling_shapes(self, latent: list[int]) -> dict[str, list[int]]:
        """`python -m parallel.sample --image-latents`: the picture's latent [C, 1, H, W]."""
        return {"image": [latent[0], 1, *latent[2:]]}

    @staticmethod
    def sampling_input(x: tuple, first: torch.Tensor) -> tuple:
        """The transformer's latents at every step: (video with the picture latent in frame 0, audio)."""
        return first_frame(x[0], first), x[1]

    sampled = sampling_input     # the sampler's result with the picture latent in frame 0 (the pipeline's)

    @staticmethod
    def encode_pictures(vae, pictures: list, height: int, width: int) -> torch.Tensor:
        """`python -m parallel.sample --image`: the module's `encode_pictures`."""
        return encode_pictures(vae, pictures, height, width)


@torch.no_grad()
def encode_pictures(vae, pictures: list, height: int, width: int) -> torch.Tensor:
    """Pictures (PIL images) -> their latents [N, C, 1, H', W'] fp32, as LTX2ImageToVideoPipeline.prepare_latents
    encodes its `image`: VideoProcessor.preprocess (bilinear resize to height x width, [-1, 1]), one frame through
    the VAE, the posterior's mode, (z - latents_mean) / latents_std with the VAE's buffers (that pipeline passes no
    scaling_factor: 1, the release's)."""
    from diffusers.video_processor import VideoProcessor

    from models.ltx2.pipeline import LTX2Latents

    param = next(vae.parameters())
    x = VideoProcessor(vae_scale_factor=vae.spatial_compression_ratio, resample="bilinear").preprocess(
        pictures, height=height, width=width)
    z = vae.encode(x.unsqueeze(2).to(param.device, param.dtype)).latent_dist.mode().float()
    buffers = {name: getattr(vae, name) for name in LTX2Latents.buffers}        # scaling_factor: 1 (the pipeline's)
    return LTX2Latents.normalise(z, buffers).cpu()


def image_condition(model, data):
    """FirstFrame for an image-to-video section, None for text-to-video."""
    return FirstFrame(model, data) if model.image_condition else None
