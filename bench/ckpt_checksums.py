"""What checksumming a checkpoint costs at save: `ranks` processes each write their share of a training
state with torch.save, four ways: plain (as DeepSpeed's save_checkpoint does without checksums: no fsync);
plain, then, after all have written, each CRC-32s its share of the files read back (parallel/checkpoints/
checksums.py: how files nobody hashed while writing are checked); through the CRC-32 writer hashing every
write inline (CrcWriter(inline_below=inf): the CRC's time added to the write's); through the CRC-32 writer
as checkpoints are saved (parallel/distributed/deepspeed/checkpoint.py: a helper thread hashes each large
write while it is written; DeepSpeed's files and the layout-free copy).

    python -m bench.ckpt_checksums                          # the debug preset's checkpoint and a 1.3B state
    python -m bench.ckpt_checksums --sizes 1.3e9 --ranks 8 --dir /scratch/x

A state of P parameters is P x 16 bytes (fp32 weights, two Adam moments, the EMA), plus the same again
for the layout-free copy unless --no-layout-free. The debug preset (configs/debug.yaml, 4 blocks x 64) has
its measured parameter count. Reported per size, the slowest rank's seconds (median of --repeat; the three
writes' order turns by one each repeat, so none always follows the read-back): the plain save, the read-back
checksum, the saves through the inline and the overlapped writer, and each one's ratio to the plain save
(the read-back's: (save + read-back) / save). Nothing is asserted: a shared machine's figures.
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

from parallel.checkpoints.checksums import hash_share  # noqa: E402

BYTES_PER_PARAM = 16
CHUNK = 1 << 30          # bytes per file at most (DeepSpeed writes one or a few files per rank)


def debug_params() -> int:
    """The debug preset's parameter count, counted on the meta device as `python -m models` does."""
    import torch
    from parallel.model.build import layer_specs
    from parallel.experiment.config import load_config
    from parallel.distributed.pipeline import SequentialDiT
    from parallel.distributed.topology import ParallelContext
    from parallel.experiment.units import count_parameters
    with torch.device("meta"):
        return count_parameters(SequentialDiT(layer_specs(load_config("debug"), ParallelContext.single())))


WAYS = ("plain", "inline", "overlapped")


def _save(way: str, buffer, path: str, size: int) -> None:
    import torch
    from parallel.distributed.deepspeed.checkpoint import CrcWriter
    if way == "plain":
        torch.save({"flat": buffer[:size // 4]}, path)
        return
    with open(path, "wb") as raw:
        torch.save({"flat": buffer[:size // 4]}, CrcWriter(raw, **({"inline_below": float("inf")}
                                                                    if way == "inline" else {})))


def _rank(rank: int, world: int, nbytes: int, folder: str, turn: int, barrier, out) -> None:
    """One rank: its share written as files of at most CHUNK bytes (one buffer, saved again under each
    name: memory stays at CHUNK) each of the WAYS (starting at WAYS[turn]), the files removed in between;
    after the plain save, its share of everyone's files read back and checksummed."""
    import torch
    chunks = [min(CHUNK, nbytes - i) for i in range(0, nbytes, CHUNK)]
    buffer = torch.empty(max(chunks) // 4, dtype=torch.float32).fill_(rank + 0.5)
    names = [f"rank{r:03d}_{c:03d}.pt" for r in range(world) for c in range(len(chunks))]
    mine = [os.path.join(folder, f"rank{rank:03d}_{c:03d}.pt") for c in range(len(chunks))]
    seconds = {}
    for way in WAYS[turn:] + WAYS[:turn]:
        barrier.wait()
        tic = time.perf_counter()
        for path, size in zip(mine, chunks):
            _save(way, buffer, path, size)
        seconds[way] = time.perf_counter() - tic
        barrier.wait()          # checkpoint.save reads back once every rank has written
        if way == "plain":
            tic = time.perf_counter()
            hash_share(Path(folder), names, rank, world)
            seconds["reread"] = time.perf_counter() - tic
            barrier.wait()
        for path in mine:
            os.remove(path)
    out.put((rank, seconds))


def measure(nbytes: int, ranks: int, root: str, repeat: int) -> dict:
    runs = []
    ctx = mp.get_context("spawn")
    for turn in range(repeat):
        with tempfile.TemporaryDirectory(dir=root) as folder:
            barrier, out = ctx.Barrier(ranks), ctx.Queue()
            procs = [ctx.Process(target=_rank, args=(r, ranks, nbytes // ranks, folder, turn % len(WAYS),
                                                     barrier, out)) for r in range(ranks)]
            for p in procs:
                p.start()
            got = [out.get()[1] for _ in procs]
            for p in procs:
                p.join()
            runs.append({k: max(g[k] for g in got) for k in got[0]})     # the slowest rank of each phase
    s = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {"bytes": nbytes, "ranks": ranks, "save_s": round(s["plain"], 4),
            "reread_checksum_s": round(s["reread"], 4), "ratio_reread": round((s["plain"] + s["reread"]) / s["plain"], 3),
            "inline_writer_s": round(s["inline"], 4), "ratio_inline": round(s["inline"] / s["plain"], 3),
            "overlapped_writer_s": round(s["overlapped"], 4),
            "ratio_overlapped": round(s["overlapped"] / s["plain"], 3),
            "save_GiB_per_s": round(nbytes / s["plain"] / 2**30, 2)}


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
