"""train.py in 2 ranks on a checkpoint filesystem too small for a second checkpoint (a real tmpfs; CI runs as
root): the first save's predicted size is within 5 % of what it writes (+1.9 % here), the run stops with the
figures and the checkpoint to resume from, the rerun after space is freed resumes there, and the metrics read back
show each step once. The ranks are forked with torchrun's environment by tests/helpers/commands.py; the real
launchers are tested in test_launchers.py and test_netns_hosts.py."""
import json
import os
import shutil
import subprocess

from parallel.checkpoints.checkpoint import MARKER, folder_bytes
from parallel.validation.media import latest_rows
from tests.helpers.commands import ROOT, run_command
from tests.helpers.resume_cli import STEPS, metrics

SIZE_MIB = 12         # the debug model's checkpoint (DeepSpeed's files + the layout-free copy) is ~7.4 MiB:
                      # the first fits, a second does not


def train(out, ckpt_dir):
    """tests/helpers/resume_cli.command's train.py run, in 2 ranks."""
    return run_command(["train.py", "--config", "debug", "--deepspeed_config", out / "ds.json", "--set",
                        "parallel.tp_size=1", "--set", "train.warmup_steps=0", "--set", f"train.decay_steps={STEPS}",
                        "--set", f"train.output_dir={out}", "--set", "train.max_steps=6", "--set", "ckpt.every=3",
                        "--set", f"ckpt.dir={ckpt_dir}"], ranks=2)


def test_a_full_disk_stops_with_the_figures_and_the_rerun_resumes(tmp_path):
    out, ckpt_dir = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    ckpt_dir.mkdir()
    shutil.copy(os.path.join(ROOT, "ds_configs/zero0_fp32.json"), out / "ds.json")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE_MIB}m", "tmpfs", str(ckpt_dir)], check=True)
    try:
        p = train(out, ckpt_dir)
        assert p.returncode != 0, p.stdout[-2000:]
        lines = [line for line in p.stderr.splitlines() if line.startswith("checkpoint save to")]
        assert len(lines) == 1, p.stderr[-4000:]                   # rank 0 says it, once
        assert lines[0].startswith(f"checkpoint save to {ckpt_dir}/step6 stopped: needs ~7.")
        assert lines[0].endswith(f"free on that filesystem; the last complete checkpoint is {ckpt_dir}/step3 "
                                 f"(resume with the same command once there is space)")
        assert (ckpt_dir / "latest").read_text() == "step3" and not (ckpt_dir / "step6").exists()
        assert "Traceback" not in p.stderr
        # the size the first save was checked against (checkpoint.predicted_bytes) against what it wrote
        predicted = json.loads((ckpt_dir / "step3" / MARKER).read_text())["predicted_bytes"]
        written = folder_bytes(ckpt_dir / "step3")
        print(f"\nstep3: predicted {predicted} B, written {written} B ({written / predicted - 1:+.2%})")
        assert abs(written / predicted - 1) < 0.05, (predicted, written)

        subprocess.run(["mount", "-o", "remount,size=32m", str(ckpt_dir)], check=True)   # space freed
        p = train(out, ckpt_dir)
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
        assert f"resumed from {ckpt_dir}/step3 at step 3" in p.stdout
        assert (ckpt_dir / "latest").read_text() == "step6"
    finally:
        subprocess.run(["umount", str(ckpt_dir)], check=False)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 4, 5, 6]
    assert rows[6]["resumed_from"] == 3 and all("resumed_from" not in r for r in rows[:6] + rows[7:])
    assert [r["step"] for r in latest_rows(rows)] == [1, 2, 3, 4, 5, 6]
    assert latest_rows(rows)[3:] == rows[6:]
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
