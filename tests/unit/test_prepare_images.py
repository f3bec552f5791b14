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


@pytest.mark.parametrize("config,sets,says", [
    ("debug-ltx2", [], "trains on each clip's sound track, which an image has not"),
    ("debug-wan-i2v", [], "is image-to-video (model.image_condition): a picture's only frame is its condition"),
])
def test_families_a_picture_cannot_train_are_refused(mixed, vae_dir, tmp_path, capsys, monkeypatch, config, sets,
                                                      says):
    import models.vae
    monkeypatch.setattr(models.vae, "load_vae", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "out"
    assert main(["--config", config, "--videos", str(mixed), "--vae", str(vae_dir), "--out", str(out),
                 "--buckets", "1x32x32,9x32x32"]) == 1
    err = capsys.readouterr().err
    assert f"{mixed / 'alpha.png'} (and 1 more): an image; model {config} (--config={config}) {says}" in err
    assert not out.exists()
