"""Spawn gloo ranks in-process with torch.multiprocessing, so distributed tests need no launcher.

`run_ranks(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in every rank with the
process group initialised, and returns the ranks' return values (picklable) in rank order.
An exception in any rank fails the test with that rank's traceback.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, result_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    path = os.path.join(result_dir, f"rank{rank}.pt")
    try:
        out = fn(rank, world_size, *args)
        torch.save({"ok": True, "value": out}, path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 300):
    with tempfile.TemporaryDirectory() as result_dir:
        ctx = mp.start_processes(_entry, args=(world_size, free_port(), fn, args, result_dir),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=2):
                if time.monotonic() > deadline:
                    for proc in ctx.processes:
                        proc.kill()
                    raise AssertionError(f"ranks did not finish within {timeout} s")
        except Exception as e:
            errors = []
            for r in range(world_size):
                p = os.path.join(result_dir, f"rank{r}.pt")
                if os.path.exists(p):
                    res = torch.load(p, weights_only=False)
                    if not res["ok"]:
                        errors.append(f"--- rank {r} ---\n{res['error']}")
            raise AssertionError("\n".join(errors) or str(e)) from None
        return [torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False)["value"]
                for r in range(world_size)]
