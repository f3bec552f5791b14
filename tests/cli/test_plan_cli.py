"""`python -m parallel.plan.cli` as users run it (split from tests/unit/test_plan.py, which calls the same CLI's
main in-process): the command forked by tests/helpers/commands.py, and once in a fresh process, where DeepSpeed's
first import happens."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.commands import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cli_stdout_is_only_the_report():
    """As users pipe it: a fresh process, `--format json` on stdout, DeepSpeed's log lines elsewhere."""
    # A subprocess, not run_command: parallel/plan/cli.py points DeepSpeed's logger at stderr at DeepSpeed's first
    # import, which in a forked command happened earlier, in the server
    proc = subprocess.run([sys.executable, "-m", "parallel.plan", "--config", "debug", "--deepspeed_config",
                           "ds_configs/zero1_bf16.json", "--world-size", "2", "--device-memory", "4GiB",
                           "--device-profile", "cpu", "--format", "json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["fits"] and report["layout"]["dp"] == 2 and report["model"]["parameters"] == 313_360


def test_png_bars_are_the_report_totals(tmp_path):
    """The chart's stacked bars add up to the totals the text/JSON report gives, stage by stage."""
    from parallel.plan.render import draw

    out = tmp_path / "plan.json"
    png = tmp_path / "plan.png"
    code = run_command(["-m", "parallel.plan", "--config", "configs/debug.yaml", "--deepspeed_config",
                        "ds_configs/zero1_bf16.json", "--world-size", "4", "--device-memory", "4GiB", "--set",
                        "parallel.pp_size=2", "--set", "parallel.tp_size=2", "--format", "json", "--png", str(png)])
    assert code.returncode == 0, code.stderr[-2000:]
    report = json.loads(code.stdout)
    out.write_text(code.stdout)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    heights = draw(report, str(tmp_path / "again.png"))
    assert heights == pytest.approx([s["total"] / 2**30 for s in report["stages"]], rel=1e-12)
    assert len(heights) == 2
