"""`python -m models`' summary: parameter counts on the meta device (split from tests/cli/test_train_cli.py)."""
from models.__main__ import summary
from parallel.experiment.config import load_config


def test_model_summary_counts_published_sizes():
    """Meta-device counts equal the layer arithmetic (and land on CogVideoX-2B's 1.69B)."""
    text = summary(load_config("cogvideox-2b"))
    h, f, d, p, c, e = 1920, 7680, 512, 2, 16, 4096
    block = (6 * h * d + 6 * h) * 2 + 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 3 * 64 + (h * f + f) + (f * h + h)
    embed = (c * p * p * h + h) + (e * h + h) + (h * d + d) + (d * d + d)
    final = 2 * h + (2 * h * d + 2 * h) + 2 * h + (h * c * p * p + c * p * p)
    assert f"parameters: {embed + 30 * block + final}" in text
    assert 1.68e9 < embed + 30 * block + final < 1.70e9


def test_wan22_summary_gives_each_experts_parameters():
    """A14B with both experts: two experts, each the parameters of the one-expert model (its release's 14B
    transformer), together the model's."""
    import re
    for preset in ("wan2.2-t2v-a14b", "debug-wan22"):
        text = summary(load_config(preset))
        one = int(re.search(r"parameters: (\d+)", summary(load_config(preset, ["model.experts.train=low_noise"])))[1])
        each = [int(n.replace(",", "")) for n in re.findall(r"experts\.\d ([\d,]+)", text)]
        assert "experts: 2, chosen by timestep" in text and each == [one, one], (preset, text)
        assert f"parameters: {2 * one}" in text
        assert preset != "wan2.2-t2v-a14b" or "experts.0 14,288,491,584, experts.1 14,288,491,584" in text
    assert "experts:" not in summary(load_config("debug-wan22", ["model.experts.train=high_noise"]))


def test_the_timesteps_line_says_what_training_draws():
    """`timesteps: one per token` where training draws a timestep per latent position ([B, T, H, W]: Wan 2.2 TI2V,
    model.expand_timesteps), no line where it draws one per sample ([B]: Wan 2.1, Wan 2.2 A14B)."""
    from parallel.distributed.topology import ParallelContext
    from parallel.train.run import training_batches
    for preset in ("debug-wan22-ti2v", "debug-wan", "debug-wan22"):
        cfg = load_config(preset)
        (x_t, t, *_), _ = next(training_batches(cfg, ParallelContext.single()))
        per_token = t.shape == (x_t.shape[0], *x_t.shape[2:])
        assert per_token == (preset == "debug-wan22-ti2v") and (t.dim() == 1) != per_token, (preset, t.shape)
        lines = summary(cfg).splitlines()
        assert (lines[-1] == "timesteps: one per token") == per_token, (preset, lines[-1])
        assert per_token or not any(line.startswith("timesteps:") for line in lines), preset
    assert summary(load_config("wan2.2-ti2v-5b")).splitlines()[-1] == "timesteps: one per token"
