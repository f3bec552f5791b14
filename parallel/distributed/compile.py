"""Regional compilation (`train.compile`): torch.compile on each block, one graph per block class.

Every instance of the family's layer class calls one `torch.compile`d `layer_class.forward` with
itself as an argument. With `inline_inbuilt_nn_modules` (torch >= 2.5's default) dynamo lifts the
parameters to graph inputs instead of guarding on the module, so L blocks of one class share one
compiled graph: compile time is one block's, not the model's, and every pipeline stage compiles it once.
With activation checkpointing there are two: DeepSpeed's checkpoint runs the forward under no_grad and
the recomputation with grad. Everything around the blocks (embedding, final layer, loss, DeepSpeed's engine, deepspeed.checkpointing's
recomputation wrapper) stays eager, so checkpointing, ZeRO's hooks and the pipeline schedule see
ordinary modules.

Inside a block, the tensor-parallel collectives (parallel/distributed/comm.py: the all-reduce one operator,
the rest autograd Functions around torch.distributed calls) and the Ulysses all-to-alls are traced or
graph-broken by dynamo as it decides; `compile_stats()` reports graphs and breaks so the bench and the tests
can say which. Measured here (tests/distributed/test_compile_layouts.py): no graph break at tp 2 (the
collectives are in the graph), sp 2, pp 2, ZeRO 1 and 2; ZeRO-3 trains to the same losses but breaks the graph
at its parameter-gathering hooks (36 breaks a step for the 2-block debug model). An autograd Function's forward
must not return a tensor it also holds under another name, which torch 2.11 compiles to a zero gradient
(comm.py's docstring; parallel/distributed/deepspeed/ulysses.py for DeepSpeed's all-to-all).
"""
from __future__ import annotations

import os
import shutil
import types

import torch
from torch import nn

MIN_TORCH = (2, 5)          # parameters inlined as graph inputs (inline_inbuilt_nn_modules) by default


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def compile_problems(enabled: bool, backend: str, src: str = "train.compile", cpu: bool = True) -> list[str]:
    """What stops `train.compile: true` here, each naming the key and what would work (empty: it can run).
    `cpu`: the accelerator is the CPU, where inductor compiles generated C++; elsewhere it generates Triton kernels,
    whose launchers Triton builds with a C compiler (the CC variable, else cc, gcc or clang)."""
    if not enabled:
        return []
    problems = []
    if _torch_version() < MIN_TORCH:
        problems.append(f"{src}=true needs torch >= {'.'.join(map(str, MIN_TORCH))} (regional compilation shares "
                        f"one graph between blocks only from there); found torch {torch.__version__}: upgrade torch "
                        f"or set train.compile=false")
    if backend == "inductor" and cpu and shutil.which("g++") is None and shutil.which("c++") is None:
        problems.append(f"{src}=true with train.compile_backend=inductor needs a C++ compiler on this CPU host "
                        f"(inductor generates C++); install g++ or set train.compile_backend=aot_eager")
    if backend == "inductor" and not cpu and not os.environ.get("CC") and \
            not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        problems.append(f"{src}=true with train.compile_backend=inductor needs a C compiler on this host (Triton "
                        f"builds each kernel's launcher with one: $CC, cc, gcc or clang); install gcc or set "
                        f"train.compile_backend=aot_eager")
    return problems


RECOMPILE_LIMIT = 64      # graphs of one block class: 2 (checkpointed) x its variants x step shapes (buckets)


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """t with row-major strides: contiguous, and the strides of size-1 dimensions (which `contiguous()`
    leaves as they are: a [1, S/sp, H] slice of [1, S, H] keeps stride S H) recomputed by the flat view."""
    return t.contiguous().view(-1).view(t.shape)


def compile_layers(model: nn.Module, layer_class: type, backend: str = "inductor", tables=None) -> int:
    """Compile every `layer_class` instance of `model` in place; returns how many.

    One compiled function per class, called with the block as an argument (its parameters become graph
    inputs). The stage tuple gets row-major strides first: dynamo guards on strides, and under sequence
    parallelism the first block's x is a view of the full sequence ([B, S/sp, H] with S's strides) while
    the next blocks' are not, which would compile the same graph twice.

    `tables(block)`: what the block reads that must be built eagerly before each compiled call, each with a
    `warm(device)` (parallel/model/build.py passes models.geometry.position_caches: a table the trace built itself
    would compile each step shape twice).
    """
    # One graph per step shape (buckets: each bucket's sequence length; dynamic=False keeps every graph static)
    # and two per shape under activation checkpointing (the no-grad forward, the recomputation): past dynamo's
    # recompile limit (8 per function) it would run the block eager with only a warning.
    import torch._dynamo.config as dynamo_config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    compiled = torch.compile(layer_class.forward, backend=backend, dynamic=False)
    blocks = [m for m in model.modules() if isinstance(m, layer_class)]
    for block in blocks:
        block.forward = types.MethodType(_compiled_forward(compiled, tables(block) if tables else []), block)
    return len(blocks)


def _compiled_forward(compiled, caches: list):
    """A block's forward through `compiled`, after each of `caches` is warmed on the inputs' device."""
    def forward(self, inputs):
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
        for cache in caches:
            cache.warm(device)
        return compiled(self, tuple(_canonical(t) if isinstance(t, torch.Tensor) else t for t in inputs))
    return forward


def compile_stats(reset: bool = False) -> dict:
    """Dynamo's counters since the last reset: graphs compiled (a recompilation is one more) and graph
    breaks, with their reasons."""
    from torch._dynamo.utils import counters
    stats = {"graphs": counters["stats"].get("unique_graphs", 0),
             "graph_breaks": sum(counters["graph_break"].values()),
             "break_reasons": sorted(counters["graph_break"])}
    if reset:
        counters.clear()
    return stats
