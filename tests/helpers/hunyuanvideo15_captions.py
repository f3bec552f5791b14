"""The helpers and fixtures of tests/unit/test_hunyuanvideo15_captions.py that other test modules use too: `ROWS`,
`_NoVae`, `release` (a test module imports no other test module)."""
import types

import pytest
import torch
from diffusers import HunyuanVideo15Pipeline
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (ByT5Tokenizer, PreTrainedTokenizerFast, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config,
                          T5EncoderModel)

from models.hunyuanvideo15.captions import SYSTEM_MESSAGE


WORDS = ["<pad>", "<unk>", "<eos>", "system", "user", "assistant", ":", ".", "a", "red", "sign", "saying", "open",
         "moving", "left", "fast"]
CHAT = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}")
QWEN, GLYPH = 32, 16                                  # debug-hunyuan15's text_embed_dim and glyph_dim
IMAGE_LEN, GLYPH_LEN, QWEN_LEN = 4, 16, 8             # its rows, with 16 byT5 ones: room for padding rows
ROWS = [f"model.glyph_len={GLYPH_LEN}", f"model.max_text_len={IMAGE_LEN + GLYPH_LEN + QWEN_LEN}"]


class _NoVae(torch.nn.Module):
    """What the pipeline's __init__ reads of a VAE (encode_prompt reads none)."""
    config = types.SimpleNamespace(latent_channels=4)
    temporal_compression_ratio, spatial_compression_ratio = 4, 16


def _tokenizer(path):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                            chat_template=CHAT).save_pretrained(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(folder, pipeline, crop_start): the four text folders of a HunyuanVideo 1.5 pipeline, tiny and random."""
    folder = tmp_path_factory.mktemp("hunyuan15_text")
    torch.manual_seed(0)
    qwen = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(vocab_size=len(WORDS), hidden_size=QWEN, intermediate_size=64,
                                                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                    pad_token_id=0, bos_token_id=None, eos_token_id=2,
                                                    rope_scaling={"type": "mrope",
                                                                                  "mrope_section": [1, 1, 2]})).eval()
    qwen.save_pretrained(folder / "text_encoder")
    byt5 = T5EncoderModel(T5Config(vocab_size=384, d_model=GLYPH, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0)).eval()
    byt5.save_pretrained(folder / "text_encoder_2")
    tok = _tokenizer(folder / "tokenizer")
    ByT5Tokenizer().save_pretrained(folder / "tokenizer_2")
    tok_2 = ByT5Tokenizer.from_pretrained(folder / "tokenizer_2")
    pipe = HunyuanVideo15Pipeline(text_encoder=qwen, tokenizer=tok, transformer=None, vae=_NoVae(),
                                  scheduler=None, text_encoder_2=byt5, tokenizer_2=tok_2, guider=None)
    # the template's tokens before the caption, with this tokenizer
    crop = len(tok.apply_chat_template([[{"role": "system", "content": SYSTEM_MESSAGE},
                                         {"role": "user", "content": "a"}]], add_generation_prompt=True,
                                        tokenize=True)[0]) - 4                   # "a . assistant :"
    pipe.release_crop = pipe.prompt_template_encode_start_idx                      # the release's (108)
    pipe.prompt_template_encode_start_idx, pipe.tokenizer_max_length, pipe.tokenizer_2_max_length = \
        crop, QWEN_LEN, GLYPH_LEN
    return folder, pipe, crop
