"""A NCCL double for the commands of tests/cli/test_nccl_double.py (this folder first on their PYTHONPATH, so
Python imports this file at every interpreter start, launcher and ranks alike).

The toolkit's process group is created as it is on CUDA, on this CPU machine: torch.distributed's
init_process_group is wrapped so that the backend the toolkit asks for must be its one decision
(`accelerator.backend()`, "gloo" here), and the group is then created with `accelerator.backend_for("cuda")`
in which "nccl" is replaced by `vdp_nccl_double`: a backend registered for CUDA tensors only, as NCCL is.
A collective on a CPU tensor in a group with no CPU backend then fails exactly as on a GPU ("No backend type
associated with device type cpu"); one on a group with gloo beside it goes through gloo. No CUDA tensor exists
here, so the double's own backend (a gloo one, to satisfy the constructor) never carries a tensor.
"""
import os

DOUBLE = "vdp_nccl_double"


def _install():
    import torch.distributed as dist

    def create(store, rank, size, timeout):
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    dist.Backend.register_backend(DOUBLE, create, devices=["cuda"])
    plain = dist.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        from parallel.distributed import accelerator
        if backend != accelerator.backend():
            raise AssertionError(f"init_process_group(backend={backend!r}): not the toolkit's decision "
                                 f"accelerator.backend() = {accelerator.backend()!r}")
        as_on_cuda = accelerator.backend_for("cuda").replace("nccl", DOUBLE)
        with open(os.environ["VDP_NCCL_DOUBLE_LOG"], "a") as log:
            log.write(f"{os.getpid()} {as_on_cuda}\n")
        return plain(as_on_cuda, *args, **kwargs)

    dist.init_process_group = init_process_group


if os.environ.get("VDP_NCCL_DOUBLE_LOG"):
    _install()
