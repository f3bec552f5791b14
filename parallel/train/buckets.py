"""The bucket schedule: which bucket (the samples of one shape, parallel/experiment/shapes.py) each training step uses.

A manifest line may give its sample's shape, `"shape": [frames, height, width]` in pixels (what
`python -m parallel.prepare_data --buckets` writes, parallel/experiment/manifest.py reads); a line without one has the config's
data.num_frames x data.height x data.width. Samples of one shape form a bucket. Every step's global
batch comes from one bucket, so the (tp, sp, pp) ranks of a step agree on the token grid:

    bucket(step) = the b with cum[b-1] <= r < cum[b],  r = floor(u N),  u = derive_seed(seed, "bucket", step) / 2^63

(N samples, cum the running bucket sizes): a function of (seed, step) alone, identical on every rank,
with probability n_b / N. Inside bucket b the step reads bucket positions [c G, (c + 1) G), c = the
steps before `step` that chose b (replayed from (seed, step), so resuming at step s needs only s), each
position through the bucket's own per-epoch permutation. With one bucket this is the plain walk
through the dataset: position s G + j, permutation (seed, "epoch", e) over all samples.
"""
from __future__ import annotations

import bisect
from typing import Optional, Sequence

import torch

from parallel.distributed.seed import derive_seed
from parallel.experiment.shapes import Shape, format_shape


class BucketSchedule:
    """Which bucket each step uses and which of its samples: see the module docstring."""

    def __init__(self, shapes: Optional[Sequence[Optional[Shape]]], num_samples: int, seed: int, global_batch: int):
        shapes = list(shapes) if shapes is not None else [None] * num_samples
        self.keys = sorted(set(shapes), key=lambda s: (s is not None, s or ()))
        self.members = [[i for i, s in enumerate(shapes) if s == k] for k in self.keys]
        self.cum = [sum(len(m) for m in self.members[:b + 1]) for b in range(len(self.keys))]
        self.seed, self.global_batch, self.total = seed, global_batch, num_samples
        self._replayed = (0, [0] * len(self.keys))   # (step, steps before it per bucket)
        self._perm: dict = {}

    def __len__(self) -> int:
        return len(self.keys)

    def bucket(self, step: int) -> int:
        """The bucket of global step `step` (an index into `keys`)."""
        if len(self.keys) == 1:
            return 0
        r = derive_seed(self.seed, "bucket", step) * self.total >> 63    # floor(u N), exact in integers
        return bisect.bisect_right(self.cum, r)

    def steps_before(self, step: int) -> int:
        """How many steps before `step` chose `bucket(step)`."""
        if len(self.keys) == 1:
            return step
        at, counts = self._replayed
        if step < at:
            at, counts = 0, [0] * len(self.keys)
        counts = list(counts)
        for s in range(at, step):
            counts[self.bucket(s)] += 1
        self._replayed = (step, counts)
        return counts[self.bucket(step)]

    def sample(self, step: int, j: int) -> int:
        """Dataset index of position j (0 <= j < global batch) of `step`'s global batch."""
        b = self.bucket(step)
        members, position = self.members[b], self.steps_before(step) * self.global_batch + j
        n, epoch = len(members), position // len(members)
        key = (self.seed, "epoch", epoch) if len(self.keys) == 1 else (self.seed, "epoch", "bucket", b, epoch)
        if (b, epoch) not in self._perm:
            if len(self._perm) > 4 * len(self.keys):
                self._perm.clear()
            self._perm[(b, epoch)] = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(*key)))
        return members[int(self._perm[(b, epoch)][position % n])]

    def summary(self) -> str:
        return ", ".join(f"{format_shape(k)}: {len(m)}" for k, m in zip(self.keys, self.members))

