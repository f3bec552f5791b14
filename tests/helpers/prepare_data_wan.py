"""The helpers and fixtures of tests/unit/test_prepare_data_wan.py that other test modules use too: `MEAN`, `SETS`,
`STD`, `run`, `umt5_dir`, `wan_vae_dir` (a test module imports no other test module)."""

import pytest
import torch
from diffusers import AutoencoderKLWan
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

from parallel.prepare_data.prepare import main
from tests.helpers.text_encoder import VOCAB  # noqa: F401  (fixture: tiny T5)


# debug-wan at 9 x 32 x 32: the tiny VAE (8x spatial, 4x temporal, 4 channels) gives latents [4, 3, 4, 4].
SETS = ["data.height=32", "data.width=32"]
MEAN, STD = [0.3, -0.2, 0.1, 0.5], [1.5, 0.7, 2.0, 1.1]


@pytest.fixture(scope="module")
def umt5_dir(tmp_path_factory):
    """A tiny random UMT5 encoder (d_model 32 = debug-wan's text_embed_dim) with a word-level tokenizer that
    appends EOS as the released one does."""
    path = tmp_path_factory.mktemp("umt5")
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    torch.manual_seed(0)
    UMT5EncoderModel(UMT5Config(vocab_size=len(VOCAB), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                decoder_start_token_id=0, pad_token_id=0)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def wan_vae_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("wan_vae")
    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                     temperal_downsample=[False, True, True], latents_mean=MEAN,
                     latents_std=STD).save_pretrained(path)
    return path


def run(root, vae, out, *extra, config="debug-wan", sets=SETS, captions=None) -> int:
    return main(["--config", config, *[a for s in sets for a in ("--set", s)], "--videos", str(root),
                 "--captions", str(captions or root / "captions.csv"), "--vae", str(vae), "--out", str(out), *extra])
