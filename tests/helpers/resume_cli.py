"""The helpers and fixtures of tests/cli/test_resume_cli.py that other test modules use too: `ROOT`, `clean_env`,
`command`, `metrics` (a test module imports no other test module)."""
import json
import os
import sys


from tests.dist_utils import free_port


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 6


def command(module_or_script, out, ranks, layout, *args):
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return [deepspeed, "--num_gpus", str(ranks), "--master_port", str(free_port()),
            *module_or_script, "--config", "debug", "--deepspeed_config", str(out / "ds.json"), *layout,
            "--set", "train.warmup_steps=0", "--set", f"train.decay_steps={STEPS}",
            "--set", f"train.output_dir={out}", *args]


def clean_env():
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
