"""Directory datasets: every file's shape is read from its header and checked against the model before training."""
import json

import pytest
import torch
from safetensors.torch import save_file

from parallel.check import check_data_files
from parallel.experiment.config import load_config
from parallel.train.data import MAX_SHAPE_PROBLEMS, check_shapes, stored_shape


def write_dataset(root, cfg, n=4, latents=None, texts=None):
    """n samples that fit the debug model; latents/texts: {index: shape} overrides (even: safetensors, odd: .pt)."""
    m = cfg.model
    lines = []
    for i in range(n):
        latent = (latents or {}).get(i, (m.in_channels, 3, 8, 8))
        text = (texts or {}).get(i, (m.max_text_len, m.text_embed_dim))
        if i % 2 == 0:
            save_file({"latent": torch.zeros(latent), "other": torch.zeros(1)}, str(root / f"v{i}.safetensors"))
            save_file({"text": torch.zeros(text)}, str(root / f"v{i}_text.safetensors"))
            lines.append({"latent": f"v{i}.safetensors", "text": f"v{i}_text.safetensors"})
        else:
            torch.save(torch.zeros(latent), root / f"v{i}.pt")
            torch.save(torch.zeros(text), root / f"v{i}_text.pt")
            lines.append({"latent": f"v{i}.pt", "text": f"v{i}_text.pt"})
    (root / "manifest.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_stored_shape_reads_what_the_loader_returns(tmp_path):
    save_file({"a": torch.zeros(2, 3), "latent": torch.zeros(4, 5)}, str(tmp_path / "x.safetensors"))
    save_file({"only": torch.zeros(7)}, str(tmp_path / "y.safetensors"))
    torch.save(torch.zeros(1, 2, 3), tmp_path / "z.pt")
    torch.save({"latent": torch.zeros(1)}, tmp_path / "d.pt")
    assert stored_shape(tmp_path / "x.safetensors", "latent") == [4, 5]
    assert stored_shape(tmp_path / "y.safetensors", "latent") == [7]       # the first tensor, as _load_tensor
    assert stored_shape(tmp_path / "z.pt", "latent") == [1, 2, 3]
    with pytest.raises(ValueError, match="holds a dict, not a tensor"):
        stored_shape(tmp_path / "d.pt", "latent")


def test_a_dataset_that_fits_passes(tmp_path):
    cfg = load_config("debug", ["data.kind=directory", f"data.path={tmp_path}"])
    write_dataset(tmp_path, cfg)
    assert check_shapes(tmp_path, cfg.model, cfg.data) == []
    assert check_data_files(cfg) == []


def test_every_wrong_file_is_named_with_its_line_and_both_shapes(tmp_path):
    cfg = load_config("debug", ["data.kind=directory", f"data.path={tmp_path}"])
    m = cfg.model
    write_dataset(tmp_path, cfg, latents={0: (4, 3, 8, 9), 1: (1, 4, 3, 8, 8)}, texts={2: (m.max_text_len, 7),
                                                                                       3: (5, m.text_embed_dim)})
    save_file({"text": torch.zeros(3, 3)}, str(tmp_path / "uncond.safetensors"))
    problems = check_data_files(cfg)
    t = m.max_text_len, m.text_embed_dim
    why = (f"model.in_channels=4; data.num_frames={cfg.data.num_frames}, data.height={cfg.data.height}, "
           f"data.width={cfg.data.width} / model.vae_scale_temporal={m.vae_scale_temporal}, "
           f"model.vae_scale_spatial={m.vae_scale_spatial} -> 3 x 8 x 8 latent")
    assert problems == [
        f"{tmp_path / 'v0.safetensors'}: latent shape [4, 3, 8, 9] != expected [4, 3, 8, 8] (manifest.jsonl:1; {why})",
        f"{tmp_path / 'v1.pt'}: latent shape [1, 4, 3, 8, 8] != expected [4, 3, 8, 8] (manifest.jsonl:2; {why})",
        f"{tmp_path / 'v2_text.safetensors'}: text shape [{t[0]}, 7] != expected [{t[0]}, {t[1]}] (manifest.jsonl:3; "
        f"model.max_text_len={t[0]}, model.text_embed_dim={t[1]})",
        f"{tmp_path / 'v3_text.pt'}: text shape [5, {t[1]}] != expected [{t[0]}, {t[1]}] (manifest.jsonl:4; "
        f"model.max_text_len={t[0]}, model.text_embed_dim={t[1]})",
        f"{tmp_path / 'uncond.safetensors'}: text shape [3, 3] != expected [{t[0]}, {t[1]}] (the unconditional "
        f"embedding; model.max_text_len={t[0]}, model.text_embed_dim={t[1]})"]


def test_many_wrong_files_are_counted_and_val_path_is_checked(tmp_path):
    train, val = tmp_path / "train", tmp_path / "val"
    train.mkdir(), val.mkdir()
    cfg = load_config("debug", ["data.kind=directory", f"data.path={train}", f"val.path={val}", "val.every=1"])
    write_dataset(train, cfg)
    n = MAX_SHAPE_PROBLEMS + 3
    write_dataset(val, cfg, n=n, latents={i: (2, 3, 8, 8) for i in range(n)})
    problems = check_data_files(cfg)
    assert len(problems) == MAX_SHAPE_PROBLEMS + 1
    assert all(f"{val}/v" in p and "!= expected [4, 3, 8, 8]" in p for p in problems[:-1])
    assert problems[-1] == f"val.path={val}: 3 more files with the wrong shape ({n} of {2 * n})"


def test_a_missing_file_is_a_problem_not_a_crash(tmp_path):
    cfg = load_config("debug", ["data.kind=directory", f"data.path={tmp_path}"])
    (tmp_path / "manifest.jsonl").write_text(json.dumps({"latent": "a.safetensors", "text": "a.pt"}) + "\n")
    assert check_data_files(cfg) == [f"{tmp_path / 'manifest.jsonl'}:1: data file {tmp_path / 'a.safetensors'} "
                                     f"does not exist"]


def test_legacy_pt_files_are_read_and_a_damaged_header_is_named(tmp_path):
    cfg = load_config("debug", ["data.kind=directory", f"data.path={tmp_path}"])
    write_dataset(tmp_path, cfg, n=2)
    torch.save(torch.zeros(2, 5), tmp_path / "v1.pt", _use_new_zipfile_serialization=False)   # cannot be mmapped
    (tmp_path / "v0_text.safetensors").write_bytes(b"garbage")
    problems = check_data_files(cfg)
    assert len(problems) == 2
    assert problems[0].startswith(f"{tmp_path / 'v0_text.safetensors'}: cannot read the text tensor's shape "
                                  f"(manifest.jsonl:1): ")
    assert problems[1].startswith(f"{tmp_path / 'v1.pt'}: latent shape [2, 5] != expected [4, 3, 8, 8] "
                                  f"(manifest.jsonl:2; ")


def test_i2v_image_latents_are_checked_against_the_samples_latent(tmp_path):
    """An image-to-video model: each latent file's "image" tensor (prepare_data's first-frame latent) must be
    [C, 1, H, W] of that sample's latent; a file without one is refused (its first latent frame is at the
    training latents' scale, not the image latents'); a text-to-video model does not look at it."""
    sets = ["data.kind=directory", f"data.path={tmp_path}", "model.pos_embed=rope3d", "model.image_condition=true"]
    cfg = load_config("debug", sets)
    images = {0: (4, 1, 8, 8), 1: (4, 1, 8, 6), 2: None, 3: (4, 3, 8, 8)}
    for i, shape in images.items():
        tensors = {"latent": torch.zeros(4, 3, 8, 8), **({"image": torch.zeros(shape)} if shape else {})}
        save_file(tensors, str(tmp_path / f"v{i}.safetensors"))
        save_file({"text": torch.zeros(cfg.model.max_text_len, cfg.model.text_embed_dim)},
                  str(tmp_path / f"v{i}_text.safetensors"))
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps({"latent": f"v{i}.safetensors",
                                                                 "text": f"v{i}_text.safetensors"}) + "\n"
                                                     for i in images))
    why = (f"the first frame's latent of the sample's; model.in_channels=4; data.num_frames={cfg.data.num_frames}, "
           f"data.height={cfg.data.height}, data.width={cfg.data.width} / model.vae_scale_temporal=4, "
           f"model.vae_scale_spatial=8 -> 3 x 8 x 8 latent")
    assert check_data_files(cfg) == [
        f"{tmp_path / 'v1.safetensors'}: image shape [4, 1, 8, 6] != expected [4, 1, 8, 8] (manifest.jsonl:2; {why})",
        f"{tmp_path / 'v2.safetensors'}: no \"image\" tensor (manifest.jsonl:3): an image-to-video model trains on "
        f"the first frame's VAE latent stored beside the video's; prepare the videos with this image-to-video config "
        f"(python -m parallel.prepare_data --config ...), which writes it",
        f"{tmp_path / 'v3.safetensors'}: image shape [4, 3, 8, 8] != expected [4, 1, 8, 8] (manifest.jsonl:4; {why})"]
    t2v = load_config("debug", sets[:2])
    assert check_shapes(tmp_path, t2v.model, t2v.data) == []
