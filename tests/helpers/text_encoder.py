"""The helpers and fixtures of tests/unit/test_text_encoder.py that other test modules use too: `VOCAB`, `t5_dir` (a
test module imports no other test module)."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel



VOCAB = {"<pad>": 0, "</s>": 1, "<unk>": 2, "a": 3, "red": 4, "square": 5, "moving": 6, "left": 7}


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("t5")
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    torch.manual_seed(0)
    config = T5Config(vocab_size=len(VOCAB), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0)
    T5EncoderModel(config).save_pretrained(path)
    return path
