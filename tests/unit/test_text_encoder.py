"""Captions through a local T5 encoder (tiny random config, saved and reloaded offline)."""
import json

import pytest
import torch
from transformers import T5EncoderModel

from parallel.experiment.config import load_config
from parallel.train.run import build_dataset
from tests.helpers.text_encoder import t5_dir  # noqa: F401  (fixtures)


def test_captions_are_encoded_like_t5_itself(t5_dir, tmp_path):
    torch.save(torch.randn(4, 3, 8, 8), tmp_path / "clip.pt")
    (tmp_path / "manifest.jsonl").write_text(json.dumps({"latent": "clip.pt", "caption": "a red square moving left"}))
    cfg = load_config("debug", ["data.kind=directory", f"data.path={tmp_path}", f"data.text_encoder={t5_dir}"])
    latent, text = build_dataset(cfg)[0]
    ids = torch.tensor([[3, 4, 5, 6, 7, 0, 0, 0]])          # 5 words, padded to model.max_text_len = 8
    expected = T5EncoderModel.from_pretrained(t5_dir).eval()(input_ids=ids).last_hidden_state[0]
    assert text.shape == (8, 32)
    torch.testing.assert_close(text, expected.detach())
    assert torch.equal(latent, torch.load(tmp_path / "clip.pt"))


def test_encoder_width_must_match_the_model(t5_dir, tmp_path):
    (tmp_path / "manifest.jsonl").write_text(json.dumps({"latent": "x.pt", "caption": "a"}))
    cfg = load_config("debug", ["data.kind=directory", f"data.path={tmp_path}", f"data.text_encoder={t5_dir}",
                                "model.text_embed_dim=48"])
    with pytest.raises(ValueError, match=f"data.text_encoder={t5_dir}: d_model 32 != model.text_embed_dim 48"):
        build_dataset(cfg)


def test_encoder_class_reads_the_model_type():
    """A whole T5 checkpoint (T5ForConditionalGeneration, as t5-v1_1-xxl ships) is read as its encoder; UMT5 as
    UMT5EncoderModel; a config of another kind names what it describes (refused by T5TextEncoder)."""
    from models.text_encoder import encoder_class, encoder_formats
    assert encoder_class({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}) == "T5EncoderModel"
    assert encoder_class({"model_type": "umt5", "architectures": ["UMT5EncoderModel"]}) == "UMT5EncoderModel"
    assert encoder_class({"model_type": "t5"}) == "T5EncoderModel"
    assert encoder_class({"model_type": "bert", "architectures": ["BertModel"]}) == "BertModel" not in encoder_formats()
