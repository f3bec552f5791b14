"""HunyuanVideo's captions as HunyuanVideoPipeline.encode_prompt makes them, on tiny random LlamaModel and CLIPTextModel
saved as a pipeline folder (text_encoder/, tokenizer/, text_encoder_2/, tokenizer_2/): the toolkit's rows are the
pipeline's LLaMA states (template, hidden_states[-3], crop) with its padding rows zero, and its CLIP pooled vector
on every row; the training data path (data.text_encoder) encodes a manifest's caption so. With model.text_encoder
t5_clip (Open-Sora 2.0), a T5EncoderModel in text_encoder/: the rows are Open-Sora's HFEmbedder's
(opensora/models/text/conditioner.py: padded to max_length, encoded with attention_mask=None; CLIP pooler_output).
"""
import json

import pytest
import torch
from diffusers import HunyuanVideoPipeline
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel, PreTrainedTokenizerFast, T5Config,
                          T5EncoderModel)

from models.hunyuanvideo.captions import CROP_START, TEMPLATE, LlamaClipTextEncoder
from parallel.experiment.config import load_config
from parallel.train.run import build_dataset

WORDS = ["<pad>", "<unk>", "<eos>", "system", "user", ":", ".", "describe", "the", "video", "a", "red", "square",
         "moving", "left", "fast"]
SHORT = {"template": "system : describe the video . user : {}", "crop_start": 8}   # 8 tokens before the caption
LLAMA, CLIP, TEXT = 32, 8, 8                                                      # debug-hunyuan's 32 + 8, 8 rows


def _tokenizer(path):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(folder, pipeline): the four text folders of a HunyuanVideo pipeline, tiny and random."""
    folder = tmp_path_factory.mktemp("hunyuan_text")
    torch.manual_seed(0)
    llama = LlamaModel(LlamaConfig(vocab_size=len(WORDS), hidden_size=LLAMA, intermediate_size=64,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   pad_token_id=0)).eval()
    llama.save_pretrained(folder / "text_encoder")
    clip = _clip(folder)
    tokenizers = [_tokenizer(folder / name) for name in ("tokenizer", "tokenizer_2")]
    pipe = HunyuanVideoPipeline(text_encoder=llama, tokenizer=tokenizers[0], transformer=None, vae=None,
                                scheduler=None, text_encoder_2=clip, tokenizer_2=tokenizers[1])
    return folder, pipe


def _clip(folder):
    torch.manual_seed(1)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(WORDS), hidden_size=CLIP, intermediate_size=16,
                                        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                                        pad_token_id=0, eos_token_id=WORDS.index("<eos>"))).eval()
    clip.save_pretrained(folder / "text_encoder_2")
    return clip


def _pipeline_rows(pipe, caption, template):
    with torch.no_grad():
        embeds, pooled, mask = pipe.encode_prompt(caption, prompt_template=template, device="cpu",
                                                  max_sequence_length=TEXT)
    return embeds[0], pooled[0], mask[0]


@pytest.mark.parametrize("template", [SHORT, {"template": TEMPLATE, "crop_start": CROP_START}])
def test_rows_equal_encode_prompt(release, template):
    """The short template crops exactly its own tokens; the release's (crop 95) crops what it says with any
    tokenizer, as the pipeline does."""
    folder, pipe = release
    ours = LlamaClipTextEncoder(folder, TEXT, LLAMA + CLIP, template=template["template"],
                                crop_start=template["crop_start"])
    for caption in ("a red square moving left", "a red square moving left fast fast fast fast"):
        embeds, pooled, mask = _pipeline_rows(pipe, caption, template)
        rows = ours.encode(caption)
        assert rows.shape == (TEXT, LLAMA + CLIP)
        torch.testing.assert_close(rows[:, :LLAMA], embeds * mask[:, None])
        torch.testing.assert_close(rows[:, LLAMA:], pooled.expand(TEXT, -1))
    if template is SHORT:                              # 5 real rows then padding, which the family reads as its mask
        assert mask.tolist() == [1] * TEXT and _pipeline_rows(pipe, "a red square moving left", SHORT)[2].sum() == 5
        assert rows[:, :LLAMA].ne(0).any(-1).tolist() == [True] * TEXT
        assert ours.encode("a red square moving left")[:, :LLAMA].ne(0).any(-1).tolist() == [True] * 5 + [False] * 3


def test_training_data_encodes_a_manifest_caption(release, tmp_path):
    """data.text_encoder = the pipeline folder: a {"latent", "caption"} line gives the release's template's rows."""
    folder, pipe = release
    torch.save(torch.randn(4, 3, 8, 8), tmp_path / "clip.pt")
    (tmp_path / "manifest.jsonl").write_text(json.dumps({"latent": "clip.pt", "caption": "a red square"}))
    cfg = load_config("debug-hunyuan", ["data.kind=directory", f"data.path={tmp_path}",
                                        f"data.text_encoder={folder}"])
    _, text = build_dataset(cfg)[0]
    embeds, pooled, mask = _pipeline_rows(pipe, "a red square", {"template": TEMPLATE, "crop_start": CROP_START})
    torch.testing.assert_close(text, torch.cat([embeds * mask[:, None], pooled.expand(TEXT, -1)], dim=-1))


def test_t5_clip_rows_are_opensoras(tmp_path):
    """model.text_encoder=t5_clip through the training data path: Open-Sora's T5 rows (no mask, padding kept) and
    the CLIP pooled vector, restated from its HFEmbedder."""
    torch.manual_seed(0)
    t5 = T5EncoderModel(T5Config(vocab_size=len(WORDS), d_model=LLAMA, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                 decoder_start_token_id=0, pad_token_id=0)).eval()
    folder = tmp_path / "opensora_text"
    t5.save_pretrained(folder / "text_encoder")
    clip = _clip(folder)
    tok, tok_2 = _tokenizer(folder / "tokenizer"), _tokenizer(folder / "tokenizer_2")
    caption = "a red square moving left"
    with torch.no_grad():                                  # HFEmbedder.forward, t5 then clip
        ids = tok(caption, truncation=True, max_length=TEXT, padding="max_length", return_tensors="pt").input_ids
        want_t5 = t5(input_ids=ids, attention_mask=None).last_hidden_state[0]
        ids_2 = tok_2(caption, truncation=True, max_length=77, padding="max_length", return_tensors="pt").input_ids
        want_pooled = clip(input_ids=ids_2, attention_mask=None).pooler_output[0]
    data = tmp_path / "data"
    data.mkdir()
    torch.save(torch.randn(4, 3, 8, 8), data / "clip.pt")
    (data / "manifest.jsonl").write_text(json.dumps({"latent": "clip.pt", "caption": caption}))
    cfg = load_config("debug-hunyuan", ["data.kind=directory", f"data.path={data}", f"data.text_encoder={folder}",
                                        "model.text_encoder=t5_clip"])
    _, text = build_dataset(cfg)[0]
    torch.testing.assert_close(text, torch.cat([want_t5, want_pooled.expand(TEXT, -1)], dim=-1))
    assert text[:, :LLAMA].ne(0).any(-1).all()             # padding rows are T5 states, not zero


def test_prepare_data_names_what_the_folder_lacks(tmp_path, capsys):
    """python -m parallel.prepare_data --t5 with a T5-style folder for HunyuanVideo: refused before loading, naming the
    pipeline subfolders its captions need."""
    from parallel.prepare_data.prepare import main
    t5 = tmp_path / "text_encoder"
    t5.mkdir()
    (t5 / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 32}))
    assert main(["--config", "configs/debug-hunyuan.yaml", "--videos", str(tmp_path), "--vae", str(tmp_path / "vae"),
                 "--out", str(tmp_path / "out"), "--t5", str(t5)]) == 1
    assert (f"--t5={t5}: HunyuanVideo-family captions need a pipeline folder with text_encoder, tokenizer, "
            "text_encoder_2, tokenizer_2/ (LlamaModel, or T5EncoderModel with model.text_encoder=t5_clip; its "
            "tokenizer; CLIPTextModel; its tokenizer); missing: text_encoder, tokenizer, text_encoder_2, "
            "tokenizer_2") in capsys.readouterr().err
