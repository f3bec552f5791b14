"""What checksumming a checkpoint costs at save: `ranks` processes each write their share of a training
state with torch.save (as DeepSpeed's save_checkpoint does: no fsync); then, after all have written, each
CRC-32s its share of the files read back (parallel/train/checksums.py: how the layout-free copy is
hashed); then the same state written through the CRC-32 writer, the checksums taken while writing (how
DeepSpeed's files are hashed: parallel/distributed/deepspeed/checkpoint.py).

    python -m bench.ckpt_checksums                          # the debug preset's checkpoint and a 1.3B state
    python -m bench.ckpt_checksums --sizes 1.3e9 --ranks 8 --dir /scratch/x

A state of P parameters is P x 16 bytes (fp32 weights, two Adam moments, the EMA), plus the same again
for the layout-free copy unless --no-layout-free. The debug preset (configs/debug.yaml, 4 blocks x 64) has
its measured parameter count. Reported per size, the slowest rank's seconds (median of --repeat): the
save, the read-back checksum, the save through the writer, and the ratios (save + read-back) / save and
(save through the writer) / save. Nothing is asserted: a shared machine's figures.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from parallel.train.checksums import hash_share  # noqa: E402

BYTES_PER_PARAM = 16
CHUNK = 1 << 30          # bytes per file at most (DeepSpeed writes one or a few files per rank)


def debug_params() -> int:
    """The debug preset's parameter count, counted on the meta device as `python -m models` does."""
    import torch
    from parallel.build import layer_specs
    from parallel.config import load_config
    from parallel.distributed.pipeline import SequentialDiT
    from parallel.distributed.topology import ParallelContext
    from parallel.units import count_parameters
    with torch.device("meta"):
        return count_parameters(SequentialDiT(layer_specs(load_config("debug"), ParallelContext.single())))


def _rank(rank: int, world: int, nbytes: int, folder: str, barrier, out) -> None:
    """One rank: its share written as files of at most CHUNK bytes (one buffer, saved again under each
    name: memory stays at CHUNK) with plain torch.save, then its share of everyone's files read back and
    checksummed; the files removed; then written again through the CRC-32 writer (checksums taken while
    writing, as WeightsOnlyCheckpointEngine.save does)."""
    import torch
    from parallel.distributed.deepspeed.checkpoint import CrcWriter
    chunks = [min(CHUNK, nbytes - i) for i in range(0, nbytes, CHUNK)]
    buffer = torch.empty(max(chunks) // 4, dtype=torch.float32).fill_(rank + 0.5)
    names = [f"rank{r:03d}_{c:03d}.pt" for r in range(world) for c in range(len(chunks))]
    mine = [os.path.join(folder, f"rank{rank:03d}_{c:03d}.pt") for c in range(len(chunks))]
    barrier.wait()
    tic = time.perf_counter()
    for path, size in zip(mine, chunks):
        torch.save({"flat": buffer[:size // 4]}, path)
    saved = time.perf_counter() - tic
    barrier.wait()          # checkpoint.save reads back once every rank has written
    tic = time.perf_counter()
    hash_share(Path(folder), names, rank, world)
    reread = time.perf_counter() - tic
    barrier.wait()
    for path in mine:
        os.remove(path)
    barrier.wait()
    tic = time.perf_counter()
    for path, size in zip(mine, chunks):
        with open(path, "wb") as raw:
            torch.save({"flat": buffer[:size // 4]}, CrcWriter(raw))
    out.put((rank, saved, reread, time.perf_counter() - tic))


def measure(nbytes: int, ranks: int, root: str, repeat: int) -> dict:
    runs = []
    ctx = mp.get_context("spawn")
    for _ in range(repeat):
        with tempfile.TemporaryDirectory(dir=root) as folder:
            barrier, out = ctx.Barrier(ranks), ctx.Queue()
            procs = [ctx.Process(target=_rank, args=(r, ranks, nbytes // ranks, folder, barrier, out))
                     for r in range(ranks)]
            for p in procs:
                p.start()
            got = [out.get() for _ in procs]
            for p in procs:
                p.join()
            runs.append([max(g[i] for g in got) for i in (1, 2, 3)])     # the slowest rank of each phase
    save, reread, inline = (statistics.median(r[i] for r in runs) for i in range(3))
    return {"bytes": nbytes, "ranks": ranks, "save_s": round(save, 4), "reread_checksum_s": round(reread, 4),
            "ratio_reread": round((save + reread) / save, 3), "save_with_inline_checksum_s": round(inline, 4),
            "ratio_inline": round(inline / save, 3), "save_GiB_per_s": round(nbytes / save / 2**30, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ckpt_checksums", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="debug,1.3e9", help="parameter counts (or 'debug'), comma-separated")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the files are written (a filesystem "
                    "with room for the largest state)")
    ap.add_argument("--no-layout-free", action="store_true", help="DeepSpeed's files only (ckpt.layout_free=false)")
    args = ap.parse_args(argv)
    rows = []
    for size in args.sizes.split(","):
        params = debug_params() if size == "debug" else int(float(size))
        nbytes = params * BYTES_PER_PARAM * (1 if args.no_layout_free else 2)
        row = {"size": size, "params": params, **measure(nbytes, args.ranks, args.dir, args.repeat)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
