"""bench/step_phases.py's block timer: a block's forward and its backward, whether it is kept whole or checkpointed
by DeepSpeed, on blocks that take and return a tuple as the toolkit's do (nn.Module's full backward hooks fire
before such a block's backward: they counted its forward only). Time is a clock the blocks advance (FORWARD_S a
forward, BACKWARD_S a backward), not sleeps: on a loaded machine a sleep overruns by more than any margin
that would still tell a timer that leaves the backward out."""
import time

import deepspeed
import pytest
import torch
from torch import nn

from bench.step_phases import block_timer

FORWARD_S, BACKWARD_S = 0.04, 0.08


class Clock:
    """time.perf_counter for the test: it moves only when a Slow block runs."""
    now = 0.0

    def __call__(self) -> float:
        return self.now


CLOCK = Clock()


class Slow(torch.autograd.Function):
    """The identity, taking FORWARD_S of CLOCK to run and BACKWARD_S to differentiate."""

    @staticmethod
    def forward(ctx, x):
        CLOCK.now += FORWARD_S
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        CLOCK.now += BACKWARD_S
        return grad


class Block(nn.Module):
    """(x, t) -> (x + t, t) through Slow: what a toolkit block takes and returns."""

    def forward(self, h):
        x, t = h
        return Slow.apply(x) + t, t


@pytest.mark.parametrize("checkpointed", [False, True])
def test_the_timer_counts_each_blocks_forward_and_backward(checkpointed, monkeypatch):
    monkeypatch.setattr(time, "perf_counter", CLOCK)
    blocks = nn.ModuleList([Block(), Block()])

    def run(*h):
        for block in blocks:
            h = block(h)
        return h

    x = torch.randn(2, 4, requires_grad=True)
    t = torch.randn(2, 4, requires_grad=True)
    seconds = {}
    with block_timer(blocks, lambda: None, seconds):
        tic = time.perf_counter()
        out = deepspeed.checkpointing.checkpoint(run, x, t) if checkpointed else run(x, t)
        out[0].sum().backward()
        wall = time.perf_counter() - tic
    # each block: its forward, its backward, and under checkpointing its forward again (recomputed)
    want = len(blocks) * ((2 if checkpointed else 1) * FORWARD_S + BACKWARD_S)
    assert seconds["blocks"] == pytest.approx(want) and wall == pytest.approx(want), (seconds, want, wall)
    assert x.grad is not None and torch.equal(x.grad, torch.ones_like(x))
