"""train.py as users run it: refused configs never start DeepSpeed, missing data is named, one process trains."""
import glob
import json
import os

import pytest

from parallel.experiment.config import load_config
from tests.helpers.train_cli import ROOT, train_py


def test_refused_layout_never_starts_deepspeed(tmp_path):
    out = tmp_path / "run"
    p = train_py("--config", "debug", "--deepspeed_config", "ds_configs/zero2_bf16.json",
                 "--set", "parallel.pp_size=2", "--set", "parallel.tp_size=3", "--set", f"train.output_dir={out}",
                 env_extra={"RANK": "0", "WORLD_SIZE": "6", "MASTER_PORT": "1"})
    assert p.returncode == 1
    assert "model.num_heads=4 is not divisible by parallel.tp_size=3" in p.stderr
    assert "zero_optimization.stage=2 with parallel.pp_size=2" in p.stderr
    assert "deepspeed" not in p.stdout.lower() and not out.exists()


def test_missing_data_file_is_named_before_training(tmp_path):
    (tmp_path / "manifest.jsonl").write_text(json.dumps({"latent": "a.safetensors", "text": "a_text.pt"}) + "\n")
    p = train_py("--config", "debug", "--deepspeed_config", "ds_configs/zero0_fp32.json",
                 "--set", "data.kind=directory", "--set", f"data.path={tmp_path}",
                 "--set", f"train.output_dir={tmp_path / 'run'}")
    assert p.returncode != 0
    assert f"{tmp_path / 'manifest.jsonl'}:1: data file {tmp_path / 'a.safetensors'} does not exist" in p.stderr
    assert not (tmp_path / "run").exists()


def test_a_latent_of_the_wrong_shape_is_named_before_training(tmp_path):
    """Not a torch.stack traceback at the first step: the file, its manifest line and both shapes, exit 1."""
    import torch
    from safetensors.torch import save_file

    cfg = load_config("debug")
    lines = []
    for i, shape in enumerate([(4, 3, 8, 8), (4, 3, 8, 9)]):
        save_file({"latent": torch.zeros(shape)}, str(tmp_path / f"v{i}.safetensors"))
        torch.save(torch.zeros(cfg.model.max_text_len, cfg.model.text_embed_dim), tmp_path / f"v{i}_text.pt")
        lines.append(json.dumps({"latent": f"v{i}.safetensors", "text": f"v{i}_text.pt"}))
    (tmp_path / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    p = train_py("--config", "debug", "--deepspeed_config", "ds_configs/zero0_fp32.json",
                 "--set", "data.kind=directory", "--set", f"data.path={tmp_path}",
                 "--set", f"train.output_dir={tmp_path / 'run'}")
    assert p.returncode == 1
    assert "train.py refused (" in p.stderr
    assert f"{tmp_path / 'v1.safetensors'}: latent shape [4, 3, 8, 9] != expected [4, 3, 8, 8] (manifest.jsonl:2; " \
           in p.stderr
    assert "v0.safetensors" not in p.stderr and "Traceback" not in p.stderr
    assert "deepspeed" not in p.stdout.lower() and not (tmp_path / "run").exists()


def test_one_process_trains_from_a_latent_directory_and_appends_metrics(tmp_path):
    """Prepared latents in safetensors and .pt train like the synthetic set; metrics.jsonl is appended to."""
    import torch
    from safetensors.torch import save_file

    cfg = load_config("debug")
    lines = []
    for i in range(4):
        save_file({"latent": torch.randn(4, 3, 8, 8)}, str(tmp_path / f"v{i}.safetensors"))
        torch.save(torch.randn(cfg.model.max_text_len, cfg.model.text_embed_dim), tmp_path / f"v{i}_text.pt")
        lines.append(json.dumps({"latent": f"v{i}.safetensors", "text": f"v{i}_text.pt"}))
    (tmp_path / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0, "note": "earlier run"}\n')
    ds = json.load(open(os.path.join(ROOT, "ds_configs/zero0_fp32.json")))
    ds["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "job"}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    p = train_py("--config", "debug", "--deepspeed_config", str(tmp_path / "ds.json"),
                 "--set", "data.kind=directory", "--set", f"data.path={tmp_path}", "--set", "train.max_steps=3",
                 "--set", f"train.output_dir={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0] == {"step": 0, "note": "earlier run"}
    assert [r["step"] for r in records[1:]] == [1, 2, 3]
    for r in records[1:]:
        assert {"loss", "lr", "grad_norm", "step_time_s", "samples_per_s", "tokens_per_s"} <= r.keys()
        assert r["grad_norm"] > 0 and r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 56, rel=1e-2)
    csv_rows = (tmp_path / "csv" / "job" / "train_loss.csv").read_text().splitlines()[1:]
    assert [float(row.split(",")[1]) for row in csv_rows] == pytest.approx([r["loss"] for r in records[1:]])


def test_a_stale_jit_build_lock_is_refused_before_deepspeed_waits_on_it(tmp_path):
    """A build of DeepSpeed's CPU all-reduce op killed two hours ago left its lock: without the check, init_distributed
    polls it forever (the timeout fails the test instead of hanging the suite). The refusal is the checker's,
    word for word (tests/unit/test_build_locks.py), and the lock is left for the user to remove."""
    from parallel.distributed.extensions import check_build_locks

    lock = tmp_path / "ext" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (lock.stat().st_mtime - 7200,) * 2)
    p = train_py("--config", "debug", "--deepspeed_config", "ds_configs/zero0_fp32.json",
                 "--set", f"train.output_dir={tmp_path / 'run'}",
                 env_extra={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}, timeout=120)
    assert p.returncode == 1
    [problem] = check_build_locks(root=tmp_path / "ext")
    assert f"  - {problem}\n" in p.stderr and f"rm -r {lock.parent}" in problem
    assert lock.exists() and not (tmp_path / "run").exists()


def _check_only(capsys, *sets):
    """train.py --check-only in this process: (exit status, stdout, stderr)."""
    import train
    code = train.main(["--config", "debug", "--deepspeed_config", "ds_configs/zero0_fp32.json", "--check-only",
                       *(a for s in sets for a in ("--set", s))])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_unusable_output_folders_are_refused_before_training(tmp_path, capsys):
    """A ckpt.dir or train.output_dir that is a file, under a file, cannot be created (/proc) or cannot be written:
    refused by --check-only and by a real run before any process group, naming the key; the advice works and
    nothing is left behind."""
    (tmp_path / "file").write_text("not a folder")
    out, ckpt = tmp_path / "out", tmp_path / "file"
    heading = "train.py refused (1 problem):\n  - "
    code, _, err = _check_only(capsys, f"train.output_dir={out}", f"ckpt.dir={ckpt}")
    assert code == 1 and err == heading + f"ckpt.dir={ckpt} is a file, not a folder: every checkpoint is written " \
        f"there; set --set ckpt.dir=null (the default, {out}/checkpoints)\n"
    code, stdout, _ = _check_only(capsys, f"train.output_dir={out}", f"ckpt.dir={ckpt}", "ckpt.dir=null")
    assert code == 0 and stdout.startswith("ok: debug ")
    code, _, err = _check_only(capsys, f"train.output_dir={ckpt}/run")
    assert code == 1 and err == heading + f"train.output_dir={ckpt}/run cannot be created: {ckpt} is a file: " \
        f"metrics, samples and (by default) checkpoints are written there; set --set train.output_dir=runs/default " \
        f"(the default)\n"
    code, _, err = _check_only(capsys, "train.output_dir=/proc")
    assert code == 1 and err.startswith(heading + "train.output_dir=/proc cannot be written (")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    # A real run: refused before DeepSpeed starts (not a traceback once it did); the advice passes the checks.
    p = train_py("--config", "debug", "--deepspeed_config", "ds_configs/zero0_fp32.json",
                 "--set", "train.output_dir=/proc/vdp-run")
    assert p.returncode == 1 and p.stderr.endswith(
        heading + "train.output_dir=/proc/vdp-run cannot be created in /proc (No such file or directory): metrics, "
        "samples and (by default) checkpoints are written there; set --set train.output_dir=runs/default (the "
        "default)\n"), p.stderr[-2000:]
    assert "Traceback" not in p.stderr and "init_distributed" not in p.stdout + p.stderr
    code, stdout, _ = _check_only(capsys, "train.output_dir=/proc/vdp-run", "train.output_dir=runs/default")
    assert code == 0 and stdout.startswith("ok: debug ")
    assert not glob.glob(os.path.join(ROOT, ".vdp-write-check-*")) + glob.glob(os.path.join(ROOT, "runs", ".vdp-*"))
