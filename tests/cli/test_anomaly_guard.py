"""train.anomaly under the deepspeed launcher: a NaN injected into one rank's input at step K is skipped on
every rank (no optimizer update: weights, Adam, EMA and the LR schedule as they were), and the losses of
the other steps equal a run that never saw step K's batch (its batches go from K-1 to K+1): dp 2 with
ZeRO-0 (the toolkit's skip of a torch optimizer) and ZeRO-2 (DeepSpeed's own overflow branch), and tp 2 x
pp 2 with ZeRO-1 (the decision inside the pipeline engine's train_batch). action=rollback (dp 2, ZeRO-0)
loads the checkpoint before the step, replays and skips that batch: the same losses. The step,
its samples and the count are in the log and metrics.jsonl; action=stop ends the run there, exit status 1.
Gradient accumulation 2: the decision sits between the last backward and the update."""
import json
import os
import subprocess
import sys

import pytest

from tests.dist_utils import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K, STEPS = 1, 4          # step index K (the second step, "step 2" in the log) is poisoned

SCRIPT = '''
import os
import sys
import torch
import torch.distributed as dist
from parallel.check import load_and_check
from parallel.distributed.topology import read_launch_env
from parallel.plan.memory import run_plan
from parallel.train.trainer import Trainer

argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]       # the launcher's
out, mode, ds, K, extra = argv[0], argv[1], argv[2], int(argv[3]), argv[4:]


class Batches:
    """The run's batches; mode nan: rank 1's inputs of step K are NaN; drop: step K's batch never seen."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __next__(self):
        if mode == "drop" and self.inner.step == K and self.inner.micro == 0:
            self.inner.step = K + 1
        step = self.inner.step
        (x, t, text), target = next(self.inner)
        if mode == "nan" and step == K and dist.get_rank() == 1:
            x = x * float("nan")
        return (x, t, text), target


class Poisoned(Trainer):
    def start(self):
        super().start()
        self.batches = Batches(self.batches)


cfg, ds, layout = load_and_check("debug", [f"train.output_dir={out}", "train.warmup_steps=0",
                                           "train.decay_steps=10", "train.check_replicas_every=0", *extra], ds,
                                 int(os.environ["WORLD_SIZE"]))
sys.exit(Poisoned(cfg, ds, layout, read_launch_env(), resume=False, planner=run_plan).fit())
'''


def launch(tmp_path, name, mode, ds, *extra, ranks=2):
    out = tmp_path / name
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    p = subprocess.run([deepspeed, "--num_gpus", str(ranks), "--master_port", str(free_port()), str(tmp_path / "script.py"),
                        str(out), mode, str(ds), str(K), *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").exists() else []
    return p, rows


LAYOUTS = {"dp2-zero0": (2, 0, []), "dp2-zero2": (2, 2, []),           # ranks, ZeRO stage, sizes
           "tp2-pp2-zero1": (4, 1, ["parallel.tp_size=2", "parallel.pp_size=2"])}     # inside train_batch


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_nan_on_one_rank_is_skipped_everywhere_and_the_run_equals_one_without_that_batch(tmp_path, name):
    ranks, stage, sizes = LAYOUTS[name]
    (tmp_path / "script.py").write_text(SCRIPT)
    ds = json.load(open(os.path.join(ROOT, "ds_configs/zero0_fp32.json")))
    ds["optimizer"]["type"] = "FusedEmaAdam"       # the EMA must skip too
    ds["zero_optimization"] = {"stage": stage}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    guard = ["train.anomaly={action: skip}", f"train.max_steps={STEPS}", *sizes]
    p, skipped = launch(tmp_path, "skip", "nan", tmp_path / "ds.json", *guard, ranks=ranks)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    p_ref, never = launch(tmp_path, "never", "drop", tmp_path / "ds.json", f"train.max_steps={STEPS - 1}", *sizes,
                          ranks=ranks)
    assert p_ref.returncode == 0, (p_ref.stdout + p_ref.stderr)[-4000:]

    assert [r["step"] for r in skipped] == list(range(1, STEPS + 1))
    bad = skipped[K]
    said = "loss nan is not finite" + (" (ranks 2, 3)" if sizes else "")     # pipeline: the last stage judges
    assert bad["skipped"] == said and bad["anomalies"] == 1
    assert [r["anomalies"] for r in skipped] == [0] + [1] * (STEPS - 1)
    kept = [r["loss"] for i, r in enumerate(skipped) if i != K]
    assert kept == pytest.approx([r["loss"] for r in never], rel=1e-6, abs=0)
    assert [r["lr"] for i, r in enumerate(skipped) if i != K] == [r["lr"] for r in never]
    lines = [line for line in p.stderr.splitlines() if line.startswith(f"step {K + 1}: {said}; ")]
    assert len(lines) == 1 and "samples [" in lines[0] and "update skipped (1 skipped so far" in lines[0], \
        p.stderr[-3000:]

    if name == "dp2-zero0":      # action=rollback: back to step K's checkpoint, replayed, step K + 1 skipped
        p, rolled = launch(tmp_path, "rollback", "nan", tmp_path / "ds.json", "train.anomaly={action: rollback}",
                           "ckpt.every=1", f"train.max_steps={STEPS}")
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
        assert [r["step"] for r in rolled] == [1, 2, 2, 3, 4] and rolled[2]["resumed_from"] == K
        assert rolled[1]["skipped"] == "loss nan is not finite"
        assert rolled[2]["skipped"] == "rolled back past it: loss nan is not finite"
        assert f"step {K + 1}: rolled back to {tmp_path}/rollback/checkpoints/step{K}" in p.stderr
        assert [r["loss"] for r in rolled if "skipped" not in r] == pytest.approx([r["loss"] for r in never],
                                                                                   rel=1e-6, abs=0)

    if name == "dp2-zero0":      # action=stop: ends at step K + 1, status 1, no checkpoint
        p, rows = launch(tmp_path, "stop", "nan", tmp_path / "ds.json", "train.anomaly={action: stop}",
                         f"train.max_steps={STEPS}")
        assert p.returncode != 0 and [r["step"] for r in rows] == list(range(1, K + 1)), (p.stdout + p.stderr)[-3000:]
        assert f"step {K + 1}: loss nan is not finite; samples [" in p.stderr
        assert "stopping (train.anomaly)" in p.stderr and "Traceback" not in p.stderr
        assert not (tmp_path / "stop" / "checkpoints").exists()


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
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}

    def train(out, *args):
        return subprocess.run([sys.executable, "train.py", "--config", "debug", "--deepspeed_config",
                               "ds_configs/zero0_fp32.json", "--set", "data.kind=directory", "--set",
                               f"data.path={data}", "--set", "train.micro_batch_size=1", "--set",
                               "train.grad_accum_steps=1", "--set", "train.max_steps=4", "--set",
                               f"train.output_dir={out}", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)

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
