"""The helpers and fixtures of tests/unit/test_plan.py that other test modules use too: `B`, `GiB`, `STATES`, `cli`,
`saved_bytes` (a test module imports no other test module)."""
from __future__ import annotations


import torch

from parallel.train.probe import graph_saved, storage_key


GiB = 2 ** 30


def saved_bytes(run, module):
    """Run `run()` under saved-tensor hooks, plus the inputs DeepSpeed's checkpoints keep on the graph.
    Returns the bytes of distinct storages, the module's parameters and buffers skipped, and the output."""
    seen = {}

    def pack(t):
        seen.setdefault(storage_key(t), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    graph_saved(out, seen)
    skip = {storage_key(t) for t in (*module.parameters(), *module.buffers())}
    total = sum(t.untyped_storage().nbytes() for k, t in seen.items() if k not in skip)
    return total, out


B = 2


STATES = ("parameters", "gradients", "adam_moments", "master_weights", "ema_shadow")


def cli(capsys, *argv):
    from parallel.plan.cli import main
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err
