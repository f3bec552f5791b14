"""CogVideoX 1.5 and image-to-video releases: the presets count what diffusers builds from the released
config.json, the config translation names what differs, the temporal padding. The `releases15` fixture
(tiny random folders by `save_pretrained`) serves tests/distributed/test_released_weights_layouts.py, where
every (tp, pp) layout's forward is compared with diffusers' and the exports with the originals.
"""
import re

import pytest
import torch
from diffusers import CogVideoXTransformer3DModel

from models.__main__ import summary
from models.geometry import latent_shape, pad_frames, token_grid, video_latent
from models.registry import sequence_tokens
from parallel.check import check
from parallel.experiment.config import load_config
from parallel.weights.diffusers import check_released, diffusers_config
from tests.unit.cogvideox_variants import overrides
from tests.helpers.prepare_data import vae_dir, videos  # noqa: F401  (fixtures: clips, a tiny VAE)
from tests.helpers.cogvideox_releases import releases15  # noqa: F401  (fixtures)

_COMMON = dict(activation_fn="gelu-approximate", attention_bias=True, attention_head_dim=64, dropout=0.0,
               flip_sin_to_cos=True, freq_shift=0, norm_elementwise_affine=True, norm_eps=1e-5,
               num_attention_heads=48, num_layers=42, out_channels=16, patch_size=2,
               spatial_interpolation_scale=1.875, temporal_compression_ratio=4, temporal_interpolation_scale=1.0,
               text_embed_dim=4096, time_embed_dim=512, timestep_activation_fn="silu",
               use_rotary_positional_embeddings=True)
# transformer/config.json of the releases on the Hugging Face hub (THUDM/CogVideoX-5b-I2V, THUDM/CogVideoX1.5-5B,
# THUDM/CogVideoX1.5-5B-I2V).
RELEASES = {
    "cogvideox1.5-5b": dict(_COMMON, in_channels=16, max_text_seq_length=224, patch_bias=False, patch_size_t=2,
                            sample_frames=81, sample_height=300, sample_width=300, ofs_embed_dim=None,
                            use_learned_positional_embeddings=False),
    "cogvideox-5b-i2v": dict(_COMMON, in_channels=32, max_text_seq_length=226, sample_frames=49, sample_height=60,
                             sample_width=90, use_learned_positional_embeddings=True),
    "cogvideox1.5-5b-i2v": dict(_COMMON, in_channels=32, max_text_seq_length=224, patch_bias=False, patch_size_t=2,
                                sample_frames=81, sample_height=300, sample_width=300, ofs_embed_dim=512,
                                use_learned_positional_embeddings=False),
}


@pytest.mark.parametrize("preset", sorted(RELEASES))
def test_preset_counts_the_parameters_diffusers_builds_and_writes_its_config(preset):
    cfg = load_config(f"configs/{preset}.yaml")
    ours = int(re.search(r"^parameters: (\d+)$", summary(cfg), re.MULTILINE).group(1))
    with torch.device("meta"):
        theirs = CogVideoXTransformer3DModel(**RELEASES[preset])
    assert ours == sum(p.numel() for p in theirs.parameters())
    written = diffusers_config(cfg.model, cfg.data)
    assert {k: written.get(k) for k in RELEASES[preset]} == RELEASES[preset]


def test_the_15_geometry_pads_latent_frames_in_front():
    cfg = load_config("configs/cogvideox1.5-5b.yaml")
    assert latent_shape(cfg.model, cfg.data) == (22, 96, 170)          # 81 frames -> 21 latent -> 22
    assert token_grid(cfg.model, cfg.data) == (11, 48, 85)
    assert sequence_tokens(cfg.model, cfg.data) == 44_880 + 224
    # The checker takes the 1.5 preset at tp 2 x sp 4 (48 heads, 45,104 tokens) and names 5 for tp.
    ds = {"zero_optimization": {"stage": 2}}
    cfg = load_config("configs/cogvideox1.5-5b.yaml", ["parallel.tp_size=2", "parallel.sp_size=4"])
    assert check(cfg, ds, "ds.json", 8)[1] == []
    problems = check(load_config("configs/cogvideox1.5-5b.yaml", ["parallel.tp_size=5"]), ds, "ds.json", 5)[1]
    assert any("model.num_heads=48 is not divisible by parallel.tp_size=5" in p for p in problems), problems
    cfg = load_config("configs/cogvideox1.5-5b.yaml")
    latent = torch.randn(2, 16, 21, 4, 4)
    padded = pad_frames(latent, cfg.model)
    assert padded.shape == (2, 16, 22, 4, 4)
    assert torch.equal(padded[:, :, 1:], latent) and torch.equal(padded[:, :, 0], latent[:, :, 0])
    assert pad_frames(padded, cfg.model) is padded
    assert torch.equal(video_latent(padded, cfg.model, cfg.data), latent)     # decoded without the padding


def test_config_differences_name_the_keys_to_set(releases15):
    folder, _ = releases15["i2v15"]
    cfg = load_config("debug", overrides("t2v15", folder))           # a text-to-video section, an I2V folder
    config = folder / "config.json"
    assert check_released(cfg.model, folder) == [
        f"{config}: in_channels 8 != 4 (model.in_channels x 1); set --set model.image_condition=true "
        f"(image-to-video releases take 2 x out_channels)",
        f"{config}: ofs_embed_dim 24 != model.ofs_embed_dim null; set --set model.ofs_embed_dim=24 or use the "
        f"matching preset"]
    folder, _ = releases15["t2v15"]
    cfg = load_config("debug", overrides("t2v15", folder) + ["model.patch_size_t=1", "model.patch_bias=true"])
    assert check_released(cfg.model, folder) == [
        f"{folder / 'config.json'}: patch_size_t 2 != model.patch_size_t 1; set "
        f"--set model.patch_size_t=2 or use the matching preset",
        f"{folder / 'config.json'}: patch_bias false != model.patch_bias true; set --set model.patch_bias=false or "
        f"use the matching preset"]


def test_verify_command_passes_on_the_folders_and_fails_when_the_toolkit_reads_one_wrongly(releases15, monkeypatch,
                                                                                          capsys):
    """python -m parallel.verify in one process (layouts: tests/distributed/test_released_weights_layouts.py).
    Perturbing the folder changes both sides alike, so the failure is a loader that perturbs one tensor after
    reading (what a wrong name map or slice would do)."""
    from parallel import verify
    from parallel.train import sampling

    def args(variant, folder=None):
        return ["--config", "debug", *(f"--set={o}" for o in overrides(variant, folder))]

    for variant, (folder, _) in releases15.items():
        assert verify.main(args(variant, folder)) == 0, variant
        assert "max relative difference" in capsys.readouterr().out
    load = sampling.load_released

    def misread(module, ctx, m, folder):
        read = load(module, ctx, m, folder)
        with torch.no_grad():
            module.embed.ofs_linear_2.bias.add_(1e-2)                 # one tensor, a small change
        return read

    monkeypatch.setattr(sampling, "load_released", misread)
    assert verify.main(args("i2v15", releases15["i2v15"][0])) == 2        # ran, found them apart
    rel = float(re.search(r"max relative difference (\S+)", capsys.readouterr().out).group(1))
    assert 1e-4 < rel < 1
    assert verify.main(args("i2v15")) == 1                                 # refused, as every command refuses
    assert capsys.readouterr().err.startswith("python -m parallel.verify refused (1 problem):\n  - model.init_from "
                                              "is not set")


def test_i2v_validation_conditions_on_each_samples_first_frame():
    """validation_loss of a tiny 1.5-I2V model equals the loss of [x_t, z_img, 0, 0, 0] inputs built here."""
    import types

    from models.diffusion import Objective
    from parallel.model.build import layer_specs
    from parallel.distributed.pipeline import SequentialDiT
    from parallel.distributed.topology import ParallelContext
    from parallel.train.run import build_val_dataset
    from parallel.validation.validate import StageForward, validation_loss, validation_noise

    cfg = load_config("debug", ["model.patch_size_t=2", "model.pos_embed=rope3d", "model.image_condition=true",
                                "model.ofs_embed_dim=32", "val.num_samples=2", "val.timesteps=[100,700]"])
    ctx = ParallelContext.single()
    torch.manual_seed(0)
    model = SequentialDiT(layer_specs(cfg, ctx)).eval()
    forward = StageForward(types.SimpleNamespace(module=model, device=torch.device("cpu")), ctx)
    dataset, objective = build_val_dataset(cfg), Objective.of(cfg.model)
    got = validation_loss(forward, dataset, objective, cfg, ctx)["val_loss"]
    losses = []
    for i in range(2):
        x0, text = dataset[i]
        t = torch.tensor(cfg.val.timesteps)
        x_t, target = objective.noised(x0.expand(2, *x0.shape), validation_noise(cfg.train.seed, i, [100, 700],
                                                                                  x0.shape), t)
        first = x0[:, :1]             # 3 VAE frames padded to 4: [z, 0, 0, 0], as CogVideoXImageToVideoPipeline
        image = torch.cat([first, torch.zeros_like(x0[:, :3])], dim=1).expand(2, *x0.shape)
        with torch.no_grad():
            pred = model.predict((torch.cat([x_t, image], dim=1), t, text.expand(2, *text.shape)))
        losses.append(((pred - target) ** 2).flatten(1).mean(1))
    torch.testing.assert_close(torch.tensor(got), torch.cat(losses).mean())


def test_prepare_data_pads_15_latents_and_stores_the_augmented_first_frame_for_i2v(videos, vae_dir, tmp_path):
    """An I2V 1.5 preset: latent frames padded in front (5 -> 6, a copy of the first), and beside the latent the
    VAE latent of the first frame + exp(N(-3, 0.5)) * randn (SAT add_noise_to_first_frame), drawn from the clip.
    The VAE says invert_scale_latents (as 1.5's does): the image latent is z / scaling_factor, as
    CogVideoXImageToVideoPipeline scales it; the video latent z x scaling_factor."""
    import json
    import shutil

    from diffusers import AutoencoderKLCogVideoX
    from safetensors.torch import load_file

    from parallel.distributed.seed import derive_seed
    from parallel.prepare_data.frames import frame_indices
    from tests.helpers.prepare_data import SETS, run

    sets = SETS + ["model.patch_size_t=2", "model.pos_embed=rope3d", "model.image_condition=true"]
    vae15 = shutil.copytree(vae_dir, tmp_path / "vae15")
    config = json.loads((vae15 / "config.json").read_text())
    (vae15 / "config.json").write_text(json.dumps({**config, "invert_scale_latents": True}))
    assert run(videos[0], vae15, tmp_path / "out", sets=sets) == 0
    vae = AutoencoderKLCogVideoX.from_pretrained(vae15).eval()
    assert vae.config.invert_scale_latents and vae.config.scaling_factor != 1
    clip = videos[1]["a0.mkv"][frame_indices(11, 9)][:, :, 8:40]
    x = torch.from_numpy(clip).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
    g, noise = (torch.Generator().manual_seed(derive_seed(1234, kind, "a0.mkv")) for kind in ("vae", "image"))
    sigma = torch.exp(torch.normal(-3.0, 0.5, (1,), generator=noise))
    first = x[:, :, :1] + torch.randn(x[:, :, :1].shape, generator=noise) * sigma
    with torch.no_grad():
        video = vae.encode(x).latent_dist.sample(g)[0] * vae.config.scaling_factor
        image = vae.encode(first).latent_dist.sample(g)[0] / vae.config.scaling_factor
    stored = load_file(tmp_path / "out/latents/a0.mkv.safetensors")
    assert stored["latent"].shape == (4, 6, 16, 16) and stored["image"].shape == (4, 1, 16, 16)
    torch.testing.assert_close(stored["latent"], torch.cat([video[:, :1], video], dim=1))
    torch.testing.assert_close(stored["image"], image)


def test_training_takes_the_stored_image_latents(tmp_path):
    """A prepared folder whose latent files hold "image": the batches condition on it, not on
    the latent's first frame."""
    import json

    from safetensors.torch import save_file

    from parallel.distributed.topology import ParallelContext
    from parallel.train.run import build_dataset, training_batches

    g = torch.Generator().manual_seed(0)
    images = [torch.randn(4, 1, 8, 8, generator=g) for _ in range(2)]
    for i in range(2):
        save_file({"latent": torch.randn(4, 4, 8, 8, generator=g), "image": images[i]}, str(tmp_path / f"{i}.safetensors"))
        save_file({"text": torch.randn(8, 32, generator=g)}, str(tmp_path / f"{i}_text.safetensors"))
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps({"latent": f"{i}.safetensors", "text": f"{i}_text"
                                                                 f".safetensors"}) + "\n" for i in range(2)))
    cfg = load_config("debug", ["model.patch_size_t=2", "model.pos_embed=rope3d", "model.image_condition=true",
                                "model.image_dropout=0", "data.kind=directory", f"data.path={tmp_path}",
                                "train.micro_batch_size=2", "train.grad_accum_steps=1"])
    batches = training_batches(cfg, ParallelContext.single(), build_dataset(cfg))
    (x, _, _), _ = batches.micro_batch(0, 0)
    for j in range(2):
        image = images[batches.sample_index(j)]
        assert torch.equal(x[j, 4:], torch.cat([image, torch.zeros(4, 3, 8, 8)], dim=1))


def test_image_dropout_drops_the_same_samples_at_dp1_and_dp2():
    """The image-latent dropout is drawn per sample from (seed, step, position): one replica with 2 micro-batches
    and two replicas with one each (the same global batch of 4) build the same inputs, dropped ones included."""
    import types

    from parallel.distributed.topology import ParallelContext
    from parallel.train.run import training_batches

    sets = ["model.patch_size_t=2", "model.pos_embed=rope3d", "model.image_condition=true", "model.image_dropout=0.5",
            "train.micro_batch_size=2"]
    one = training_batches(load_config("debug", sets + ["train.grad_accum_steps=2"]), ParallelContext.single())
    cfg2 = load_config("debug", sets + ["train.grad_accum_steps=1"])
    two = [training_batches(cfg2, types.SimpleNamespace(dp_rank=r, dp_size=2)) for r in range(2)]
    dropped = []
    for step in range(3):
        for part in range(2):              # dp 1: micro-batch `part`; dp 2: replica `part`'s only micro-batch
            (x1, t1, _), _ = one.micro_batch(step, part)
            (x2, t2, _), _ = two[part].micro_batch(step, 0)
            assert torch.equal(x1, x2) and torch.equal(t1, t2)
            dropped += [bool((x1[j, 4:] == 0).all()) for j in range(2)]
    assert set(dropped) == {True, False}
