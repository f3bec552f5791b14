"""LTX-2 sampling against diffusers' LTX2Pipeline, in one process: `python -m parallel.sample` (its main) on the tiny
LTX-2.3 release, from the noise and caption states the pipeline sees (its connectors' outputs for Gemma features),
gives the pipeline's video and audio latents (output_type="latent"; its release scheduler, classifier-free guidance
in x0 for both streams, each stream's own scale, the guidance rescale), and LTX2ImageToVideoPipeline's from a
picture's latent, and from a picture encoded with --vae as that pipeline encodes it; what a two-stream sample needs
is refused by name before any model loads. At tp 2 x sp 2:
tests/distributed/test_ltx2_layouts.py."""
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.sample import main
from tests.helpers.ltx2 import overrides, pipeline, released  # noqa: F401  (fixture)

B, L, GEMMA = 2, 8, 32          # prompts, caption tokens, Gemma features (2 layers x 16)


def _files(tmp_path, pipe):
    """Prompt and negative files of the connector's (video, audio) caption states, the noise file; the Gemma
    features and unpacked noise the pipeline takes."""
    g = torch.Generator().manual_seed(5)
    gemma, negative = torch.randn(B, L, GEMMA, generator=g), torch.randn(1, L, GEMMA, generator=g).expand(B, -1, -1)
    video, audio = torch.randn(B, 8, 2, 4, 6, generator=g), torch.randn(B, 2, 9, 4, generator=g)   # [B, C, L, mel]
    mask = torch.ones(2 * B, L, dtype=torch.long)
    with torch.no_grad():
        text, atext, _ = pipe.connectors(torch.cat([negative, gemma]), mask, padding_side="left")
    save_file({"text": text[B:], "audio_text": atext[B:]}, str(tmp_path / "prompt.safetensors"))
    save_file({"text": text[:B], "audio_text": atext[:B]}, str(tmp_path / "negative.safetensors"))
    save_file({"latents": video, "audio": audio.transpose(1, 2).flatten(2)}, str(tmp_path / "noise.safetensors"))
    return gemma, negative.contiguous(), video, audio


def test_sample_command_equals_the_pipeline(released, tmp_path):
    folder, model = released["ltx2.3"]
    pipe = pipeline(model)
    gemma, negative, video, audio = _files(tmp_path, pipe)
    args = ["--config", "debug-ltx2", *(f"--set={o}" for o in overrides(folder, "ltx2.3")), "--prompt-embeds",
            str(tmp_path / "prompt.safetensors"), "--noise", str(tmp_path / "noise.safetensors"), "--steps", "3"]
    mask = torch.ones(B, L, dtype=torch.long)
    # (video guidance, audio guidance, rescale): no guidance; the pipeline's audio_guidance_scale 7 (--guidance-2)
    # beside guidance 3, and its guidance_rescale 0.7 (the command's default)
    for guidance, audio_guidance, rescale in ((1.0, 1.0, None), (3.0, 7.0, None)):
        out = tmp_path / f"g{guidance}-{audio_guidance}-{rescale}.safetensors"
        negative_args = ["--negative-embeds", str(tmp_path / "negative.safetensors")] if guidance > 1 else []
        knobs = ["--guidance-2", str(audio_guidance)] + (["--guidance-rescale", str(rescale)] if rescale is not None
                                                         else [])
        assert main([*args, *negative_args, "--guidance", str(guidance), *knobs, "--out", str(out)]) == 0
        got = load_file(str(out))
        r = 0.7 if rescale is None else rescale
        want_video, want_audio = pipe(
            prompt_embeds=gemma, prompt_attention_mask=mask, negative_prompt_embeds=negative,
            negative_prompt_attention_mask=mask, latents=video, audio_latents=audio, num_frames=9, frame_rate=24.0,
            num_inference_steps=3, guidance_scale=guidance, audio_guidance_scale=audio_guidance, stg_scale=0.0,
            audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=r,
            audio_guidance_rescale=r, output_type="latent", return_dict=False)
        case = f"guidance {guidance}, audio guidance {audio_guidance}, rescale {r}"
        torch.testing.assert_close(got["latents"], want_video, msg=lambda m: f"video at {case}: {m}")
        torch.testing.assert_close(got["audio"], want_audio.transpose(1, 2).flatten(2),
                                   msg=lambda m: f"audio at {case}: {m}")


def test_what_two_streams_need_is_refused_by_name(released, tmp_path, capsys):
    """A prompt file without the audio caption, guidance (the audio stream's alone) without negative captions, noise
    without the audio's, a decoder, one step (the release's schedule is 0 / 0 there) and a guidance rescale out of
    [0, 1]: each named, before any model loads; a model of one stream refuses a guidance rescale."""
    save_file({"text": torch.zeros(1, L, 16)}, str(tmp_path / "p.safetensors"))
    save_file({"latents": torch.zeros(1, 8, 2, 4, 6)}, str(tmp_path / "n.safetensors"))
    assert main(["--config", "debug-ltx2", "--set", f"model.init_from={released['ltx2'][0]}", "--prompt-embeds",
                 str(tmp_path / "p.safetensors"), "--noise", str(tmp_path / "n.safetensors"), "--guidance-2", "3",
                 "--vae", "vae/", "--steps", "1", "--guidance-rescale", "2", "--out", "o"]) == 1
    err = capsys.readouterr().err
    for problem in [f'{tmp_path / "p.safetensors"}: model debug-ltx2 takes a second caption: "audio_text" [L, D] = '
                    f'[8, 16] beside "text" (found none;',
                    'guidance needs the unconditional captions of both streams of model debug-ltx2: give '
                    '--negative-embeds ("text" and "audio_text")',
                    f'--noise {tmp_path / "n.safetensors"}: model debug-ltx2 starts its second stream from "audio" [B, '
                    f'A, C] = [1, 9, 8] beside "latents" (found none;',
                    "--vae: decoding model debug-ltx2's latents is not built (docs/models.md); leave it out",
                    "--steps=1: model debug-ltx2's sampler takes 2 or more",
                    "--guidance-rescale 2.0: give a number in [0, 1] (0: off)"]:
        assert problem in err, err
    assert main(["--config", "debug", "--prompt-embeds", str(tmp_path / "p.safetensors"), "--guidance-rescale", "0.7",
                 "--out", "o"]) == 1
    assert ("--guidance-rescale 0.7: model debug's sampler has no guidance rescale (LTX-2's has); leave it out"
            in capsys.readouterr().err)


@pytest.mark.parametrize("steps", [2, 4, 30])
def test_the_schedule_is_the_release_scheduler(steps):
    """ltx2_sigmas: FlowMatchEulerDiscreteScheduler of the release's config, as LTX2Pipeline sets it (calculate_shift
    of the video tokens), bit for bit."""
    import numpy as np
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    from models.ltx2.sampling import ltx2_sigmas
    from tests.helpers.ltx2 import release_scheduler

    scheduler = release_scheduler()
    for tokens in (48, 6144):
        scheduler.set_timesteps(steps, sigmas=np.linspace(1.0, 1 / steps, steps),
                                mu=calculate_shift(tokens, 1024, 4096, 0.95, 2.05))
        assert torch.equal(ltx2_sigmas(steps, tokens), scheduler.sigmas)


def test_image_to_video_equals_the_pipeline(released, tmp_path, capsys):
    """model.image_condition: --image-latents (one picture latent a row) gives LTX2ImageToVideoPipeline's video and
    audio latents, the picture in frame 0 of the pipeline's latents (its conditioning mask and per-token timestep,
    frames 1.. stepped), with guidance (both calls see the picture); the picture latent is the one the pipeline's
    prepare_latents encodes (its video processor, the VAE's mode, normalised with the buffers), and --image with
    --vae gives the same run. --image without --vae is refused; a text-to-video model refuses --image-latents."""
    from diffusers import LTX2ImageToVideoPipeline
    from diffusers.pipelines.ltx2.pipeline_ltx2_image2video import retrieve_latents
    from PIL import Image

    from tests.helpers.ltx2_release import video_vae

    folder, model = released["ltx2.3"]
    pipe = pipeline(model)
    i2v = LTX2ImageToVideoPipeline(**{k: v for k, v in pipe.components.items() if v is not None or k in (
        "text_encoder", "tokenizer", "vocoder")})
    gemma, negative, video, audio = _files(tmp_path, pipe)
    vae = video_vae()                                    # debug-ltx2's factors, random normalisation buffers
    vae.save_pretrained(tmp_path / "vae")
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (100, 150, 3), dtype=np.uint8))
    picture.save(tmp_path / "picture.png")
    with torch.no_grad():
        x = i2v.video_processor.preprocess(picture, height=128, width=192).unsqueeze(2)
        image = i2v._normalize_latents(retrieve_latents(vae.encode(x), None, "argmax"), vae.latents_mean,
                                       vae.latents_std).expand(B, -1, -1, -1, -1).contiguous()
    save_file({"image": image}, str(tmp_path / "image.safetensors"))
    args = ["--config", "debug-ltx2", *(f"--set={o}" for o in overrides(folder, "ltx2.3")),
            "--set=model.image_condition=true", "--prompt-embeds", str(tmp_path / "prompt.safetensors"), "--noise",
            str(tmp_path / "noise.safetensors"), "--negative-embeds", str(tmp_path / "negative.safetensors"),
            "--steps", "3", "--guidance", "3", "--out"]
    assert main([*args, str(tmp_path / "i2v.safetensors"), "--image-latents", str(tmp_path / "image.safetensors")]) == 0
    got = load_file(str(tmp_path / "i2v.safetensors"))
    mask = torch.ones(B, L, dtype=torch.long)
    want_video, want_audio = i2v(
        image=None, prompt_embeds=gemma, prompt_attention_mask=mask, negative_prompt_embeds=negative,
        negative_prompt_attention_mask=mask, latents=torch.cat([image, video[:, :, 1:]], dim=2), audio_latents=audio,
        num_frames=9, frame_rate=24.0, num_inference_steps=3, guidance_scale=3.0, audio_guidance_scale=3.0,
        stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.7,
        audio_guidance_rescale=0.7, output_type="latent", return_dict=False)
    assert torch.equal(got["latents"][:, :, :1], image)
    torch.testing.assert_close(got["latents"], want_video, msg=lambda m: f"image-to-video video: {m}")
    torch.testing.assert_close(got["audio"], want_audio.transpose(1, 2).flatten(2),
                               msg=lambda m: f"image-to-video audio: {m}")
    picture_args = ["--image", str(tmp_path / "picture.png")]
    assert main([*args, str(tmp_path / "picture.safetensors"), *picture_args, "--vae", str(tmp_path / "vae")]) == 0
    encoded = load_file(str(tmp_path / "picture.safetensors"))
    for key in ("latents", "audio"):
        torch.testing.assert_close(encoded[key], got[key], msg=lambda m: f"--image {key}: {m}")
    assert main([*args, str(tmp_path / "picture.safetensors"), *picture_args]) == 1
    assert "--image needs the VAE that encodes it: --vae <the vae/ folder of an LTX-2" in capsys.readouterr().err
    text_to_video = [a for a in args if a != "--set=model.image_condition=true"]
    assert main([*text_to_video, str(tmp_path / "t2v.safetensors"), "--image-latents",
                 str(tmp_path / "image.safetensors")]) == 1
    assert "--image-latents: model debug-ltx2 is text-to-video" in capsys.readouterr().err
