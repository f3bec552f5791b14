"""HunyuanVideo 1.5 image-to-video's SigLIP test setup, shared by tests/unit/test_hunyuanvideo15_siglip.py and
tests/cli/test_hunyuanvideo15_siglip_train.py: the tiny random SigLIP encoder saved as the pipeline's
image_encoder/ and feature_extractor/, the tiny VAE, and prepare_data on debug-hunyuan15."""
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLHunyuanVideo15
from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

from tests.helpers.hunyuanvideo15_captions import ROWS

IMAGE, IMAGE_DIM, HEIGHT, WIDTH = 4, 24, 32, 48        # debug-hunyuan15's image rows: SigLIP 32 px, patch 16
SETS = [f"data.height={HEIGHT}", f"data.width={WIDTH}", "data.num_frames=9", *ROWS]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def siglip(tmp_path_factory):
    """(pipeline-style folder, encoder, processor): image_encoder/ and feature_extractor/ as the release has them."""
    folder = tmp_path_factory.mktemp("hunyuan15_siglip")
    torch.manual_seed(0)
    encoder = SiglipVisionModel(SiglipVisionConfig(hidden_size=IMAGE_DIM, intermediate_size=32, num_hidden_layers=2,
                                                   num_attention_heads=2, image_size=32, patch_size=16)).eval()
    processor = SiglipImageProcessor(size={"height": 32, "width": 32})
    encoder.save_pretrained(folder / "image_encoder")
    processor.save_pretrained(folder / "feature_extractor")
    return folder, encoder, processor


def save_vae(folder: Path) -> None:
    """The tiny random HunyuanVideo 1.5 VAE (seed 0) the preparations encode with."""
    torch.manual_seed(0)
    AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
                                spatial_compression_ratio=16, temporal_compression_ratio=4
                                ).save_pretrained(folder)


def _prepare(videos, vae, text, out, config_sets, *extra) -> int:
    from parallel.prepare_data.prepare import main
    return main(["--config", "debug-hunyuan15", *[a for s in SETS + config_sets for a in ("--set", s)],
                 "--videos", str(videos), "--captions", str(videos / "captions.csv"), "--vae", str(vae),
                 "--t5", str(text), "--out", str(out), "--posterior", "mode", "--limit", "2", *extra])
