"""Every family's debug preset through the user's commands (tests/helpers/family_matrix.py `run_family`), here
CogVideoX, STDiT, HunyuanVideo 1.5 and LTX-2; Wan 2.1, Wan 2.2 A14B, Wan 2.2 TI2V and HunyuanVideo in
test_family_matrix_2.py (two modules: pytest-xdist's two workers take one each).

Per family (fp32, global batch 4, 2 steps): `python train.py` in one process (the reference losses); in each of the
family's layouts `python -m parallel.check` (in this process) accepts it, `train.py` in the layout's processes gives
one process's losses and `python -m parallel.plan` (in this process) plans the activations train.py's memory check
measured; then one layout's checkpoint samples (`python -m parallel.sample` in its processes) and one's exports
(`python -m parallel.export`, diffusers where the family has a released format, else the toolkit's); in this process
one process samples from the export what the layout sampled, and `python -m parallel.verify` finds diffusers' model
loaded from it predicting as the toolkit's. The first layout trains under the real launcher (`deepspeed --num_gpus
4 train.py`: fresh interpreters that import the family as a user's do); the other commands run in processes forked
with torchrun's environment from the tests' server that has imported torch and DeepSpeed
(tests/helpers/commands.py: a fresh interpreter spends about 7 CPU-seconds on imports, more than these commands'
work). The layouts (tp 2 x dp 2, tp 2 x pp 2, tp 2 x sp 2, dp 2 ZeRO-3) are the ones that exercise what is the
family's own; each layout's mechanics for every family are checked with in-process ranks in tests/distributed/
(test_*_layouts.py).

- CogVideoX (`debug`): text tokens in the sequence split by sp, and the diffusers export gathered over tp and pp:
  trains at tp 2 x pp 2 and tp 2 x sp 2, samples at tp 2 x sp 2, exports at tp 2 x pp 2 (so the export's sample is
  also the other layout's checkpoint's).
- STDiT (`debug-stdit`): spatial and temporal attention re-split under sp, no released format (the toolkit's export,
  sp ranks writing one copy): trains at tp 2 x sp 2 and tp 2 x dp 2, samples at tp 2 x dp 2 (data-parallel replicas
  split the prompts), exports at tp 2 x sp 2.
- HunyuanVideo 1.5 (`debug-hunyuan15`): 16 text rows (image, byT5, Qwen) in the joint sequence: tp 2 x sp 2.
- LTX-2 (`debug-ltx2`): the audio stream beside the video (whole on every sp rank), its own sampler and two
  captions per prompt: tp 2 x sp 2. It starts where a user starts: `python -m parallel.prepare_data` on the tiny
  random release and clips of tests/helpers/ltx2_release.py (at the release's sizes) writes the folder every run
  trains from (`data.kind=directory`: video and audio latents, both caption states), and parallel.sample takes two
  of its caption files as the prompts and its uncond.safetensors as the negative prompt.

Cost, measured one module at a time on the 2-core machine beside other work (2026-11-28): here 19 commands, 4
of them under the launcher, 216 CPU-seconds and 297 s wall (debug 84 s, debug-hunyuan15 78, debug-stdit 64,
debug-ltx2 64); with test_family_matrix_2.py 403 CPU-seconds for the eight families, where every command in a fresh
interpreter (each layout under the launcher) took 951. Marked `slow`: `-m "not slow"` leaves it out; `.ci/run` runs it.
"""
from __future__ import annotations

import pytest

from tests.helpers.family_matrix import Runs, run_family
from tests.helpers.ltx2_release import matrix_data

pytestmark = pytest.mark.slow

FAMILIES = {
    "debug": Runs(("tp2-pp2", "tp2-sp2"), sample="tp2-sp2", export="tp2-pp2"),
    "debug-stdit": Runs(("tp2-sp2", "tp2-dp2"), sample="tp2-dp2", export="tp2-sp2"),
    "debug-hunyuan15": Runs(("tp2-sp2",), sample="tp2-sp2", export="tp2-sp2"),
    "debug-ltx2": Runs(("tp2-sp2",), sample="tp2-sp2", export="tp2-sp2", data=matrix_data),
}


@pytest.mark.parametrize("preset", FAMILIES)
def test_family_through_the_commands(preset, tmp_path):
    run_family(preset, FAMILIES[preset], tmp_path)
