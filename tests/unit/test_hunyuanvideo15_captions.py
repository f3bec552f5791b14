"""HunyuanVideo 1.5's captions as HunyuanVideo15Pipeline.encode_prompt makes them, on a tiny random
Qwen2_5_VLTextModel (a word-level tokenizer with a chat template) and a tiny byT5 T5EncoderModel (ByT5Tokenizer)
saved as a pipeline folder: the toolkit's packed rows are [zero SigLIP rows; the pipeline's byT5 glyph states on
their first glyph_dim channels; its Qwen states (template, hidden_states[-3], crop)], each with its masked rows zero;
the training data path (data.text_encoder) encodes a manifest's caption so; prepare_data names what a folder lacks.
"""
import json

import torch

from models.hunyuanvideo15.captions import CROP_START, SYSTEM_MESSAGE, QwenByT5TextEncoder, glyph_text
from parallel.experiment.config import load_config
from parallel.train.run import build_dataset
from tests.helpers.hunyuanvideo15_captions import GLYPH, GLYPH_LEN, IMAGE_LEN, QWEN, QWEN_LEN, ROWS
from tests.helpers.hunyuanvideo15_captions import release  # noqa: F401  (fixtures)

CAPTIONS = ("a red sign saying \"open\" moving left",  # glyph 'Text "open". ': 13 bytes + EOS
            "a sign saying “ok” and \"ok\" fast",        # two quotes, one text, deduplicated: 11 bytes + EOS
            "a red sign")                               # no quote: zero glyph rows; 6 Qwen tokens with the template's


def _pipeline_rows(pipe, caption):
    """The pipeline's states, masked rows zero, packed in the family's order (models/hunyuanvideo15/config.py)."""
    with torch.no_grad():
        qwen, mask, glyph, mask_2 = pipe.encode_prompt(caption, device="cpu")
    rows = torch.zeros(IMAGE_LEN + GLYPH_LEN + QWEN_LEN, QWEN)
    rows[IMAGE_LEN:IMAGE_LEN + GLYPH_LEN, :GLYPH] = glyph[0] * mask_2[0, :, None]
    rows[IMAGE_LEN + GLYPH_LEN:] = qwen[0] * mask[0, :, None]
    return rows, mask[0], mask_2[0]


def test_rows_equal_encode_prompt(release):
    """Every caption's rows are the pipeline's; the masks are what the rows' zeros say (the family's reading)."""
    folder, pipe, crop = release
    assert pipe.system_message == SYSTEM_MESSAGE and pipe.release_crop == CROP_START
    assert [glyph_text(c) for c in CAPTIONS] == ['Text "open". ', 'Text "ok". ', None]
    model = load_config("debug-hunyuan15", ROWS).model
    ours = QwenByT5TextEncoder(folder, model.max_text_len, QWEN, model=model, crop_start=crop)
    masks = []
    for caption in CAPTIONS:
        want, mask, mask_2 = _pipeline_rows(pipe, caption)
        rows = ours.encode(caption)
        torch.testing.assert_close(rows, want)
        assert rows.ne(0).any(-1).tolist() == [False] * IMAGE_LEN + mask_2.bool().tolist() + mask.bool().tolist()
        masks.append((int(mask.sum()), int(mask_2.sum())))
    assert masks == [(8, 14), (8, 12), (6, 0)]         # Qwen rows truncated at 8, then padded; byT5 padded


def test_training_data_and_prepare_data(release, tmp_path, capsys):
    """data.text_encoder = the pipeline folder: a {"latent", "caption"} line gives the pipeline's rows (the release's
    crop, 108); python -m parallel.prepare_data --t5 with a folder that lacks the subfolders: refused by name."""
    folder, pipe, _ = release
    pipe.prompt_template_encode_start_idx = pipe.release_crop
    caption = CAPTIONS[0] + " fast" * 12           # long enough to reach past the release's 108 template tokens
    torch.save(torch.randn(4, 3, 4, 6), tmp_path / "clip.pt")
    (tmp_path / "manifest.jsonl").write_text(json.dumps({"latent": "clip.pt", "caption": caption}))
    cfg = load_config("debug-hunyuan15", ["data.kind=directory", f"data.path={tmp_path}",
                                          f"data.text_encoder={folder}", *ROWS])
    _, text = build_dataset(cfg)[0]
    want, mask, mask_2 = _pipeline_rows(pipe, caption)
    torch.testing.assert_close(text, want)
    assert (int(mask.sum()), int(mask_2.sum())) == (QWEN_LEN, 14)

    from parallel.prepare_data.prepare import main
    qwen = tmp_path / "text_encoder"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "hidden_size": 32}))
    assert main(["--config", "configs/debug-hunyuan15.yaml", "--videos", str(tmp_path), "--vae",
                 str(tmp_path / "vae"), "--out", str(tmp_path / "out"), "--t5", str(qwen)]) == 1
    assert (f"--t5={qwen}: HunyuanVideo 1.5 captions need a pipeline folder with text_encoder, tokenizer, "
            "text_encoder_2, tokenizer_2/ (Qwen2_5_VLTextModel; its tokenizer with the chat template; T5EncoderModel "
            "(byT5); ByT5Tokenizer); missing: text_encoder, tokenizer, text_encoder_2, tokenizer_2"
            ) in capsys.readouterr().err
