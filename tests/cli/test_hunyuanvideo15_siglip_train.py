"""train.py on a HunyuanVideo 1.5 image-to-video folder prepared with SigLIP states (python -m
parallel.prepare_data --image-encoder), one process (as `python` runs it, forked by tests/helpers/commands.py),
one step: its first loss is the loss of that batch (SigLIP rows in) on the model as built from train.seed. The
preparation, the batches and the pipeline's states, in one process: tests/unit/test_hunyuanvideo15_siglip.py."""
import json

import pytest
import torch

from parallel.experiment.config import load_config
from tests.helpers.commands import run_command
from tests.helpers.hunyuanvideo15_captions import release  # noqa: F401  (fixture: text folders)
from tests.helpers.hunyuanvideo15_siglip import IMAGE, ROOT, SETS, _prepare, save_vae, siglip  # noqa: F401  (fixture)
from tests.helpers.prepare_data import videos  # noqa: F401  (fixture: clips)


def test_train_py_first_loss_is_the_batchs(videos, release, siglip, tmp_path):  # noqa: F811
    from parallel.model.build import build_model
    from parallel.distributed.topology import ParallelContext
    from parallel.train.run import build_dataset, training_batches

    root, _ = videos
    save_vae(tmp_path / "vae")
    i2v, out = ["model.image_condition=true"], {"i2v": tmp_path / "i2v"}
    assert _prepare(root, tmp_path / "vae", release[0], out["i2v"], i2v, "--image-encoder", str(siglip[0])) == 0

    # train.py, one process, one step: its loss is the loss of that batch (SigLIP rows in) on the model as
    # built from train.seed.
    sets = SETS + i2v + ["data.kind=directory", f"data.path={out['i2v']}", "train.max_steps=1",
                         "train.grad_accum_steps=1", "val.every=0", "ckpt.every=0", f"train.output_dir={tmp_path / 'run'}"]
    run = run_command(["train.py", "--config", "debug-hunyuan15", "--deepspeed_config", "ds_configs/zero0_fp32.json",
                       *[a for s in sets for a in ("--set", s)]])
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    cfg = load_config("debug-hunyuan15", sets)
    batch, target = next(training_batches(cfg, ParallelContext.single(), build_dataset(cfg)))
    assert batch[2][:, :IMAGE].any(-1).all()
    with torch.no_grad():
        want = build_model(cfg, {}, ParallelContext.single())(batch, target)
    assert len(losses) == 1
    assert losses[0] == pytest.approx(float(want), rel=1e-5)
