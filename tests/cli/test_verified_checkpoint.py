"""Checkpoints verified (train.py, one process): each file's CRC-32 is in the marker; a flipped byte in the
newest checkpoint (same size, so only the checksum can tell) is named at resume and the previous one
resumes to the uninterrupted run's loss (python -m parallel.export and parallel.sample name it too and read
the previous one); the damaged folder is moved aside when its step is saved again, never written over;
`--checkpoint N` picks a checkpoint in train.py, export, sample and verify alike (an unknown step refused with
the steps there are before any engine; the old spellings --tag and --resume still work); export says the step it
read and writes over an existing folder only with --overwrite; verify --checkpoint N holds that export to the
checkpoint; a changed schedule is said in one line; ckpt.layout_free=false writes DeepSpeed's files only;
ckpt.keep prunes to the newest."""
import json
import zlib

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.helpers.commands import run_command
from tests.helpers.train_cli import train_py as _train_py


def train_py(out, *args):
    return _train_py("--config", "debug", "--deepspeed_config", "ds_configs/zero0_fp32.json", "--set",
                     "train.output_dir=" + str(out), "--set", "train.decay_steps=10", "--set", "ckpt.every=1", *args)


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def contents(folder):
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def test_a_flipped_byte_is_named_the_previous_checkpoint_resumes_and_nothing_is_written_over(tmp_path, capsys):
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    p = train_py(out, "--set", "train.max_steps=3", "--set", "ckpt.keep=2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(x.name for x in ckpt.iterdir() if x.is_dir()) == ["step2", "step3"]      # keep 2: step1 pruned
    whole = rows(out)
    marker = json.loads((ckpt / "step3" / "complete.json").read_text())
    for name, (size, crc) in marker["files"].items():
        data = (ckpt / "step3" / name).read_bytes()
        assert len(data) == size and f"{zlib.crc32(data):08x}" == crc, name
    assert any(n.startswith("layout_free/") for n in marker["files"])
    assert marker["schedule"]["train.lr"] == 3e-3 and marker["data_order"]["train.seed"] == 1234

    victim = ckpt / "step3" / "mp_rank_00_model_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    flipped = contents(ckpt / "step3")
    crc = f"{zlib.crc32(bytes(data)):08x}"
    damaged = (f"checkpoint {ckpt}/step3 is damaged (mp_rank_00_model_states.pt has crc32 {crc}, "
               f"{marker['files']['mp_rank_00_model_states.pt'][1]} was written: its bytes changed since the save); "
               f"trying the previous one")
    # python -m parallel.export and parallel.sample verify too: they name step3 and read step2. A step that is not
    # there (the old spelling --tag, which now takes N as well as stepN) and a folder that holds files are refused
    # before any engine; the advice followed exports, and says which step it read.
    from parallel.export import main as export_main
    from parallel.sample import main as sample_main
    base = ["--config", "debug", "--deepspeed-config", "zero0_fp32", "--set", "train.output_dir=" + str(out)]
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "notes.txt").write_text("mine")
    assert export_main([*base, "--tag", "4", "--format", "diffusers", "--out", str(tmp_path / "export")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "note: --tag is now --checkpoint (the old spelling still works)",
        "python -m parallel.export refused (2 problems):",
        f"  - --out {tmp_path / 'export'} already holds notes.txt: add --overwrite to write over it (files of other "
        f"names are left), or give another --out",
        f"  - --checkpoint 4: {ckpt}/step4 is not a complete checkpoint (ckpt.dir {ckpt} holds step2, step3); name "
        f"one of those, or --checkpoint latest for the newest usable"]
    p = run_command(["-m", "parallel.export", *base, "--checkpoint", "latest", "--overwrite", "--format", "diffusers",
                     "--out", tmp_path / "export"])
    assert p.returncode == 0 and damaged in p.stderr, p.stderr[-3000:]
    assert f"weights: {ckpt}/step2 (step 2)\n" in p.stdout and (tmp_path / "export" / "notes.txt").is_file()
    with safe_open(tmp_path / "export" / "diffusion_pytorch_model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "step": "2", "checkpoint": f"{ckpt}/step2", "weights": "model"}
    # verify --checkpoint 2: the export predicts in diffusers what step2 predicts in the toolkit
    p = run_command(["-m", "parallel.verify", *base, "--checkpoint", "step2", "--set",
                     f"model.init_from={tmp_path / 'export'}"])
    assert p.returncode == 0 and "equal at --tolerance 0.0001" in p.stdout, p.stderr[-3000:]
    assert f"weights: {ckpt}/step2 (step 2)\n" in p.stdout
    assert sample_main([*base, "--checkpoint", "9", "--prompt-embeds", "p.safetensors", "--out", "s"]) == 1
    assert (f"  - --checkpoint 9: {ckpt}/step9 is not a complete checkpoint (ckpt.dir {ckpt} holds step2, step3); "
            f"name one of those, or --checkpoint latest for the newest usable") in capsys.readouterr().err
    save_file({"embeds": torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(7))}, tmp_path / "p.safetensors")
    p = run_command(["-m", "parallel.sample", "--config", "debug", "--deepspeed_config", "ds_configs/zero0_fp32.json",
                     "--set", "train.output_dir=" + str(out), "--prompt-embeds", tmp_path / "p.safetensors", "--steps",
                     "1", "--guidance", "1", "--out", tmp_path / "sample.safetensors"])
    assert p.returncode == 0 and damaged in p.stderr, p.stderr[-3000:]
    assert f"weights: {ckpt}/step2 (step 2)" in p.stdout, p.stdout[-2000:]
    p = train_py(out, "--set", "train.max_steps=3", "--set", "ckpt.keep=2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert damaged in p.stderr
    assert f"resumed from {ckpt}/step2 at step 2" in p.stdout
    assert rows(out)[-1]["step"] == 3 and rows(out)[-1]["loss"] == whole[2]["loss"]
    assert (f"checkpoint {ckpt}/step3 (damaged: mp_rank_00_model_states.pt has crc32 {crc}") in p.stderr
    assert f"moved to {ckpt}/step3.damaged, not written over" in p.stderr
    assert contents(ckpt / "step3.damaged") == flipped and (ckpt / "latest").read_text() == "step3"

    # --resume 2 with another learning rate: said in one line; the good step3 is moved aside, not written over.
    p = train_py(out, "--resume", "2", "--set", "train.max_steps=3", "--set", "train.lr=0.001",
                 "--set", "ckpt.layout_free=false", "--set", "ckpt.keep=5")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from {ckpt}/step2 at step 2" in p.stdout
    assert (f"resuming {ckpt}/step2 with the schedule (train.lr 0.003 -> 0.001) changed: the steps after it are "
            f"not the ones the run that wrote it would have taken") in p.stdout
    assert f"checkpoint {ckpt}/step3 (complete, from an earlier run) moved to {ckpt}/step3.replaced" in p.stderr
    assert not (ckpt / "step3" / "layout_free").exists() and (ckpt / "step3.replaced" / "layout_free").is_dir()
    assert rows(out)[-1]["loss"] == whole[2]["loss"]       # step 3's loss is computed before its update
    assert "note: --resume is now --checkpoint (the old spelling still works)" in p.stderr
    import train           # a refusal before any process group: train.py's main in this process
    assert train.main(["--config", "debug", "--deepspeed_config", "ds_configs/zero0_fp32.json", "--set",
                       f"train.output_dir={out}", "--checkpoint", "7", "--set", "train.max_steps=3"]) == 1
    assert capsys.readouterr().err.splitlines()[-2:] == [
        "train.py refused (1 problem):",
        f"  - --checkpoint 7: {ckpt}/step7 is not a complete checkpoint (ckpt.dir {ckpt} holds step2, step3); name "
        f"one of those, or --checkpoint latest for the newest usable"]
