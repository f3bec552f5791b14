"""The fixtures of tests/unit/test_ltx2_prepare.py: a tiny random LTX-2 diffusers release folder with what data
preparation reads (vae/, audio_vae/, text_encoder/, tokenizer/, connectors/), and clips with sound tracks written
with PyAV; `prepare_argv` (`python -m parallel.prepare_data`'s arguments on them) and `matrix_data` (the family
matrix's LTX-2 data: tests/helpers/family_matrix.py); `video_vae` (also tests/unit/test_ltx2_sampling.py's
--image; a test module imports no other test module)."""
import av
import numpy as np
import pytest
import torch

FPS, HEIGHT, WIDTH = 24, 64, 96
SETS = [f"data.height={HEIGHT}", f"data.width={WIDTH}"]     # debug-ltx2's 9 frames -> latents [8, 2, 2, 3], 9 audio
VOCAB = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, "a": 4, "red": 5, "square": 6, "moving": 7, "left": 8,
         "loud": 9, "beep": 10}
# name -> (frames, sound: (rate, channels, seconds) or None)
CLIPS = {"a.mkv": (12, (22050, 2, 0.5)), "b.mkv": (10, (16000, 1, 0.2)), "silent.mkv": (10, None)}
CAPTIONS = {"a.mkv": "a red square moving left", "b.mkv": "a loud beep", "silent.mkv": "a red square"}


def tone(rate: int, channels: int, seconds: float) -> np.ndarray:
    """[channels, n] in [-1, 1): 440 Hz at 0.5, then 1 kHz at 0.25, quantised to 16 bits."""
    t = np.arange(int(seconds * rate)) / rate
    wave = np.stack([0.5 * np.sin(2 * np.pi * 440 * t), 0.25 * np.sin(2 * np.pi * 1000 * t)][:channels])
    return np.round(wave * 32767) / 32768


def write_clip(path, frames: np.ndarray, sound) -> None:
    """ffv1 video (lossless RGB) at FPS and, with `sound` (rate, channels, seconds), a FLAC track of `tone`."""
    with av.open(str(path), "w") as container:
        video = container.add_stream("ffv1", rate=FPS)
        video.height, video.width, video.pix_fmt = frames.shape[1], frames.shape[2], "bgr0"
        audio = None
        if sound:
            rate, channels, seconds = sound
            audio = container.add_stream("flac", rate=rate)
            audio.layout, audio.format = ("stereo" if channels == 2 else "mono"), "s16"
            samples = (tone(*sound) * 32768).astype(np.int16)
            for start in range(0, samples.shape[1], 1024):
                chunk = samples[:, start:start + 1024]
                frame = av.AudioFrame.from_ndarray(chunk.T.reshape(1, -1).copy(), format="s16", layout=audio.layout.name)
                frame.sample_rate, frame.pts = rate, start
                container.mux(audio.encode(frame))
        for f in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(video.encode())
        if audio is not None:
            container.mux(audio.encode())


def write_clips(root):
    """The clips and captions.csv in `root`; {name: uint8 frames [T, H, W, 3]}."""
    rng, frames = np.random.default_rng(0), {}
    for name, (n, sound) in CLIPS.items():
        frames[name] = rng.integers(0, 256, (n, HEIGHT, WIDTH, 3), dtype=np.uint8)
        write_clip(root / name, frames[name], sound)
    (root / "captions.csv").write_text("video,caption\n" + "".join(f"{v},{c}\n" for v, c in CAPTIONS.items()))
    return frames


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """(folder with the clips and captions.csv, {name: uint8 frames [T, H, W, 3]})."""
    root = tmp_path_factory.mktemp("clips")
    return root, write_clips(root)


def _tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(path)


def _gemma():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                            sliding_window=4, pad_token_id=0)
    vision = SiglipVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                image_size=8, patch_size=4)
    return Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=1, image_token_index=15,
        boi_token_index=13, eoi_token_index=14)).eval()


def _statistics(vae, channels: int) -> None:
    """Random per-channel latents_mean / latents_std buffers (the release's are not the identity)."""
    g = torch.Generator().manual_seed(3)
    vae.latents_mean.copy_(torch.randn(channels, generator=g))
    vae.latents_std.copy_(torch.rand(channels, generator=g) + 0.5)


def video_vae():
    """AutoencoderKLLTX2Video of debug-ltx2's factors (32 x spatial, 8 x temporal, 8 channels), scaling_factor 0.5,
    random latents_mean / latents_std buffers."""
    from diffusers import AutoencoderKLLTX2Video

    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8), decoder_block_out_channels=(8,),
        layers_per_block=(1, 1, 1, 1), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True, True, True),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False),
        downsample_type=("spatiotemporal",) * 3, upsample_residual=(False,), upsample_factor=(1,),
        timestep_conditioning=False, scaling_factor=0.5)
    _statistics(vae, 8)
    return vae.eval()


def write_release(root):
    """A release folder at `root`: vae/ (32 x spatial, 8 x temporal, 8 channels, scaling_factor 0.5), audio_vae/ (stereo
    16-bin mel -> 2 channels x 4 bins: 8 packed, 4 x in time), text_encoder/ (Gemma-3: 1 layer of 16 + its
    embeddings), tokenizer/, connectors/ (LTX-2.0's: both streams 16 wide, 4 registers); every normalisation
    buffer random."""
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    vae = video_vae()
    audio_vae = AutoencoderKLLTX2Audio(base_channels=8, ch_mult=(1, 2, 4), num_res_blocks=1, resolution=32,
                                       latent_channels=2, mel_bins=16)
    _statistics(audio_vae, 8)
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=2, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=4, video_connector_num_layers=1, video_connector_num_learnable_registers=4,
        audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=4, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=4, connector_rope_base_seq_len=32)
    for name, module in (("vae", vae), ("audio_vae", audio_vae), ("connectors", connectors),
                         ("text_encoder", _gemma())):
        module.save_pretrained(root / name)
    _tokenizer(root / "tokenizer")
    return root


@pytest.fixture(scope="module")
def ltx2_release(tmp_path_factory):
    """`write_release`'s folder."""
    return write_release(tmp_path_factory.mktemp("ltx2_release"))


def prepare_argv(clips_root, release, out) -> list[str]:
    """`python -m parallel.prepare_data`'s arguments: debug-ltx2 at the release's sizes (SETS) on the clips and
    their captions.csv, with the release's VAEs and caption encoder."""
    return ["--config", "debug-ltx2", *(a for s in SETS for a in ("--set", s)), "--videos", str(clips_root),
            "--captions", str(clips_root / "captions.csv"), "--vae", str(release / "vae"), "--t5", str(release),
            "--out", str(out)]


def matrix_data(tmp_path):
    """The family matrix's LTX-2 data (tests/helpers/family_matrix.py `Prepared`): the clips and the release
    written under tmp_path; prepare_data's arguments writing tmp_path/data, the overrides that train from it (SETS,
    data.kind=directory), two prepared captions as the prompts (a.mkv's, b.mkv's: both streams' states) and
    uncond.safetensors as the negative prompt; the silent clip skipped."""
    from tests.helpers.family_matrix import Prepared

    root, release, out = tmp_path / "clips", tmp_path / "release", tmp_path / "data"
    root.mkdir()
    write_clips(root)
    write_release(release)
    return Prepared(prepare_argv(root, release, out), [*SETS, "data.kind=directory", f"data.path={out}"],
                    [out / "text" / f"{v}.safetensors" for v in ("a.mkv", "b.mkv")], out / "uncond.safetensors",
                    "rank 0 of 1: 2 prepared, 1 skipped")
