"""Seeding: identical replicated parameters on every rank, per-block RNG streams, and each rank's training stream.

Each block is initialised inside `init_rng(seed, index)`, a forked RNG seeded from (seed, index)
alone. A block's weights therefore do not depend on which pipeline stage builds it or on what was
built before it, so tp/pp/dp layouts all start from the one-process weights.

Once the model is built, `seed_training_rng` gives each (stage, dp, sp) coordinate its own global stream, which its
tp ranks share: what training draws from it (LoRA's dropout masks, parallel/distributed/layers.py; nothing else
draws from it: parallel/checkpoints/rng.py) is then independent across replicas, token shards and stages, and the
same where tp ranks hold the same input.
"""
from __future__ import annotations

import contextlib
import hashlib
import random

import torch


def derive_seed(seed: int, *index: int | str) -> int:
    digest = hashlib.sha256(":".join(map(str, (seed,) + index)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seed_all(seed: int) -> None:
    """Seed Python and torch (every device) identically; call on every rank before building the model."""
    random.seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def init_rng(seed: int, *index: int | str):
    """Run the body with the CPU RNG seeded from (seed, *index), restoring the outer state after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, *index))
        yield


def training_seed(seed: int, *, pp: int, dp: int, sp: int) -> int:
    """The seed of the global generators of the ranks at (stage pp, replica dp, token shard sp) once the model is built.

    Not seed_all's `seed` on every rank: two dp replicas would draw the same dropout masks for their different
    samples, and the sp ranks' token shards of one sample one mask pattern repeated sp times, where one process
    draws every token's mask independently. Not the tp rank either: the tp ranks of a coordinate must draw the same
    masks, since a column-parallel adapter's input is replicated over them (layers.py: u = A dropout(x), the same
    on every tp rank). (0, 0, 0), a one-process run's only coordinate, keeps `seed` itself, the state seed_all left
    (building draws nothing from it: init_rng), so such a run draws the masks it drew before this stream existed."""
    return seed if pp == dp == sp == 0 else derive_seed(seed, "training-rng", pp, dp, sp)


def seed_training_rng(seed: int, *, pp: int, dp: int, sp: int) -> None:
    """Seed torch's CPU generator and every device's (torch.manual_seed, as seed_all) from `training_seed`; call after
    the build, before the first step. The global generators, not a generator of their own, because activation
    checkpointing (DeepSpeed's and torch's) saves and replays exactly those for the recompute: a recomputed segment
    then drops what its forward dropped."""
    torch.manual_seed(training_seed(seed, pp=pp, dp=dp, sp=sp))
