"""Wan 2.2 A14B release folders (models/wan/released.py, parallel/weights/diffusers.py): a tiny random release of
two diffusers WanTransformer3DModel (transformer/ sharded, transformer_2/ one file, model_index.json's
boundary_ratio) read by model.init_from; each expert predicts what its diffusers transformer predicts, a mixed
batch through each sample's own; one expert alone reads its subfolder; wrong folders are refused by name.
Export at tp 2 x pp 2 -> from_pretrained: tests/distributed/test_wan22_layouts.py."""
import json
import shutil

import pytest
import torch

from parallel.experiment.config import load_config
from parallel.distributed.topology import ParallelContext
from parallel.weights.diffusers import check_released
from tests.released_utils import nonzero_adapters, read_release
from tests.helpers.wan import HEIGHT, WIDTH, diffusers_forward
from tests.helpers.wan22_released import BOUNDARY, MIXED, inputs, overrides, write_release


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return write_release(tmp_path_factory.mktemp("wan22"))


def _loaded(folder, *extra):
    _, ours, read = read_release("debug-wan22", overrides(folder, *extra), folder)
    return ours, read


def test_each_expert_predicts_what_its_diffusers_transformer_predicts(release):
    folder, (high, low) = release
    ours, read = _loaded(folder)
    assert read == sum(p.numel() for m in (high, low) for p in m.parameters())
    with torch.no_grad():
        for ts, want in [([999.0, 875.0], high), ([874.0, 3.0], low)]:
            torch.testing.assert_close(ours.predict(inputs(ts)), diffusers_forward(want, *inputs(ts)))
        mixed = ours.predict(inputs([950.0, 3.0]))          # row 0 high noise, row 1 low noise
    torch.testing.assert_close(mixed[:1], diffusers_forward(high, *inputs([950.0, 3.0]))[:1])
    torch.testing.assert_close(mixed[1:], diffusers_forward(low, *inputs([950.0, 3.0]))[1:])


@pytest.mark.parametrize("train, index", [("low_noise", 1), ("high_noise", 0)])
def test_one_expert_reads_its_own_subfolder(release, train, index):
    folder, models = release
    ours, _ = _loaded(folder, f"model.experts.train={train}")
    with torch.no_grad():
        ts = [3.0, 811.0]
        torch.testing.assert_close(ours.predict(inputs(ts)), diffusers_forward(models[index], *inputs(ts)))


def test_wrong_folders_are_refused_by_name(release, tmp_path):
    folder, _ = release
    cfg = load_config("debug-wan22", overrides(folder))
    what = "model.experts needs a Wan 2.2 A14B release folder"
    # A single transformer folder (Wan 2.1's, or one expert's).
    problems = check_released(cfg.model, folder / "transformer")
    assert len(problems) == 1 and problems[0].startswith(f"model.init_from={folder / 'transformer'}: a single "
                                                         "transformer folder") and what in problems[0]
    # A Wan 2.1 pipeline: transformer/ only, no boundary_ratio.
    wan21 = tmp_path / "wan21"
    shutil.copytree(folder / "transformer", wan21 / "transformer")
    (wan21 / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    problems = check_released(cfg.model, wan21)
    assert problems == [f"model.init_from={wan21}: no transformer_2/config.json; {what} (model_index.json, "
                        "transformer/ and transformer_2/, as Wan-AI/Wan2.2-T2V-A14B-Diffusers)",
                        f"{wan21 / 'model_index.json'}: no boundary_ratio (a Wan 2.1 pipeline); {what} "
                        "(model_index.json, transformer/ and transformer_2/, as Wan-AI/Wan2.2-T2V-A14B-Diffusers)"]
    with pytest.raises(ValueError, match="no transformer_2/config.json"):
        _loaded(wan21)
    # Another boundary: the --set it names makes the folder acceptable.
    i2v = write_release(tmp_path / "i2v", boundary=0.9)[0]
    problems = check_released(cfg.model, i2v)
    assert problems == [f"{i2v / 'model_index.json'}: boundary_ratio 0.9 != model.experts.boundary_ratio 0.875; set "
                        "--set model.experts.boundary_ratio=0.9 or use the matching preset"]
    fixed = load_config("debug-wan22", overrides(i2v, "model.experts.boundary_ratio=0.9"))
    assert check_released(fixed.model, i2v) == []


def test_sampling_switches_experts_and_guidance_as_the_pipeline(release):
    """WanPipeline(transformer, transformer_2, boundary_ratio) with guidance_scale and guidance_scale_2, 6 UniPC
    steps (flow shift 3): its latents, from the same noise, equal the toolkit's model read from the release and
    models/sampling.py's sampler with the experts' guidance (models/wan/experts.py `guidance`)."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from models.diffusion import Objective
    from models.sampling import sample
    from models.wan.experts import expert_of, guidance
    folder, (high, low) = release
    cfg = load_config("debug-wan22", overrides(folder))
    ours, _ = _loaded(folder)
    g = torch.Generator().manual_seed(11)
    noise, text, negative = (torch.randn(1, 4, 3, HEIGHT, WIDTH, generator=g), torch.randn(1, 8, 32, generator=g),
                             torch.randn(1, 8, 32, generator=g))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=cfg.model.schedule.shift)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=high, transformer_2=low,
                       scheduler=scheduler, boundary_ratio=BOUNDARY)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        want = pipe(prompt_embeds=text, negative_prompt_embeds=negative, latents=noise.clone(), height=HEIGHT * 8,
                    width=WIDTH * 8, num_frames=9, num_inference_steps=6, guidance_scale=2.0, guidance_scale_2=3.5,
                    output_type="latent").frames
    seen = []

    def predict(x, t, conditional):
        seen.append(t)
        with torch.no_grad():
            return ours.predict((x, t, text if conditional else negative))
    # val.guidance_scale and val.guidance_scale_2, as validation and python -m parallel.sample read them
    from models.registry import family
    from models.sampling import family_guidance
    cfg = load_config("debug-wan22", overrides(folder, "val.guidance_scale=2.0", "val.guidance_scale_2=3.5"))
    scales = family_guidance(family(cfg.model), cfg.model, cfg.val.guidance_scale, cfg.val.guidance_scale_2)
    assert [scales(t) for t in (999, 875, 874.9, 0)] == [2.0, 2.0, 3.5, 3.5]
    got = sample(predict, noise, Objective.of(cfg.model), 6, "unipc", guidance(cfg.model, 2.0, 3.5))
    torch.testing.assert_close(got, want)
    assert [float(t[0]) for t in seen[::2]] == pipe.scheduler.timesteps.tolist()
    assert expert_of(cfg.model, torch.stack(seen[::2])[:, 0]).unique().tolist() == [0, 1]      # the switch is in it
    # python -m parallel.sample's --guidance-2, over val.guidance_scale_2: the same latents.
    from parallel.sample import guidance_of, parse_args
    args = parse_args(["--config", "debug-wan22", "--out", "x.safetensors", "--guidance", "2", "--guidance-2", "3.5"])
    flagged = guidance_of(args, load_config("debug-wan22", overrides(folder, "val.guidance_scale_2=1.0")), 2.0)
    torch.testing.assert_close(sample(predict, noise, Objective.of(cfg.model), 6, "unipc", flagged), want)
    # With one guidance throughout, another result: guidance_scale_2 is used.
    assert not torch.allclose(sample(predict, noise, Objective.of(cfg.model), 6, "unipc", 2.0), want)


def test_guidance_scale_2_is_refused_for_one_transformer():
    from models.registry import family
    from models.sampling import family_guidance
    fix = r"set val.guidance_scale only \(--set val.guidance_scale_2=null\)"
    for preset, words in [("debug", "model.family=cogvideox has one transformer"),
                          ("debug-wan", r"model debug-wan has one transformer \(two: model.experts.train both\)")]:
        cfg = load_config(preset, ["val.guidance_scale_2=3.5"])
        with pytest.raises(ValueError, match=rf"val.guidance_scale_2=3.5: {words}; {fix}"):
            family_guidance(family(cfg.model), cfg.model, 2.0, 3.5)
        assert family_guidance(family(cfg.model), cfg.model, 2.0, None) == 2.0
    # python -m parallel.sample --guidance-2 on one transformer: refused naming the flag, before a model loads.
    from parallel.sample import check_args, parse_args
    from parallel.check import check
    args = parse_args(["--config", "debug-wan", "--out", "x.safetensors", "--prompt-embeds", "p.safetensors",
                       "--guidance-2", "3.5"])
    cfg = load_config("debug-wan", ["data.text_encoder=t5"])
    problems = check_args(args, cfg, check(cfg)[0])
    assert any(p.startswith("--guidance-2 3.5: model debug-wan has one transformer") for p in problems), problems


def test_the_release_folders_scheduler_is_checked(release, tmp_path):
    """model.init_from a whole release folder: its own scheduler/scheduler_config.json is checked (flow sigmas
    need model.objective flow_matching), as a transformer folder's sibling one is for Wan 2.1."""
    from diffusers import UniPCMultistepScheduler

    from parallel.weights.scheduler import check_scheduler
    folder = tmp_path / "release"
    shutil.copytree(release[0], folder)
    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0).save_pretrained(
        folder / "scheduler")
    assert check_scheduler(load_config("debug-wan22", overrides(folder)).model, folder) == []
    problems = check_scheduler(load_config("debug-wan22", overrides(folder, "model.objective=v_prediction")).model,
                               folder)
    assert len(problems) == 1 and problems[0].startswith(str(folder / "scheduler" / "scheduler_config.json"))


def test_verify_routes_each_row_to_its_transformer(release, capsys):
    """The ReleasedFormat's reference on a release folder: each row by its expert; python -m parallel.verify on
    debug-wan22 (both experts) passes on the release in one process."""
    from models.wan.released import DIFFUSERS
    from parallel import verify
    folder, (high, low) = release
    want = torch.cat([diffusers_forward(high, *inputs(MIXED))[:1], diffusers_forward(low, *inputs(MIXED))[1:]])
    torch.testing.assert_close(DIFFUSERS.reference(str(folder), inputs(MIXED)), want)
    assert verify.main(["--config", "debug-wan22", *(f"--set={o}" for o in overrides(folder)), "--batch", "4"]) == 0
    assert "equal at --tolerance" in capsys.readouterr().out


def test_both_experts_adapters_load_into_wanpipelines_two_transformers(release, tmp_path):
    """model.lora with both experts: each expert's adapters (B made non-zero) written as --format diffusers-lora
    writes them (parallel/weights/lora_export.py: transformer/ and transformer_2/ files) load into WanPipeline's
    transformer and, with load_into_transformer_2=True, transformer_2 (peft); each then predicts what the
    toolkit's expert with its adapters predicts (fp32)."""
    import copy

    from diffusers import WanPipeline
    from safetensors.torch import load_file

    from parallel.model.lora import LORA_WEIGHTS_NAME, apply_lora
    from parallel.weights.lora_export import lora_tensors, write_lora
    folder, models = release
    cfg = load_config("debug-wan22", overrides(folder, "model.lora.rank=4", "model.lora.alpha=8"))
    ours, _ = _loaded(folder)
    apply_lora(ours, cfg.model, cfg.train.seed)
    nonzero_adapters(ours)
    written = write_lora(lora_tensors(ours, ParallelContext.single(), cfg.model), tmp_path, cfg.model)
    assert written == [tmp_path / sub / LORA_WEIGHTS_NAME for sub in ("transformer", "transformer_2")]
    files = [load_file(str(path)) for path in written]
    assert files[0].keys() == files[1].keys() and len(files[0]) == 2 * 2 * 2 * 4     # A, B; 2 blocks; attn1, 2; q k v out
    assert all(k.startswith("transformer.blocks.") for k in files[0])
    assert not any(torch.equal(files[0][k], files[1][k]) for k in files[0])           # each expert's own
    high, low = (copy.deepcopy(m) for m in models)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=high, transformer_2=low,
                       scheduler=None, boundary_ratio=BOUNDARY)
    pipe.load_lora_weights(str(tmp_path / "transformer"))
    pipe.load_lora_weights(str(tmp_path / "transformer_2"), load_into_transformer_2=True)
    with torch.no_grad():
        for ts, plain, adapted in [([999.0, 875.0], models[0], high), ([874.0, 3.0], models[1], low)]:
            want = diffusers_forward(adapted, *inputs(ts))
            assert not torch.allclose(want, diffusers_forward(plain, *inputs(ts)), atol=1e-3)   # the adapters act
            torch.testing.assert_close(ours.predict(inputs(ts)), want)
