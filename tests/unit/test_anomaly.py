"""The anomaly guard's per-rank judgement (parallel/train/anomaly.py), one process: non-finite values, the
spike test against the running median, and an unreadable sample replaced by zeros of its bucket's shapes."""
import pytest
import torch

from parallel.experiment.config import AnomalyConfig
from parallel.train.anomaly import AnomalyGuard, GuardedSamples


def test_non_finite_and_spikes_against_the_median_of_the_applied_steps():
    guard = AnomalyGuard(AnomalyConfig(spike_factor=3.0, window=4, min_history=3))
    assert guard.local_reason(float("nan"), 1.0) == "loss nan is not finite"
    assert guard.local_reason(0.5, float("inf")) == "gradient norm inf is not finite"
    guard.history.extend([1.0, 0.2, 0.4])               # median 0.4
    assert guard.local_reason(1.2, 1.0) is None          # 3.0 x 0.4 is not exceeded
    assert guard.local_reason(1.3, 1.0) == ("loss 1.3000 is 3.2x the median 0.4000 of the last 3 steps "
                                            "(train.anomaly.spike_factor=3)")
    guard.history.extend([2.0, 2.0])                     # window 4: the oldest two fall out, median 1.2
    assert guard.local_reason(1.3, 1.0) is None
    assert AnomalyGuard(AnomalyConfig(), values=False).local_reason(float("nan"), None) is None


class Files:
    """A directory dataset's stand-in: sample 1's file cannot be read any more."""
    shapes = [(9, 64, 64)] * 3
    items = [("v0.safetensors", None), ("v1.safetensors", None), ("v2.safetensors", None)]

    def __len__(self):
        return 3

    def __getitem__(self, i):
        if i == 1:
            raise RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")
        return torch.full((4, 3, 8, 8), float(i + 1)), torch.ones(8, 32)

    def label(self, i):
        return f"sample {i}"


def test_an_unreadable_sample_becomes_zeros_of_its_bucket_and_is_recorded():
    guard = AnomalyGuard(AnomalyConfig())
    data = GuardedSamples(Files(), guard)
    latent, text = data[1]
    assert torch.equal(latent, torch.zeros(4, 3, 8, 8)) and torch.equal(text, torch.zeros(8, 32))
    assert guard.bad_samples == ["v1.safetensors (RuntimeError: PytorchStreamReader failed reading zip archive: "
                                 "failed finding central directory)"]
    assert guard.local_reason(0.5, 1.0).startswith("unreadable sample v1.safetensors (RuntimeError")
    assert torch.equal(data[2][0], torch.full((4, 3, 8, 8), 3.0)) and data.label(2) == "sample 2" and len(data) == 3
    with pytest.raises(ValueError, match="spike_factor"):
        AnomalyConfig(spike_factor=0.5)
