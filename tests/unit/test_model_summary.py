"""`python -m models`' summary: parameter counts on the meta device (split from tests/cli/test_train_cli.py)."""
from models.__main__ import summary
from parallel.config import load_config


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
