"""The DeepSpeed JSON's "scheduler" section: run as DeepSpeed's own classes run it, or refused before launch."""
import inspect

import pytest
import torch

from parallel.check import check
from parallel.experiment.config import load_config
from parallel.train.schedule import SCHEDULERS, schedule_factor


STEPS, WARMUP, LR = 14, 4, 3e-3


def ds_lrs(kind: str, params: dict, steps: int) -> list[float]:
    """The lr of each optimizer step under DeepSpeed's class, driven as its engine drives it (built, then
    stepped after every optimizer step)."""
    from deepspeed.runtime import lr_schedules

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = getattr(lr_schedules, kind)(opt, **params)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        sched.step()
    return out


def toolkit_lrs(ds: dict, cfg, steps: int) -> list[float]:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.train.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule_factor(ds, cfg.train))
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


CASES = [
    ("WarmupLR", {"warmup_min_lr": 1e-4}, {"warmup_max_lr": LR, "warmup_num_steps": WARMUP}, []),
    ("WarmupDecayLR", {"warmup_min_lr": 2e-4}, {"warmup_max_lr": LR, "warmup_num_steps": WARMUP,
                                                "total_num_steps": 10}, ["train.decay_steps=10"]),
    ("WarmupCosineLR", {"warmup_min_ratio": 0.1}, {"warmup_num_steps": WARMUP, "total_num_steps": 12,
                                                   "cos_min_ratio": 0.05},
     ["train.min_lr=1.5e-4", "train.decay_steps=12"]),
]


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("kind, own, shared, overrides", CASES)
def test_schedule_equals_deepspeeds_class(kind, own, shared, overrides, warmup_type):
    """The keys train.* also sets are filled in from the experiment; the lr per step is DeepSpeed's."""
    cfg = load_config("debug", [f"train.lr={LR}", f"train.warmup_steps={WARMUP}", *overrides])
    ds = {"scheduler": {"type": kind, "params": {**own, "warmup_type": warmup_type}}}
    assert check(cfg, ds, "s.json")[1] == []
    expected = ds_lrs(kind, {**own, **shared, "warmup_type": warmup_type}, STEPS)
    assert toolkit_lrs(ds, cfg, STEPS) == pytest.approx(expected, rel=1e-12, abs=1e-18)
    assert len(set(expected)) > 3          # the schedule moves: warmup, then hold or decay


def test_no_section_is_the_toolkits_schedule():
    from parallel.train.schedule import lr_factor

    cfg = load_config("debug", ["train.max_steps=10", "train.min_lr=3e-4"])
    assert toolkit_lrs({}, cfg, 10) == pytest.approx([cfg.train.lr * lr_factor(n, cfg.train) for n in range(10)])


def test_cosine_after_warmup_is_the_toolkits_schedule_and_auto_is_filled_in():
    """WarmupCosineLR with the keys filled in from train.* equals the toolkit's own schedule after warmup."""
    cfg = load_config("debug", ["train.max_steps=20", "train.warmup_steps=4", "train.min_lr=3e-4"])
    ds = {"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_type": "linear", "total_num_steps": "auto",
                                                               "cos_min_ratio": "auto"}}}
    assert check(cfg, ds, "s.json")[1] == []
    ours, theirs = toolkit_lrs({}, cfg, 20), toolkit_lrs(ds, cfg, 20)
    assert theirs[5:] == pytest.approx(ours[5:], rel=1e-12)
    assert theirs[:5] == pytest.approx([0.0] + [cfg.train.lr * (n - 1) / 4 for n in range(1, 5)])


def test_parameter_names_are_deepspeeds():
    from deepspeed.runtime import lr_schedules

    for kind, names in SCHEDULERS.items():
        theirs = set(inspect.signature(getattr(lr_schedules, kind)).parameters) - {"optimizer", "last_batch_iteration"}
        assert set(names) == theirs, kind


def problems(ds, *overrides):
    return check(load_config("debug", list(overrides)), ds, "s.json")[1]


def test_disagreeing_keys_name_both_and_the_fix():
    ds = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 8,
                                                            "total_num_steps": 100}}}
    assert problems(ds, "train.max_steps=40") == [
        "s.json: scheduler.params.warmup_num_steps=8 != train.warmup_steps=4; set --set train.warmup_steps=8 or "
        "remove scheduler.params.warmup_num_steps (it is filled in from the experiment)",
        "s.json: scheduler.params.warmup_max_lr=0.001 != train.lr=0.003; set --set train.lr=0.001 or remove "
        "scheduler.params.warmup_max_lr (it is filled in from the experiment)",
        "s.json: scheduler.params.total_num_steps=100 != train.max_steps=40; set --set train.max_steps=100 or "
        "remove scheduler.params.total_num_steps (it is filled in from the experiment)"]
    ds = {"scheduler": {"type": "WarmupCosineLR", "params": {"cos_min_ratio": 0.1}}}
    assert problems(ds) == [
        "s.json: scheduler.params.cos_min_ratio=0.1 != train.min_lr / train.lr = 0.0 / 0.003 = 0; set --set "
        "train.min_lr=0.0003 or remove scheduler.params.cos_min_ratio (it is filled in from the experiment)"]
    assert problems(ds, "train.min_lr=3e-4") == []


@pytest.mark.parametrize("scheduler, expected", [
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}},
     "s.json: scheduler.type='OneCycle' is refused: its lr comes from cycle_min_lr/cycle_max_lr rather than "
     "train.lr, and it cycles Adam's beta1 (cycle_momentum), which optimizer.params.betas then no longer "
     "describes; use WarmupLR, WarmupDecayLR or WarmupCosineLR, or remove the \"scheduler\" section for the "
     "toolkit's schedule (train.lr, train.warmup_steps, train.min_lr, train.decay_steps)"),
    ({"type": "LRRangeTest", "params": {}}, "s.json: scheduler.type='LRRangeTest' is refused: it is an lr sweep"),
    ({"type": "StepLR", "params": {"step_size": 10}}, "s.json: scheduler.type='StepLR' is not one the toolkit runs"),
    ({"params": {}}, "s.json: scheduler needs a \"type\""),
    ({"type": "WarmupLR", "params": {"warmup_num_step": 4}},
     "s.json: scheduler.params.warmup_num_step: WarmupLR has no such parameter (did you mean \"warmup_num_steps\"?)"),
    ({"type": "WarmupLR", "params": {"warmup_type": "exp"}},
     "s.json: scheduler.params.warmup_type='exp': use \"log\" or \"linear\""),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": [0, 0]}},
     "s.json: scheduler.params.warmup_min_lr=[0, 0]: give one number"),
    ({"type": "WarmupLR", "params": {"last_batch_iteration": 5}},
     "s.json: scheduler.params.last_batch_iteration: the toolkit resumes the schedule from the checkpoint"),
])
def test_refused_schedulers_say_why_and_what_works(scheduler, expected):
    found = problems({"scheduler": scheduler})
    assert len(found) == 1 and found[0].startswith(expected), found


def test_schedule_shape_must_match_train_keys():
    assert problems({"scheduler": {"type": "WarmupLR"}}, "train.warmup_steps=1") == [
        "s.json: scheduler.type='WarmupLR' with train.warmup_steps=1: DeepSpeed's WarmupLR warms up over max(2, "
        "warmup_num_steps) steps; set train.warmup_steps >= 2, or remove the \"scheduler\" section (the toolkit's "
        "schedule allows any warmup)"]
    assert problems({"scheduler": {"type": "WarmupLR"}}, "train.min_lr=1e-5")[0].startswith(
        "s.json: scheduler.type='WarmupLR' holds the lr at train.lr after warmup, but train.min_lr=1e-05")
    assert problems({"scheduler": {"type": "WarmupDecayLR"}}, "train.min_lr=1e-5")[0].startswith(
        "s.json: scheduler.type='WarmupDecayLR' decays to 0, but train.min_lr=1e-05")


def test_each_experts_groups_follow_the_schedule_at_their_own_update_count():
    """Wan 2.2 A14B with both experts (parallel/train/optim.py ExpertAdamW, groups tagged "expert"): each expert's
    group runs at lr(n_e), n_e the updates it took part in (Adam's own step count), an untagged group at the
    global step; a scheduler loaded from its state_dict continues the same lrs, one saved before per-expert counts
    at the global step."""
    from parallel.train.optim import ExpertAdamW
    from parallel.train.schedule import build_schedule

    cfg = load_config("debug", [f"train.warmup_steps={WARMUP}", f"train.max_steps={STEPS}", f"train.lr={LR}",
                                f"train.min_lr={LR / 10}"])
    factor = schedule_factor({}, cfg.train)

    def build():
        params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
        opt = ExpertAdamW([{"params": params[:1], "expert": 0}, {"params": params[1:2], "expert": 1},
                           {"params": params[2:]}], lr=LR)
        return opt, build_schedule(opt, factor)

    opt, sched = build()
    counts = [0, 0]
    for step, idle in enumerate([{1}, {1}, set(), {0}, {1}, set(), {1}]):
        assert [g["lr"] for g in opt.param_groups] == [LR * factor(counts[0]), LR * factor(counts[1]),
                                                        LR * factor(step)], step
        opt.idle = frozenset(idle)
        for group in opt.param_groups:
            group["params"][0].grad = torch.ones(1)
        opt.step()
        sched.step()
        counts = [n + (e not in idle) for e, n in enumerate(counts)]
    assert sched.expert_steps == counts == [6, 3] and sched.last_epoch == 7
    assert [int(opt.state[g["params"][0]]["step"]) for g in opt.param_groups[:2]] == counts
    assert len({g["lr"] for g in opt.param_groups}) == 3           # warmup, decay and the global step: three lrs
    resumed_opt, resumed = build()
    resumed.load_state_dict(sched.state_dict())
    assert resumed.lrs() == [g["lr"] for g in opt.param_groups]
    _, older = build()
    older.load_state_dict({k: v for k, v in sched.state_dict().items() if k != "expert_steps"})
    assert older.expert_steps == [7, 7]
