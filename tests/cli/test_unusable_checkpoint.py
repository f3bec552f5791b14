"""train.py with a ckpt.dir whose only checkpoint it cannot continue (written for another model, or damaged):
refused before anything starts, naming the folder, what is wrong and what would work, and the checkpoint's
bytes are left as they were (a silent start from step 0 would overwrite them with its first save); the
advice, followed, trains."""
import shutil

from tests.helpers.train_cli import train_py as _train_py


def train_py(out, *args):
    return _train_py("--config", "debug", "--deepspeed_config", "ds_configs/zero0_fp32.json", "--set",
                     "train.max_steps=2", "--set", f"train.output_dir={out}", *args)


def contents(folder):
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def test_an_only_checkpoint_that_cannot_be_continued_is_refused_and_kept(tmp_path, capsys):
    out = tmp_path / "run"
    assert train_py(out).returncode == 0
    ckpt = out / "checkpoints"
    written, metrics = contents(ckpt), (out / "metrics.jsonl").read_bytes()

    # Another model: the marker's record against this run's config.
    wider = ["--set", "model.hidden_size=128", "--set", "model.head_dim=32", "--set", "train.max_steps=4"]
    p = train_py(out, *wider)
    assert p.returncode == 1
    assert (f"{ckpt} (ckpt.dir) has no checkpoint this run can continue: {ckpt}/step2 was written for another "
            f"model (model.hidden_size=64 there, 128 here; model.head_dim=16 there, 32 here;") in p.stderr
    assert (f"Starting from step 0 would overwrite it, so nothing was started. Set those keys back to resume it, or "
            f"set a fresh ckpt.dir (--set ckpt.dir=<empty folder>) to train from step 0 beside it, or move "
            f"{ckpt}/step2 out of {ckpt} to train from step 0 there") in p.stderr
    assert "Traceback" not in p.stderr and "deepspeed" not in p.stdout.lower()
    assert contents(ckpt) == written and (out / "metrics.jsonl").read_bytes() == metrics
    p = train_py(out, *wider, "--set", f"ckpt.dir={tmp_path / 'fresh'}")       # the advice: a fresh ckpt.dir
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "fresh" / "step4").is_dir() and contents(ckpt) == written

    # Damaged (a copy cut short): every complete checkpoint is, so none is resumed and none overwritten. A refusal
    # before any process group, as above: train.py's main in this process.
    import torch.distributed as dist
    import train
    victim = next((ckpt / "step2").glob("*model_states.pt"))
    victim.write_bytes(victim.read_bytes()[:100])
    damaged = contents(ckpt)
    assert train.main(["--config", "debug", "--deepspeed_config", "ds_configs/zero0_fp32.json", "--set",
                       f"train.output_dir={out}", "--set", "train.max_steps=4"]) == 1
    assert not dist.is_initialized()
    assert (f"{ckpt} (ckpt.dir) has no checkpoint this run can continue: {ckpt}/step2 is damaged ({victim.name} "
            f"has 100 bytes, {len(written[f'step2/{victim.name}'])} were written). Starting from step 0 would "
            f"overwrite it, so nothing was started. Put the files back whole") in capsys.readouterr().err
    assert contents(ckpt) == damaged
    shutil.move(ckpt / "step2", tmp_path / "step2")           # the advice: move it out of ckpt.dir
    p = train_py(out, "--set", "train.max_steps=4")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" not in p.stdout and (ckpt / "step4").is_dir()
    assert contents(tmp_path / "step2") == {k[len("step2/"):]: v for k, v in damaged.items() if k.startswith("step2/")}
