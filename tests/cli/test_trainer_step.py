"""The Trainer's extension point: a subclass that overrides `step` (here a test objective, three times the
model's loss) is what the loop runs; metrics.jsonl holds the losses the override computed, and its first
one is three times the first loss of train.py's own run (same weights, same batch). Both commands run as
`python` would, forked by tests/helpers/commands.py."""
import json

import pytest

from tests.helpers.commands import run_command

SCRIPT = '''
import json, sys
from parallel.check import load_and_check
from parallel.distributed.topology import read_launch_env
from parallel.train.engine import StepResult
from parallel.plan.memory import run_plan
from parallel.train.trainer import Trainer


class TripleLoss(Trainer):
    """A test objective: three times the model's loss, backpropagated as such."""
    computed = []

    def step(self, batches):
        engine, accum = self.engine.engine, self.cfg.train.grad_accum_steps
        lr, total = engine.get_lr()[0], 0.0
        for _ in range(accum):
            inputs, target = next(batches)
            loss = 3 * engine(tuple(x.to(engine.device) for x in inputs), target.to(engine.device))
            engine.backward(loss)
            engine.step()
            total += float(loss)
        self.computed.append(total / accum)
        return StepResult(loss=total / accum, grad_norm=float(engine.get_global_grad_norm()), lr=lr)


out = sys.argv[1]
cfg, ds, layout = load_and_check("debug", [f"train.output_dir={out}", "train.max_steps=3"],
                                 "ds_configs/zero0_fp32.json", 1)
status = TripleLoss(cfg, ds, layout, read_launch_env(), resume=False, planner=run_plan).fit()
with open(f"{out}/computed.json", "w") as f:
    json.dump(TripleLoss.computed, f)
sys.exit(status)
'''


def run(args, tmp_path):
    p = run_command(args)           # from the repository root, on the tests' sys.path: the script's imports
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_an_overridden_step_is_what_the_loop_runs(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    run([str(tmp_path / "script.py"), str(tmp_path / "triple")], tmp_path)
    run(["train.py", "--config", "debug", "--deepspeed_config", "ds_configs/zero0_fp32.json",
         "--set", "train.max_steps=3", "--set", f"train.output_dir={tmp_path / 'plain'}"], tmp_path)
    computed = json.loads((tmp_path / "triple" / "computed.json").read_text())
    assert len(computed) == 3 and losses(tmp_path / "triple") == computed
    assert computed[0] == pytest.approx(3 * losses(tmp_path / "plain")[0], rel=1e-6)
