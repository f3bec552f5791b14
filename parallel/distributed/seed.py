"""Seeding: identical replicated parameters on every rank, and per-block RNG streams.

Each block is initialised inside `init_rng(seed, index)`, a forked RNG seeded from (seed, index)
alone. A block's weights therefore do not depend on which pipeline stage builds it or on what was
built before it, so tp/pp/dp layouts all start from the one-process weights.
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
