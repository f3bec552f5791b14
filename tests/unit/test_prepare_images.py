"""Images as one-frame clips in data preparation: read as diffusers.utils.load_image reads them (EXIF orientation,
RGB), resized and cropped as video frames, encoded into a 1-frame bucket; refused where a picture cannot be a
sample (a multi-frame shape, LTX-2's sound track, image-to-video)."""
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLCogVideoX
from diffusers.utils import load_image
from PIL import Image
from safetensors.torch import load_file

from parallel.prepare_data.frames import probe, read_clip, resize_crop
from tests.helpers.prepare_data import SETS, lines, squares, vae_dir, write_video  # noqa: F401  (fixture)
from tests.helpers.wan22_ti2v import vae_and_picture  # noqa: F401  (fixture: the tiny 2.2 VAE)
from parallel.prepare_data.prepare import main


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A folder of a rotated JPEG (stored 48 x 32, EXIF Orientation 6: shown 32 x 48), an RGBA PNG and a video,
    each with its .txt caption."""
    root = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(0)
    jpeg = Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8))
    exif = jpeg.getexif()
    exif[0x0112] = 6                                                  # Orientation: rotate 90 degrees clockwise
    jpeg.save(root / "turned.jpg", exif=exif, quality=90)
    Image.fromarray(rng.integers(0, 256, (40, 40, 4), dtype=np.uint8), "RGBA").save(root / "alpha.png")
    write_video(root / "clip.mkv", squares(11, 32, 32, 3), "ffv1")
    for name in ("turned.jpg", "alpha.png", "clip.mkv"):
        (root / name).with_suffix(".txt").write_text(f"the caption of {name}\n")
    return root


def pil_frame(path, height, width):
    return resize_crop(np.array(load_image(str(path))), height, width)


def test_an_image_reads_as_load_image_gives_it(mixed):
    assert probe(mixed / "turned.jpg") == (1, 48, 32)                # the size after the EXIF rotation
    assert probe(mixed / "alpha.png") == (1, 40, 40)
    for name in ("turned.jpg", "alpha.png"):
        clip = read_clip(mixed / name, 1, 32, 32)
        assert clip.shape == (1, 32, 32, 3) and clip.dtype == np.uint8
        np.testing.assert_array_equal(clip[0], pil_frame(mixed / name, 32, 32))


def prepare(root, vae, out, *extra, sets=SETS):
    return main(["--config", "debug", *[a for s in sets for a in ("--set", s)], "--videos", str(root), "--vae",
                 str(vae), "--out", str(out), "--posterior", "mode", *extra])


def test_images_go_to_the_one_frame_bucket(mixed, vae_dir, tmp_path):
    out = tmp_path / "out"
    assert prepare(mixed, vae_dir, out, "--buckets", "1x32x32,9x32x32") == 0
    manifest = {m["video"]: m for m in lines(out / "manifest.jsonl")}
    assert {v: m["shape"] for v, m in manifest.items()} == {"alpha.png": [1, 32, 32], "clip.mkv": [9, 32, 32],
                                                           "turned.jpg": [1, 32, 32]}
    assert manifest["alpha.png"]["caption"] == "the caption of alpha.png"
    vae = AutoencoderKLCogVideoX.from_pretrained(vae_dir).eval()
    for name in ("turned.jpg", "alpha.png"):
        # The PIL-loaded picture, resized and cropped, in [-1, 1] as a clip of one frame [1, 3, 1, 32, 32]
        x = torch.from_numpy(pil_frame(mixed / name, 32, 32)).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1
        with torch.no_grad():
            want = vae.encode(x).latent_dist.mean[0] * vae.config.scaling_factor
        latent = load_file(out / manifest[name]["latent"])["latent"]
        assert latent.shape == (4, 1, 16, 16)
        torch.testing.assert_close(latent, want)


def test_an_image_in_a_longer_shape_is_refused_and_the_advice_works(mixed, vae_dir, tmp_path, capsys, monkeypatch):
    import models.vae
    load = models.vae.load_vae
    monkeypatch.setattr(models.vae, "load_vae", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "out"
    assert prepare(mixed, vae_dir, out) == 1
    err = capsys.readouterr().err
    assert (f"{mixed / 'alpha.png'} (and 1 more): an image is a 1-frame clip, and data.num_frames=9 (--config=debug); "
            f"add buckets with a 1-frame one (--buckets 1x32x32,9x32x32), or --set data.num_frames=1") in err
    assert prepare(mixed, vae_dir, out, "--buckets", "9x32x32,9x32x48") == 1
    assert (f"{mixed / 'alpha.png'}: an image is a 1-frame clip, and --buckets=9x32x32,9x32x48 gives it 9x32x32; "
            f"add a 1-frame bucket (--buckets 1x32x32,9x32x32,9x32x48)") in capsys.readouterr().err
    assert not out.exists()                                          # nothing written
    monkeypatch.setattr(models.vae, "load_vae", load)
    # Followed: --set data.num_frames=1 prepares every file as one frame (the video's first frame)
    assert prepare(mixed, vae_dir, out, sets=SETS + ["data.num_frames=1"]) == 0
    assert len(lines(out / "manifest.jsonl")) == 3
    assert load_file(out / "latents/turned.jpg.safetensors")["latent"].shape == (4, 1, 16, 16)


I2V = "is image-to-video (model.image_condition): a picture's only frame is its condition"


@pytest.mark.parametrize("config,says", [
    ("debug-ltx2", "trains on each clip's sound track, which an image has not"),
    ("debug-wan-i2v", I2V), ("debug-wan22-ti2v", I2V), ("cogvideox-5b-i2v", I2V), ("cogvideox1.5-5b-i2v", I2V),
    ("wan2.2-i2v-a14b", I2V), ("hunyuanvideo1.5-i2v-720p", I2V), ("ltx2-i2v", "trains on each clip's sound track"),
])
def test_families_a_picture_cannot_train_are_refused(mixed, vae_dir, tmp_path, capsys, monkeypatch, config, says):
    """Every image-to-video preset (and LTX-2's sound): the refusal is listed with the run's other problems (the
    released presets' VAE is not the tiny one), before any model loads."""
    import models.vae
    monkeypatch.setattr(models.vae, "load_vae", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "out"
    assert main(["--config", config, "--videos", str(mixed), "--vae", str(vae_dir), "--out", str(out),
                 "--buckets", "1x32x32,9x32x32"]) == 1
    err = capsys.readouterr().err
    assert f"{mixed / 'alpha.png'} (and 1 more): an image; model {config} (--config={config}) {says}" in err
    assert not out.exists()


def test_text_to_video_on_a_model_that_does_both_takes_images(mixed, vae_and_picture, tmp_path, capsys):
    """Wan 2.2 TI2V: refused as image-to-video; the advice followed (model.image_condition=false) prepares each
    picture as the 2.2 VAE's normalised latent of one frame, with no picture latent beside it."""
    vae, _ = vae_and_picture
    vae_dir, out = tmp_path / "wan22_vae", tmp_path / "out"
    vae.save_pretrained(vae_dir)
    args = ["--config", "debug-wan22-ti2v", "--set", "data.height=32", "--set", "data.width=32", "--videos",
            str(mixed), "--vae", str(vae_dir), "--out", str(out), "--buckets", "1x32x32,9x32x32", "--posterior",
            "mode"]
    assert main(args) == 1
    assert "train text-to-video (--set model.image_condition=false" in capsys.readouterr().err
    assert not out.exists()
    assert main(args + ["--set", "model.image_condition=false"]) == 0
    manifest = {m["video"]: m for m in lines(out / "manifest.jsonl")}
    assert manifest["alpha.png"]["shape"] == [1, 32, 32] and manifest["clip.mkv"]["shape"] == [9, 32, 32]
    mean = torch.tensor(vae.config.latents_mean).view(-1, 1, 1, 1)
    inv_std = 1 / torch.tensor(vae.config.latents_std).view(-1, 1, 1, 1)
    for name in ("turned.jpg", "alpha.png"):
        x = torch.from_numpy(pil_frame(mixed / name, 32, 32)).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1
        with torch.no_grad():
            want = (vae.encode(x).latent_dist.mode()[0] - mean) * inv_std
        stored = load_file(out / manifest[name]["latent"])
        assert set(stored) == {"latent"} and stored["latent"].shape == (8, 1, 2, 2)
        torch.testing.assert_close(stored["latent"], want)


def test_a_folder_without_clips_names_what_it_takes(tmp_path, vae_dir, capsys):
    (tmp_path / "notes.txt").write_text("not a clip")
    assert prepare(tmp_path, vae_dir, tmp_path / "out") == 1
    assert f"--videos={tmp_path}: no video or image files (.mp4, .mov" in capsys.readouterr().err
