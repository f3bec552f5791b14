"""train.anomaly in a distributed run: a NaN injected into one rank's input at step K is skipped on
every rank (no optimizer update: weights, Adam, EMA and the LR schedule as they were), and the losses of
the other steps equal a run that never saw step K's batch (its batches go from K-1 to K+1): dp 2 with
ZeRO-0 (the toolkit's skip of a torch optimizer) and ZeRO-2 (DeepSpeed's own overflow branch), and tp 2 x
pp 2 with ZeRO-1 (the decision inside the pipeline engine's train_batch). action=rollback (dp 2, ZeRO-0)
loads the checkpoint before the step, replays and skips that batch: the same losses. The step,
its samples and the count are in the log and metrics.jsonl; action=stop ends the run there, with the status
train.py exits with (1) and no checkpoint. Gradient accumulation 2: the decision sits between the last backward
and the update.

Two launches serve every check: one of 2 ranks runs the dp 2 runs one after another (each layout's poisoned run
and its reference, then rollback and stop), one of 4 ranks the tp 2 x pp 2 pair. Each run is a whole Trainer.fit
(its own engine, output folder and log section) in process groups the launch creates once. The ranks are forked
with torchrun's environment by tests/helpers/commands.py; the real launchers are tested in test_launchers.py and
test_netns_hosts.py."""
import json
import os

import pytest

from tests.helpers.commands import ROOT, run_command
from tests.helpers.train_cli import train_py
K, STEPS = 1, 4          # step index K (the second step, "step 2" in the log) is poisoned

SCRIPT = '''
import json
import os
import sys
import torch.distributed as dist
from parallel.check import load_and_check
from parallel.distributed.topology import read_launch_env
from parallel.plan.memory import run_plan
from parallel.train.trainer import Trainer

root, K, runs = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])


class Batches:
    """The run's batches; mode nan: rank 1's inputs of step K are NaN; drop: step K's batch never seen."""

    def __init__(self, inner, mode):
        self.inner, self.mode = inner, mode

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __next__(self):
        if self.mode == "drop" and self.inner.step == K and self.inner.micro == 0:
            self.inner.step = K + 1
        step = self.inner.step
        (x, t, text), target = next(self.inner)
        if self.mode == "nan" and step == K and dist.get_rank() == 1:
            x = x * float("nan")
        return (x, t, text), target


class Poisoned(Trainer):
    mode = None

    def start(self):
        super().start()
        self.batches = Batches(self.batches, self.mode)


# One set of process groups for every run: Trainer.close() would destroy it after each.
destroy, dist.destroy_process_group = dist.destroy_process_group, lambda *args, **kwargs: None
for run in runs:
    print(f"=== run {run['name']}", file=sys.stderr, flush=True)      # every rank: its stderr comes whole, in turn
    cfg, ds, layout = load_and_check("debug", [f"train.output_dir={root}/{run['name']}", "train.warmup_steps=0",
                                               "train.decay_steps=10", "train.check_replicas_every=0", *run["sets"]],
                                     run["ds"], int(os.environ["WORLD_SIZE"]))
    Poisoned.mode = run["mode"]
    status = Poisoned(cfg, ds, layout, read_launch_env(), resume=False, planner=run_plan).fit()
    if int(os.environ["RANK"]) == 0:
        with open(f"{root}/{run['name']}/status", "w") as f:
            f.write(str(status))
destroy()
'''

LAYOUTS = {"dp2-zero0": (2, 0, []), "dp2-zero2": (2, 2, []),           # ranks, ZeRO stage, sizes
           "tp2-pp2-zero1": (4, 1, ["parallel.tp_size=2", "parallel.pp_size=2"])}     # inside train_batch


def launch(root, ranks, runs):
    """One launch of `ranks` running `runs` in turn (name, mode, ZeRO stage, --set overrides): each run's
    (metrics.jsonl rows, fit's status, its part of the launch's stderr, its output folder) by name."""
    root.mkdir()
    (root / "script.py").write_text(SCRIPT)
    specs = []
    for name, mode, stage, sets in runs:
        ds = json.load(open(os.path.join(ROOT, "ds_configs/zero0_fp32.json")))
        ds["optimizer"]["type"] = "FusedEmaAdam"       # the EMA must skip too
        ds["zero_optimization"] = {"stage": stage}
        (root / f"{name}.json").write_text(json.dumps(ds))
        specs.append({"name": name, "mode": mode, "ds": str(root / f"{name}.json"), "sets": sets})
    p = run_command([root / "script.py", root, K, json.dumps(specs)], ranks=ranks, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    logs = {}                # every rank's part of each run's section, in rank order
    for part in p.stderr.split("=== run ")[1:]:
        name, text = part.split("\n", 1)
        logs[name] = logs.get(name, "") + text
    out = {}
    for name, *_ in runs:
        rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()] \
            if (root / name / "metrics.jsonl").exists() else []
        out[name] = rows, int((root / name / "status").read_text()), logs[name], root / name
    return out


def skip_and_never(layout):
    """A layout's poisoned run (action skip) and its reference that never sees step K's batch."""
    _, stage, sizes = LAYOUTS[layout]
    return [(f"{layout}-skip", "nan", stage, ["train.anomaly={action: skip}", f"train.max_steps={STEPS}", *sizes]),
            (f"{layout}-never", "drop", stage, [f"train.max_steps={STEPS - 1}", *sizes])]


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    """The 2-rank launch: both dp 2 layouts' pairs, then action=rollback and action=stop (ZeRO-0)."""
    return launch(tmp_path_factory.mktemp("anomaly") / "dp2", 2, [
        *skip_and_never("dp2-zero0"), *skip_and_never("dp2-zero2"),
        ("rollback", "nan", 0, ["train.anomaly={action: rollback}", "ckpt.every=1", f"train.max_steps={STEPS}"]),
        ("stop", "nan", 0, ["train.anomaly={action: stop}", f"train.max_steps={STEPS}"])])


@pytest.fixture(scope="module")
def tp2_pp2(tmp_path_factory):
    """The 4-rank launch: tp 2 x pp 2's pair."""
    return launch(tmp_path_factory.mktemp("anomaly") / "tp2pp2", 4, skip_and_never("tp2-pp2-zero1"))


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_nan_on_one_rank_is_skipped_everywhere_and_the_run_equals_one_without_that_batch(request, name):
    runs = request.getfixturevalue("tp2_pp2" if name.startswith("tp2") else "dp2")
    skipped, status, log, _ = runs[f"{name}-skip"]
    never, status_ref, _, _ = runs[f"{name}-never"]
    assert status == status_ref == 0, log[-3000:]

    assert [r["step"] for r in skipped] == list(range(1, STEPS + 1))
    bad = skipped[K]
    said = "loss nan is not finite" + (" (ranks 2, 3)" if LAYOUTS[name][2] else "")     # pipeline: the last stage judges
    assert bad["skipped"] == said and bad["anomalies"] == 1
    assert [r["anomalies"] for r in skipped] == [0] + [1] * (STEPS - 1)
    kept = [r["loss"] for i, r in enumerate(skipped) if i != K]
    assert kept == pytest.approx([r["loss"] for r in never], rel=1e-6, abs=0)
    assert [r["lr"] for i, r in enumerate(skipped) if i != K] == [r["lr"] for r in never]
    lines = [line for line in log.splitlines() if line.startswith(f"step {K + 1}: {said}; ")]
    assert len(lines) == 1 and "samples [" in lines[0] and "update skipped (1 skipped so far" in lines[0], log[-3000:]


def test_rollback_replays_from_the_checkpoint_before_the_bad_step(dp2):
    """action=rollback (dp 2, ZeRO-0): back to step K's checkpoint, replayed, step K + 1 skipped: the losses of the
    run that never saw that batch."""
    rolled, status, log, folder = dp2["rollback"]
    never = dp2["dp2-zero0-never"][0]
    assert status == 0, log[-3000:]
    assert [r["step"] for r in rolled] == [1, 2, 2, 3, 4] and rolled[2]["resumed_from"] == K
    assert rolled[1]["skipped"] == "loss nan is not finite"
    assert rolled[2]["skipped"] == "rolled back past it: loss nan is not finite"
    assert f"step {K + 1}: rolled back to {folder}/checkpoints/step{K}" in log, log[-3000:]
    assert [r["loss"] for r in rolled if "skipped" not in r] == pytest.approx([r["loss"] for r in never],
                                                                               rel=1e-6, abs=0)


def test_stop_ends_the_run_at_the_bad_step_without_a_checkpoint(dp2):
    """action=stop (dp 2, ZeRO-0): the run ends at step K + 1 with status 1 (train.py's exit status), said on
    stderr, no traceback, no checkpoint."""
    rows, status, log, folder = dp2["stop"]
    assert status == 1 and [r["step"] for r in rows] == list(range(1, K + 1)), log[-3000:]
    assert f"step {K + 1}: loss nan is not finite; samples [" in log
    assert "stopping (train.anomaly)" in log and "Traceback" not in log
    assert not (folder / "checkpoints").exists()


def write_latents(root, bad):
    """Four samples of the debug model's shapes; sample `bad`'s latent holds a NaN (a VAE overflow)."""
    import torch
    from safetensors.torch import save_file
    lines = []
    for i in range(4):
        latent = torch.randn(4, 3, 8, 8)
        if i == bad:
            latent[0, 1, 2, 3] = float("nan")
        save_file({"latent": latent}, str(root / f"v{i}.safetensors"))
        torch.save(torch.randn(8, 32), root / f"v{i}_text.pt")
        lines.append(json.dumps({"latent": f"v{i}.safetensors", "text": f"v{i}_text.pt"}))
    (root / "manifest.jsonl").write_text("\n".join(lines) + "\n")


def test_a_bad_latent_file_is_skipped_and_counted_or_stops_naming_the_file(tmp_path):
    """One process, a directory of 4 samples at global batch 1: the step that reads the bad one."""
    data = tmp_path / "data"
    data.mkdir()
    write_latents(data, bad=2)

    def train(out, *args):
        return train_py("--config", "debug", "--deepspeed_config", "ds_configs/zero0_fp32.json", "--set",
                        "data.kind=directory", "--set", f"data.path={data}", "--set", "train.micro_batch_size=1",
                        "--set", "train.grad_accum_steps=1", "--set", "train.max_steps=4", "--set",
                        f"train.output_dir={out}", *args)

    p = train(tmp_path / "skip", "--set", "train.anomaly={bad_samples: skip}")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    bad = [r for r in rows if "skipped" in r]
    assert len(bad) == 1 and bad[0]["skipped"] == f"unreadable sample {data / 'v2.safetensors'} (holds NaN or inf values)"
    assert rows[-1]["anomalies"] == 1 and all(r["loss"] == r["loss"] for r in rows)       # no NaN logged
    assert f"step {bad[0]['step']}: unreadable sample {data / 'v2.safetensors'} (holds NaN or inf values); " \
           f"samples [2]; update skipped (1 skipped so far" in p.stderr

    p = train(tmp_path / "default")            # no train.anomaly: a clear stop naming the file and the way on
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert (f"unreadable sample {data / 'v2.safetensors'} (holds NaN or inf values); samples [2]; stopping "
            f"(train.anomaly) (fix the file or drop its manifest.jsonl line, or --set 'train.anomaly={{bad_samples: "
            f"skip}}' to skip such steps)") in p.stderr
