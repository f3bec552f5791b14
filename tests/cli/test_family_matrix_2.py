"""The family matrix's second half (test_family_matrix.py says what each family runs through): Wan 2.1, Wan 2.2
A14B, Wan 2.2 TI2V and HunyuanVideo.

- Wan 2.1 (`debug-wan`): dp 2 with ZeRO-3 (the checkpoint's partitions sampled in lockstep and gathered by the
  export); Wan's tensor-parallel q/k RMSNorm across heads runs in the two Wan 2.2 presets below.
- Wan 2.2 A14B (`debug-wan22`, both experts): tp 2 x pp 2, each stage holding both experts' blocks (checkpointed),
  micro-batches mixing them; the export writes transformer/, transformer_2/ and model_index.json.
- Wan 2.2 TI2V (`debug-wan22-ti2v`): a timestep per token split with the tokens under sp, image-to-video from the
  first frame's latents: tp 2 x sp 2.
- HunyuanVideo (`debug-hunyuan`): dual- and single-stream blocks on different pipeline stages (trained and exported at
  tp 2 x pp 2), and the text tokens in the joint sequence under sp (trained and sampled at tp 2 x sp 2).

Cost, measured as test_family_matrix.py's: 17 launches (4 one-process, 3 of 2 ranks, 10 of 4), 470 CPU-seconds
(debug-wan 96, debug-wan22 115, debug-wan22-ti2v 118, debug-hunyuan 140), 15 min wall. Marked `slow`.
"""
from __future__ import annotations

import pytest

from tests.helpers.family_matrix import Runs, run_family

pytestmark = pytest.mark.slow

FAMILIES = {
    "debug-wan": Runs(("dp2-zero3",), sample="dp2-zero3", export="dp2-zero3"),
    "debug-wan22": Runs(("tp2-pp2",), sample="tp2-pp2", export="tp2-pp2"),
    "debug-wan22-ti2v": Runs(("tp2-sp2",), sample="tp2-sp2", export="tp2-sp2"),
    "debug-hunyuan": Runs(("tp2-pp2", "tp2-sp2"), sample="tp2-sp2", export="tp2-pp2"),
}


@pytest.mark.parametrize("preset", FAMILIES)
def test_family_through_the_commands(preset, tmp_path):
    run_family(preset, FAMILIES[preset], tmp_path)
