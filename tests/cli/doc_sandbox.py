"""A copy of the repository in which the documentation's commands run on a CPU: the released presets made tiny
(same keys and families, sizes overridden; sequence parallelism above 2 ranks capped there, as the process counts
are: tests/cli/doc_runs.py processes) and tiny random folders of the released layout beside them.

    configs/<released preset>.yaml   the preset with SIZES (by family) overridden; debug presets unchanged,
                                     so are the stdit presets (no released folder; no command trains them)
    CogVideoX-5b/  CogVideoX-2b/  CogVideoX1.5-5B/       transformer/ (diffusers, from the tiny preset), vae/,
    Wan2.1-T2V-14B-Diffusers/  Wan2.1-T2V-1.3B-Diffusers/  text_encoder/, tokenizer/ (as released: separate)
    Wan2.2-T2V-A14B-Diffusers/       the same, with a second expert transformer_2/ and model_index.json's
                                     boundary_ratio (the preset's), as Wan-AI/Wan2.2-T2V-A14B-Diffusers
    t5/                              a tiny T5 with its tokenizer in one folder
    clips/ + clips.csv               three short videos and their captions

The tiny VAEs, T5/UMT5 encoders and videos are the ones tests/unit/test_prepare_data*.py and
tests/unit/test_text_encoder.py build (their constructors and constants reused); each transformer is diffusers'
class built from the config the toolkit would export for the tiny preset (models/<family>/released.py).
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import torch
import yaml

from tests.cli.doc_blocks import ROOT

SANDBOX_SP = 2                      # a preset's sequence parallelism here: the fewest ranks that split

# Sizes only. Videos 9 x 32 x 32; the tiny CogVideoX VAE downsamples 2 x 2 x 2, the tiny Wan VAE 4 x 8 x 8.
SIZES = {
    "cogvideox": {"model.num_layers": 2, "model.hidden_size": 64, "model.num_heads": 4, "model.head_dim": 16,
                  "model.time_embed_dim": 32, "model.in_channels": 4, "model.text_embed_dim": 32,
                  "model.max_text_len": 8, "model.vae_scale_spatial": 2, "model.vae_scale_temporal": 2,
                  "model.sample_height": 16, "model.sample_width": 16, "model.sample_frames": 9,
                  "data.num_frames": 9, "data.height": 32, "data.width": 32,
                  "data.buckets": [[9, 32, 32], [9, 32, 48], [5, 32, 32], [5, 48, 32]]},
    "wan": {"model.num_layers": 2, "model.hidden_size": 64, "model.num_heads": 4, "model.head_dim": 16,
            "model.ffn_hidden_size": 96, "model.time_embed_dim": 32, "model.in_channels": 4,
            "model.text_embed_dim": 32, "model.max_text_len": 8,
            "data.num_frames": 9, "data.height": 32, "data.width": 32,
            "data.buckets": [[9, 32, 32], [9, 32, 48], [9, 48, 32], [5, 32, 32]]},
}
STEPS = {"train.max_steps": 2}      # the run's length: a size too
RELEASES = {"CogVideoX-5b": "cogvideox-5b", "CogVideoX-2b": "cogvideox-2b", "CogVideoX1.5-5B": "cogvideox1.5-5b",
            "Wan2.1-T2V-14B-Diffusers": "wan2.1-t2v-14b", "Wan2.1-T2V-1.3B-Diffusers": "wan2.1-t2v-1.3b",
            "Wan2.2-T2V-A14B-Diffusers": "wan2.2-t2v-a14b"}
CAPTIONS = {"a.mkv": "a red square moving left", "b.mkv": "a square moving", "c.mp4": "red square moving left"}


def tiny_preset(path: Path) -> None:
    tree = yaml.safe_load(path.read_text())
    if tree["model"]["name"].startswith("debug") or tree["model"]["family"] not in SIZES:
        return
    for key, value in {**SIZES[tree["model"]["family"]], **STEPS}.items():
        section, name = key.split(".")
        tree.setdefault(section, {})[name] = value
    # `--num_gpus 8` runs on the fewest ranks that hold the layout here (doc_runs.processes): a preset's sp 8
    # (Wan 2.2) becomes SANDBOX_SP, sequence parallelism still
    if (tree.get("parallel") or {}).get("sp_size", 1) > SANDBOX_SP:
        tree["parallel"]["sp_size"] = SANDBOX_SP
    if tree["model"].get("patch_size_t"):
        # CogVideoX 1.5's rotary table is sample_height x sample_width latents at most ("slice" grid, max_size):
        # it must hold the largest bucket (48 px / 2 = 24 latents), as the release's 300 holds 1360 / 8.
        largest = max(max(h, w) for _, h, w in tree["data"]["buckets"]) // tree["model"]["vae_scale_spatial"]
        tree["model"]["sample_height"] = tree["model"]["sample_width"] = largest
    path.write_text(f"# {path.name} with sizes overridden for a CPU (tests/cli/doc_sandbox.py)\n"
                    + yaml.safe_dump(tree, sort_keys=False))


def copy_repository(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    for preset in (dest / "configs").glob("*.yaml"):
        tiny_preset(preset)


def write_text_encoder(folder: Path, tokenizer: Path, umt5: bool) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    from tests.helpers.text_encoder import VOCAB
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if umt5:
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tokenizer)
    torch.manual_seed(0)
    config, model = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    model(config(vocab_size=len(VOCAB), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                 decoder_start_token_id=0, pad_token_id=0)).save_pretrained(folder)


def write_vae(folder: Path, family: str) -> None:
    from diffusers import AutoencoderKLCogVideoX, AutoencoderKLWan

    from tests.helpers.prepare_data_wan import MEAN, STD
    torch.manual_seed(0)
    if family == "wan":
        AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                         temperal_downsample=[False, True, True], latents_mean=MEAN,
                         latents_std=STD).save_pretrained(folder)
    else:
        AutoencoderKLCogVideoX(down_block_types=("CogVideoXDownBlock3D",) * 2,
                               up_block_types=("CogVideoXUpBlock3D",) * 2, block_out_channels=(8, 16),
                               latent_channels=4, layers_per_block=1, norm_num_groups=4, temporal_compression_ratio=4,
                               sample_height=32, sample_width=32).save_pretrained(folder)


def write_transformer(folder: Path, preset: Path, seed: int = 0) -> None:
    import diffusers

    from models.registry import family
    from parallel.experiment.config import load_config
    cfg = load_config(str(preset), [])
    released = family(cfg.model).formats.released
    torch.manual_seed(seed)
    model = getattr(diffusers, released.class_name).from_config(released.config(cfg.model, cfg.data))
    with torch.no_grad():              # non-trivial norms and zero-initialised projections
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(folder)


def write_release(root: Path, name: str) -> None:
    preset = root / "configs" / f"{RELEASES[name]}.yaml"
    model = yaml.safe_load(preset.read_text())["model"]
    fam = model["family"]
    write_transformer(root / name / "transformer", preset)
    if "experts" in model:          # Wan 2.2 A14B: the low-noise expert and the boundary (tests/unit/test_wan22_released.py)
        write_transformer(root / name / "transformer_2", preset, seed=1)
        (root / name / "model_index.json").write_text(json.dumps(
            {"_class_name": "WanPipeline", "boundary_ratio": model["experts"]["boundary_ratio"]}))
    write_vae(root / name / "vae", fam)
    write_text_encoder(root / name / "text_encoder", root / name / "tokenizer", umt5=fam == "wan")


def write_clips(root: Path) -> None:
    from tests.helpers.prepare_data import squares, write_video
    (root / "clips").mkdir()
    for i, name in enumerate(CAPTIONS):
        write_video(root / "clips" / name, squares(11, 32, 48, i), "ffv1" if name.endswith(".mkv") else "libx264")
    (root / "clips.csv").write_text("video,caption\n" + "".join(f"{v},{c}\n" for v, c in CAPTIONS.items()))


def build(root: Path) -> Path:
    """The whole sandbox under root (a few seconds)."""
    copy_repository(root)
    for name in RELEASES:
        write_release(root, name)
    write_text_encoder(root / "t5", root / "t5", umt5=False)
    write_clips(root)
    return root
