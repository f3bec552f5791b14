"""Disk space around checkpoints (parallel/checkpoints/checkpoint.py) and resumed metrics (parallel/validation/media.py),
in one process: the figures a full disk is reported with, and each step once after a resume."""
import json

from parallel.checkpoints.checkpoint import MARKER, predicted_bytes, space_problem
from parallel.validation.media import latest_rows
from parallel.experiment.units import MiB


def complete(directory, step, size):
    folder = directory / f"step{step}"
    folder.mkdir(parents=True)
    (folder / "model_states.pt").write_bytes(b"x" * size)
    (folder / MARKER).write_text(json.dumps({"step": step, "layout": {}, "files": {"model_states.pt": size}}))


def test_first_save_is_not_refused_and_without_a_failure_says_nothing(tmp_path):
    assert space_problem(tmp_path, 3, free=0) == (None, None)


def test_the_first_save_is_checked_against_its_predicted_size(tmp_path):
    """Before any checkpoint the predicted size stands in for the last one's (then the last one's wins):
    fp32 10 parameters all trained: 40 B weights + 80 B moments + 120 B layout-free copy = 240 B; bf16 with an
    EMA: 20 + 10 x 16 + 10 x 16 = 340 B; a LoRA run (1,000 frozen of 1,010) with its base: 2,020 + 160 + 160 + the
    layout-free copy's fp32 base 4,000; with 100 B of buffers (an fp8 base's codes) in both copies, 200 more; without
    the base (lora_base: release) the adapters' 20 + 160 + 160 alone. tests/distributed/test_lora_base.py compares
    these with what the engine writes."""
    assert predicted_bytes(10, 10, "fp32", ema=False) == 240
    assert predicted_bytes(10, 10, "bf16", ema=True) == 340
    assert predicted_bytes(1010, 10, "bf16", ema=True) == 6340
    assert predicted_bytes(1010, 10, "bf16", ema=True, buffer_bytes=100) == 6540
    assert predicted_bytes(1010, 10, "bf16", ema=True, buffer_bytes=100, base=False) == 340
    assert predicted_bytes(10, 10, "fp32", ema=False, layout_free=False) == 120
    error, _ = space_problem(tmp_path, 3, free=3 * MiB, predicted=4 * MiB)
    assert error == (f"checkpoint save to {tmp_path}/step3 stopped: needs ~4.0 MiB (predicted: the first checkpoint), "
                     f"3.0 MiB free on that filesystem; there is no complete checkpoint yet (a rerun starts over)")
    assert space_problem(tmp_path, 3, free=5 * MiB, predicted=4 * MiB)[1].startswith("warning: 5.0 MiB free under")
    complete(tmp_path, 3, 1 * MiB)
    assert space_problem(tmp_path, 6, free=3 * MiB, predicted=4 * MiB) == (None, None)


def test_room_for_two_more_is_quiet_room_for_one_warns_less_stops(tmp_path):
    complete(tmp_path, 3, 4 * MiB)
    assert space_problem(tmp_path, 6, free=9 * MiB) == (None, None)
    error, warning = space_problem(tmp_path, 6, free=5 * MiB)
    assert error is None and warning == (f"warning: 5.0 MiB free under {tmp_path}, room for one more checkpoint "
                                         f"of ~4.0 MiB; the save after step6 will stop the run")
    error, warning = space_problem(tmp_path, 6, free=2 * MiB)
    assert warning is None and error == (
        f"checkpoint save to {tmp_path}/step6 stopped: needs ~4.0 MiB, 2.0 MiB free on that filesystem; the last "
        f"complete checkpoint is {tmp_path}/step3 (resume with the same command once there is space)")


def test_an_overwritten_folder_counts_as_free_and_the_size_is_the_newest_complete(tmp_path):
    complete(tmp_path, 3, 1 * MiB)
    complete(tmp_path, 6, 4 * MiB)
    (tmp_path / "step9").mkdir()                   # a partial save of an earlier run, no marker
    (tmp_path / "step9" / "model_states.pt").write_bytes(b"x" * (3 * MiB))
    assert space_problem(tmp_path, 9, free=6 * MiB) == (None, None)
    assert "needs ~4.0 MiB, 3.0 MiB free" in space_problem(tmp_path, 9, free=0)[0]


def test_a_failed_save_names_the_error_and_whether_anything_can_be_resumed(tmp_path):
    error, _ = space_problem(tmp_path, 3, free=512, failure="RuntimeError: basic_ios::clear: iostream error")
    assert error == (f"checkpoint save to {tmp_path}/step3 failed (RuntimeError: basic_ios::clear: iostream "
                     f"error): 512 B free on that filesystem; there is no complete checkpoint yet (a rerun "
                     f"starts over)")
    complete(tmp_path, 3, 2 * MiB)
    error, _ = space_problem(tmp_path, 6, free=3 * MiB, failure="OSError: [Errno 28] No space left on device")
    assert error.endswith(f"needs ~2.0 MiB, 3.0 MiB free on that filesystem; the last complete checkpoint is "
                          f"{tmp_path}/step3 (resume with the same command once there is space)")


def test_rows_after_a_resume_replace_the_lost_ones():
    first = [{"step": s, "loss": 1.0} for s in range(1, 8)]                  # died at 7, checkpoint at 3
    second = [{"step": 4, "loss": 2.0, "resumed_from": 3}, {"step": 5, "loss": 2.0}]
    rows = latest_rows(first + [{"note": "not a row"}] + second)
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0)]
    assert [r["step"] for r in latest_rows(first + first[2:])] == list(range(1, 8))   # no marker: newest wins
