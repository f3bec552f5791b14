"""Start gloo ranks in-process with torch.multiprocessing (forked from a server that has imported torch and
DeepSpeed once: PRELOAD), so a benchmark (and the distributed tests:
tests.dist_utils imports it from here) needs no launcher.

`run_ranks(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in every rank with the
process group initialised, and returns the ranks' return values (picklable) in rank order.
An exception in any rank fails the caller with that rank's traceback.

The ranks meet through a file, not a TCP port: `init_method="file://<the run's temp dir>/rendezvous"`.
Nothing is chosen in advance that another process could take before the ranks bind it (the race the
old free_port() + MASTER_PORT had: it was seen as a flaky failure); gloo's own connections between the
ranks bind port 0 and exchange their addresses through that file. MASTER_ADDR/MASTER_PORT are removed
from the ranks' environment, so code that would initialise from env:// fails loudly instead of racing.
`deepspeed.init_distributed` (build_trainer calls it in the ranks) finds torch.distributed initialised
and only wraps the existing group.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks are forked from a server process that has imported these once (multiprocessing's forkserver), not
# started afresh: a spawned rank spent seconds of CPU importing torch, DeepSpeed and dynamo (which torch
# imports at the first optimizer or decomposition) before its first line of work. The server is started
# at the first run_ranks of this process and only imports (as DataLoader workers are forked after torch's
# import): no process group, no tensors, nothing a fork could copy half-done.
PRELOAD = ["torch", "torch._dynamo", "deepspeed", "models.registry", "parallel.train.trainer"]
mp.set_forkserver_preload(PRELOAD)


def _entry(rank, world_size, rendezvous, fn, args, result_dir, environ, cwd):
    # The caller's environment and folder at the call, as a spawned rank had them (a forked one starts with
    # the server's, from when the server started)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    path = os.path.join(result_dir, f"rank{rank}.pt")
    try:
        out = fn(rank, world_size, *args)
        dist.barrier()                  # no rank tears down while a peer may still be talking to it
        torch.save({"ok": True, "value": out}, path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Leave without the interpreter's finalisation. A rank that had saved its results was once seen to
    # die there with SIGABRT ("terminate called without an active exception", in CI): C++ threads of
    # the process groups DeepSpeed creates are destroyed during interpreter teardown (pytorch#179291).
    # The results are on disk; nothing after this point can change them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args, timeout: float = 300):
    with tempfile.TemporaryDirectory() as result_dir:
        rendezvous = os.path.join(result_dir, "rendezvous")       # a fresh file per run: torch's FileStore
        ctx = mp.start_processes(_entry, nprocs=world_size, join=False, start_method="forkserver",
                                 args=(world_size, rendezvous, fn, args, result_dir, dict(os.environ), os.getcwd()))
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=2):
                if time.monotonic() > deadline:
                    for proc in ctx.processes:
                        proc.kill()
                    raise AssertionError(f"ranks did not finish within {timeout} s")
        except Exception as e:
            errors, finished = [], []
            for r in range(world_size):
                p = os.path.join(result_dir, f"rank{r}.pt")
                if os.path.exists(p):
                    res = torch.load(p, weights_only=False)
                    if res["ok"]:
                        finished.append(r)
                    else:
                        errors.append(f"--- rank {r} ---\n{res['error']}")
            done = f" (ranks {finished} had saved their results)" if finished else " (no rank had finished)"
            raise AssertionError("\n".join(errors) or str(e) + done) from None
        return [torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False)["value"]
                for r in range(world_size)]
