"""Wan 2.2 A14B options of the Wan family (models/wan/experts.py): the expert chosen by each timestep, the
one-expert band mode, each sample through its own expert only, and bad settings refused by key."""
import pytest
import torch

from models.diffusion import Objective
from parallel.experiment.config import ConfigError, load_config


def _cfg(*extra):
    return load_config("debug-wan22", list(extra))


def test_the_boundary_splits_model_timesteps_as_wanpipeline():
    from models.wan.experts import expert_of
    cfg = _cfg()
    # WanPipeline: t >= boundary_ratio * num_train_timesteps -> transformer (expert 0), else transformer_2.
    t = torch.tensor([999.0, 875.0, 874.999, 0.0])
    assert expert_of(cfg.model, t).tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("train", ["high_noise", "low_noise"])
def test_one_expert_trains_in_its_band_with_plain_wan_weights(train):
    from parallel.model.build import build_model
    from parallel.distributed.topology import ParallelContext
    from parallel.train.run import training_batches
    from models.wan.experts import expert_of
    cfg = _cfg(f"model.experts.train={train}")
    model = build_model(cfg, {}, ParallelContext.single())
    names = [n for n, _ in model.named_parameters()]
    assert "blocks.0.attn1.to_qkv.weight" in names and not any(".experts." in n for n in names)
    batches = training_batches(cfg, ParallelContext.single())
    ts = torch.cat([next(batches)[0][1] for _ in range(20)])
    assert (expert_of(cfg.model, ts) == ["high_noise", "low_noise"].index(train)).all()
    # The model timestep the band starts at: shifted integer timesteps around the boundary.
    shifted = Objective.of(cfg.model).model_timesteps(torch.arange(1000))
    assert len(ts.unique()) > 10 and ((shifted >= 875).sum() < 1000)


def test_each_sample_runs_through_its_own_expert_only():
    from parallel.model.build import build_model
    from parallel.distributed.topology import ParallelContext
    cfg = _cfg()
    model = build_model(cfg, {}, ParallelContext.single())
    g = torch.Generator().manual_seed(0)
    lat, text = torch.randn(2, 4, 3, 8, 8, generator=g), torch.randn(2, 8, 32, generator=g)
    t = torch.tensor([950.0, 100.0])

    def run(*rows):
        h = model.embed((lat[list(rows)], t[list(rows)], text[list(rows)]))
        for block in model.blocks:
            h = block(h)
        return model.final(h)

    both = run(0, 1)
    torch.testing.assert_close(both, torch.cat([run(0), run(1)]))
    model.zero_grad()
    run(0).square().mean().backward()                       # high noise only: the low-noise expert idles
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if ".experts.0." in n
               and "norm" not in n)
    assert all(g is not None and not g.any() for n, g in grads.items() if ".experts.1." in n)


@pytest.mark.parametrize("setting, words", [("model.experts.boundary_ratio=0.8755", "whole timestep"),
                                            ("model.experts.boundary_ratio=1.0", "model.experts.boundary_ratio"),
                                            ("model.experts.train=middle", "model.experts.train"),
                                            ("model.lora.init_from=a.safetensors", r"model.lora.init_from=a.safetensors with "
                                             r"model.experts.train=both: .* \(--set model.lora.init_from=null\)")])
def test_bad_expert_settings_are_refused_by_key(setting, words):
    with pytest.raises(ConfigError, match=words):
        _cfg(setting, *(["model.lora.rank=4"] if "lora" in setting else []))


@pytest.mark.parametrize("granularity", ["attention", "mlp", "block"])
def test_selective_recompute_wraps_both_experts(granularity):
    """train.recompute on a two-expert model: each expert's part is checkpointed; the gradients are unchanged."""
    from parallel.model.build import build_model
    from parallel.distributed.seed import seed_all
    from parallel.distributed.topology import ParallelContext
    from parallel.model.recompute import layers_of
    g = torch.Generator().manual_seed(0)
    lat, text = torch.randn(2, 4, 3, 8, 8, generator=g), torch.randn(2, 8, 32, generator=g)
    grads = []
    for extra in ([], [f"train.recompute.granularity={granularity}"]):
        cfg = _cfg(*extra)
        seed_all(cfg.train.seed)
        model = build_model(cfg, {}, ParallelContext.single())
        h = model.embed((lat, torch.tensor([950.0, 100.0]), text))
        for block in model.blocks:
            h = block(h)
        model.final(h).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert [i for i, _ in layers_of(model, cfg)] == [0, 0, 1, 1, 2, 2, 3, 3]     # each expert's block i
    owner, attribute = {"attention": (lambda b: b.attn1.core, "forward"), "mlp": (lambda b: b, "ffn"),
                        "block": (lambda b: b, "forward")}[granularity]
    assert all(attribute in vars(owner(b)) for b in model.blocks[0].experts)      # replaced on the instance
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=lambda m: f"{name}: {m}")


def test_lora_builds_on_one_expert_and_on_both():
    """LoRA on one expert (the band mode): the plain Wan model's adapters; on both: each expert's own adapters
    (drawn from their canonical names, so they differ), in that expert's optimizer groups."""
    from parallel.model.build import build_model
    from parallel.distributed.topology import ParallelContext
    from parallel.train.optim import param_groups
    cfg = _cfg("model.lora.rank=4", "model.experts.train=low_noise")
    model = build_model(cfg, {}, ParallelContext.single())
    assert any("lora_A" in n for n, p in model.named_parameters() if p.requires_grad)
    model = build_model(_cfg("model.lora.rank=4"), {}, ParallelContext.single())
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(n.rsplit(".", 1)[1] in ("lora_A", "lora_B") for n in trained)
    mine = [{n for n in trained if f".experts.{e}." in n} for e in (0, 1)]
    assert len(mine[0]) == len(mine[1]) == len(trained) / 2
    a = [n for n in mine[0] if n.endswith("lora_A")]
    assert not any(torch.equal(trained[n], trained[n.replace(".experts.0.", ".experts.1.")]) for n in a)
    groups = param_groups(model, 0.1)
    assert [g.get("expert") for g in groups] == [0, 1]
    for g in groups:
        assert {id(p) for p in g["params"]} == {id(trained[n]) for n in mine[g["expert"]]}


@pytest.mark.parametrize("stage, train, refused", [(3, "both", True), (2, "both", True), (3, "high_noise", False),
                                                   (1, "both", False)])
def test_zero2_and_3_with_both_experts_are_refused_by_name(stage, train, refused):
    """Both experts at ZeRO-2 train other weights than one process, ZeRO-3 fails (tests/distributed/
    test_wan22_idle_expert.py runs ZeRO 0 and 1, and ZeRO-2's mismatch): refused with what works; one expert per
    run passes at any stage, both at ZeRO-1."""
    from parallel.check import check
    _, problems = check(_cfg(f"model.experts.train={train}"), {"zero_optimization": {"stage": stage}}, "z.json",
                        world_size=2)
    words = [p for p in problems if "experts trained together" in p]
    assert bool(words) == refused and (refused or problems == []), problems
    if refused:
        assert words[0].startswith(f"z.json: zero_optimization.stage={stage} with 2 experts trained together") and \
               "use stage 1 (or 0)" in words[0] and "model.experts.train=high_noise" in words[0]
