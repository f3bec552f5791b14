"""HunyuanVideo 1.5 image-to-video's SigLIP rows against HunyuanVideo15ImageToVideoPipeline (diffusers 0.42), on a
tiny random SiglipVisionModel + SiglipImageProcessor saved as the pipeline's image_encoder/ and feature_extractor/,
fp32, one process:

  - the toolkit's states (models/hunyuanvideo15/siglip.py) of a picture equal the pipeline's encode_image, and of a
    clip's first frame as data preparation reads it too; `text_rows` puts them where the transformer's image_embeds
    come from (released.py's split_text);
  - python -m parallel.prepare_data --image-encoder on an I2V config stores them beside the picture latent, a
    training batch from the folder carries them in the image rows of every sample's text (a caption-dropped one's
    too, as the pipeline's unconditional call), a T2V folder keeps zero image rows; I2V without --image-encoder and
    T2V with it are refused by name; validation (loss, and samples with guidance) feeds the same rows (train.py's
    first loss on the prepared folder is that batch's: tests/cli/test_hunyuanvideo15_siglip_train.py);
  - python -m parallel.sample --image --image-encoder gives the pipeline's latents.
"""

import numpy as np
import torch
from diffusers import HunyuanVideo15ImageToVideoPipeline
from PIL import Image
from safetensors.torch import load_file

from models.hunyuanvideo15.image import Hunyuan15ImageCondition
from models.hunyuanvideo15.released import DIFFUSERS
from models.hunyuanvideo15.siglip import encode_image_states, load_image_encoder, text_rows
from parallel.experiment.config import load_config
from tests.helpers.hunyuanvideo15_captions import _NoVae, release  # noqa: F401  (fixture: text folders)
from tests.helpers.hunyuanvideo15 import released  # noqa: F401  (fixture: the tiny transformer)
from tests.helpers.hunyuanvideo15_siglip import IMAGE, IMAGE_DIM, HEIGHT, SETS, WIDTH, _prepare, save_vae
from tests.helpers.hunyuanvideo15_siglip import siglip  # noqa: F401  (fixture: the SigLIP encoder)
from tests.helpers.prepare_data import videos  # noqa: F401  (fixture: clips)

def pipeline_states(encoder, processor, picture) -> torch.Tensor:
    pipe = HunyuanVideo15ImageToVideoPipeline(text_encoder=None, tokenizer=None, transformer=None, vae=_NoVae(),
                                              scheduler=None, text_encoder_2=None, tokenizer_2=None, guider=None,
                                              image_encoder=encoder, feature_extractor=processor)
    with torch.no_grad():
        return pipe.encode_image(picture, batch_size=1, device=torch.device("cpu"), dtype=torch.float32)


def test_states_and_rows_are_the_pipelines(siglip):
    folder, encoder, processor = siglip
    picture = Image.fromarray(np.random.default_rng(5).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8))
    want = pipeline_states(encoder, processor, picture)
    assert want.shape == (1, IMAGE, IMAGE_DIM)
    pair = load_image_encoder(folder)
    torch.testing.assert_close(encode_image_states(*pair, [picture]), want)
    torch.testing.assert_close(encode_image_states(*pair, [np.asarray(picture)]), want)   # a clip's uint8 frame
    cfg = load_config("debug-hunyuan15", ["model.image_condition=true", *SETS])
    condition = Hunyuan15ImageCondition(cfg.model, cfg.data)
    torch.testing.assert_close(condition.encode_image_states(pair, [picture]), want)
    assert condition.image_encoder_problems(folder) == []
    text = torch.randn(1, cfg.model.max_text_len, cfg.model.text_embed_dim)
    rows = text_rows(text, want)
    model = type("M", (), {"config": type("C", (), {"text_embed_2_dim": 16, "image_embed_dim": IMAGE_DIM})})
    qwen, _, glyph, _, image = DIFFUSERS.bind(cfg.model).split_text(rows, model)
    torch.testing.assert_close(image, want, rtol=0, atol=0)               # the transformer's image_embeds
    assert not rows[:, :IMAGE, IMAGE_DIM:].any()                           # the rest of the image rows: zero
    torch.testing.assert_close(rows[:, IMAGE:], text[:, IMAGE:], rtol=0, atol=0)
    wide = load_config("debug-hunyuan15", ["model.image_condition=true", "model.image_dim=16", "model.image_len=9",
                                           *SETS])
    assert Hunyuan15ImageCondition(wide.model, wide.data).image_encoder_problems(folder) == [
        f"--image-encoder={folder}: SigLIP hidden_size 24 != model.image_dim 16",
        f"--image-encoder={folder}: (image_size / patch_size)^2 = 4 SigLIP states != model.image_len 9 (the image "
        f"rows of the text input)"]


def validation_rows(cfg, dataset):
    """Validation's loss and samples give the model each sample's stored states as its image rows, in the
    unconditional call of guidance too (a recording forward: the text input of every call)."""
    from models.diffusion import Objective
    from parallel.distributed.topology import ParallelContext
    from parallel.validation.validate import sample_latents, validation_loss

    class Recorder:
        lockstep, texts = False, []

        def predict(self, inputs, like):
            self.texts.append(inputs[2])
            return torch.zeros_like(like)
    cfg = cfg.model_copy(update={"val": cfg.val.model_copy(update={"timesteps": [300, 700], "num_prompts": 2,
                                                                   "sample_steps": 1, "guidance_scale": 2.0})})
    forward, states = Recorder(), [dataset[i][3] for i in range(len(dataset))]
    validation_loss(forward, dataset, Objective.of(cfg.model), cfg, ParallelContext.single())
    sample_latents(forward, dataset, Objective.of(cfg.model), cfg, ParallelContext.single())
    calls = [0, 1, 0, 0, 1, 1]          # loss: one call a sample (2 timesteps); samples: conditional, unconditional
    assert len(forward.texts) == len(calls)
    for text, i in zip(forward.texts, calls):
        torch.testing.assert_close(text[:, :IMAGE, :IMAGE_DIM], states[i].expand(len(text), IMAGE, IMAGE_DIM),
                                   rtol=0, atol=0)
    torch.testing.assert_close(forward.texts[-1][0, IMAGE:], dataset.unconditional()[IMAGE:], rtol=0, atol=0)


def test_prepared_folder_trains_on_the_pipelines_rows(videos, release, siglip, tmp_path, capsys):  # noqa: F811
    from parallel.check import check_data_files
    from parallel.distributed.topology import ParallelContext
    from parallel.prepare_data.frames import frame_indices
    from parallel.train.run import build_dataset, training_batches

    root, frames = videos
    text_dir, folder = release[0], siglip[0]
    save_vae(tmp_path / "vae")
    i2v, t2v = ["model.image_condition=true"], []
    assert _prepare(root, tmp_path / "vae", text_dir, tmp_path / "x", i2v) == 1
    assert ("--image-encoder is missing: model debug-hunyuan15 (--config=debug-hunyuan15) trains on the first "
            "frame's SigLIP states; give the release's image encoder folder") in capsys.readouterr().err
    assert _prepare(root, tmp_path / "vae", text_dir, tmp_path / "x", t2v, "--image-encoder", str(folder)) == 1
    assert f"--image-encoder={folder}: model debug-hunyuan15 has no image cross-attention" in capsys.readouterr().err
    out = {"i2v": tmp_path / "i2v", "t2v": tmp_path / "t2v"}
    assert _prepare(root, tmp_path / "vae", text_dir, out["i2v"], i2v, "--image-encoder", str(folder)) == 0
    assert _prepare(root, tmp_path / "vae", text_dir, out["t2v"], t2v) == 0

    clip = frames["a0.mkv"][frame_indices(len(frames["a0.mkv"]), 9)]       # 32 x 48: read as it is
    stored = load_file(out["i2v"] / "latents/a0.mkv.safetensors")
    want = pipeline_states(siglip[1], siglip[2], Image.fromarray(clip[0]))[0]
    torch.testing.assert_close(stored["image_embeds"], want)
    assert stored["image"].shape == (4, 1, 2, 3)
    assert "image_embeds" not in load_file(out["t2v"] / "latents/a0.mkv.safetensors")
    for kind in ("i2v", "t2v"):            # the text files: the caption's rows, zero image rows either way
        assert not load_file(out[kind] / "text/a0.mkv.safetensors")["text"][:IMAGE].any()

    # A batch of both samples, the second's caption dropped: the stored states are the image rows of each.
    cfg = load_config("debug-hunyuan15", SETS + i2v + ["data.kind=directory", f"data.path={out['i2v']}",
                                                       "train.micro_batch_size=2", "train.grad_accum_steps=1"])
    assert check_data_files(cfg) == []
    dataset = build_dataset(cfg)
    batches = training_batches(cfg, ParallelContext.single(), dataset)
    batches.caption_dropout, batches.uncond = 0.3, dataset.unconditional()
    dropped = [batches.dropped(0, p) for p in (0, 1)]
    assert dropped == [False, True]                      # train.seed 1234's draws
    (x_t, _, text), _ = next(batches)
    for j, sample in enumerate(dataset[batches.sample_index(p)] for p in (0, 1)):
        caption = batches.uncond if dropped[j] else sample[1]
        torch.testing.assert_close(text[j], text_rows(caption[None], sample[3][None])[0], rtol=0, atol=0)
        torch.testing.assert_close(text[j, :IMAGE, :IMAGE_DIM], sample[3], rtol=0, atol=0)
    assert text[:, :IMAGE].any(-1).all()
    validation_rows(cfg, dataset)
    t2v_cfg = load_config("debug-hunyuan15", SETS + ["data.kind=directory", f"data.path={out['t2v']}"])
    assert check_data_files(t2v_cfg) == []
    (_, _, text), _ = next(training_batches(t2v_cfg, ParallelContext.single(), build_dataset(t2v_cfg)))
    assert not text[:, :IMAGE].any()


def test_sample_command_equals_the_pipeline(released, siglip, tmp_path, capsys):  # noqa: F811
    """python -m parallel.sample --image PICTURE --vae --image-encoder (the pipeline folder) gives
    HunyuanVideo15ImageToVideoPipeline's latents with its own SigLIP encoder (the picture's states in the image rows
    of the prompt's and the negative prompt's text alike); a picture without the encoder, or picture latents
    without the states, are refused by name before any model loads."""
    from safetensors.torch import save_file

    from parallel.sample import main
    from tests.helpers.hunyuanvideo15 import C, FRAMES, overrides
    from tests.helpers.hunyuanvideo15_sampling import _caption, _rows, i2v_latents, i2v_pipeline

    folder, transformer = released
    _, encoder, processor = siglip
    g = torch.Generator().manual_seed(6)
    (text, mask, text_2, mask_2), (neg, neg_mask, neg_2, neg_mask_2) = _caption(g, 5, 3), _caption(g, 8, 0)
    noise = torch.randn(1, C, FRAMES, 4, 6, generator=g)
    picture = Image.fromarray(np.random.default_rng(7).integers(0, 256, (64, 96, 3), dtype=np.uint8))
    pipe = i2v_pipeline(transformer, 3.0, encoder, processor)
    want = i2v_latents(pipe, picture, (text, mask, text_2, mask_2), (neg, neg_mask, neg_2, neg_mask_2), noise, 3)
    vae = pipe.vae
    with torch.no_grad():
        first = pipe._get_image_latents(vae, pipe.video_processor, picture, 64, 96, torch.device("cpu"))
    tensors = {"prompt": _rows(text, text_2), "negative": _rows(neg, neg_2), "noise": noise, "first": first[0]}
    for name, value in tensors.items():
        save_file({name: value.contiguous()}, str(tmp_path / f"{name}.safetensors"))
    vae.save_pretrained(tmp_path / "vae")
    picture.save(tmp_path / "picture.png")
    base = ["--config", "debug-hunyuan15", *[a for s in overrides(folder) + ["model.image_condition=true"]
                                             for a in ("--set", s)],
            "--prompt-embeds", str(tmp_path / "prompt.safetensors"), "--negative-embeds",
            str(tmp_path / "negative.safetensors"), "--noise", str(tmp_path / "noise.safetensors"), "--steps", "3",
            "--guidance", "3"]
    picture_args = ["--image", str(tmp_path / "picture.png"), "--vae", str(tmp_path / "vae")]
    assert main(base + picture_args + ["--out", str(tmp_path / "x")]) == 1
    assert ("--image needs the SigLIP vision encoder of the model's text input's image rows: --image-encoder DIR"
            in capsys.readouterr().err)
    assert main(base + ["--image-latents", str(tmp_path / "first.safetensors"), "--out", str(tmp_path / "x")]) == 1
    assert ("--image-latents needs the SigLIP states of the model's text input's image rows: --image-embeds FILE"
            in capsys.readouterr().err)
    assert main(base + picture_args + ["--image-encoder", str(siglip[0]), "--out", str(tmp_path / "out.safetensors")]
                ) == 0
    torch.testing.assert_close(load_file(str(tmp_path / "out.safetensors"))["latents"], want)
