"""The CPU accelerator's shared-memory all-reduce buffer, unnamed once every rank has mapped it.

unlink_shm_buffer()  (0.19.8)
    does     removes the name of this rank's shared-memory all-reduce buffer (/dev/shm), once every rank
             of the job has mapped every other's (call after init_distributed and a barrier)
    why      on the CPU accelerator, when LOCAL_SIZE equals the world size (the deepspeed launcher sets
             it), init_distributed creates a 69 MB /dev/shm file per rank and never removes it: every
             run, finished or killed, leaks them (/dev/shm is RAM; a day of test runs held 18 GiB). A
             mapped file without a name lives until its last process exits
    relies   shm.cpp's name "deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>",
             created and mapped by every rank inside TorchBackend.__init__ (shm_comm_op.initialize)

build_op()  (0.19.8; `python -m parallel.distributed.deepspeed.shm`, which scripts/env.sh runs once per environment)
    does     JIT-builds that all-reduce's C++ op (deepspeed_shm_comm) into $TORCH_EXTENSIONS_DIR now, in one process
    why      every rank's init_distributed loads it, and the first start of a fresh environment builds it: one rank
             builds, the others wait on its lock (parallel/distributed/extensions.py); two jobs starting side by side
             in a fresh environment (two test workers) race for it, and a job in another PID namespace (a netns test
             node, a container) cannot see the builder and takes its lock for a killed build's
    relies   deepspeed.comm.torch.build_shm_op (None where the accelerator has no such op: CUDA, NPU)
"""
from __future__ import annotations

import os

import torch

SHM_BUFFER = "/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"


def unlink_shm_buffer() -> None:
    """See the module docstring. Every rank must have returned from init_distributed (a barrier) first: a
    rank still in it opens its peers' buffers by name."""
    if os.environ.get("LOCAL_SIZE") != str(torch.distributed.get_world_size()):
        return                                  # DeepSpeed's shm all-reduce is off: no buffer was created
    name = SHM_BUFFER.format(uid=os.getuid(), addr=os.environ.get("MASTER_ADDR", ""),
                             port=os.environ.get("MASTER_PORT", ""), rank=torch.distributed.get_rank())
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


def build_op() -> None:
    """See the module docstring: builds the op, or nothing where the accelerator has none."""
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()


if __name__ == "__main__":
    build_op()
