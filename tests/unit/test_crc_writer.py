"""The CRC-32 writers checkpoints are saved through: the CRC they keep equals zlib.crc32 of the file's bytes,
and the bytes are those of the plain write (torch.save to the file itself; safetensors' save_file); the
layout-free copy returns the CRC of each file it wrote."""
import math
import zlib

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from parallel.distributed.deepspeed.checkpoint import INLINE, CrcWriter
from parallel.checkpoints import safetensors_crc


def _crc(path) -> str:
    return f"{zlib.crc32(path.read_bytes()):08x}"


def test_overlapped_crc_equals_the_files_crc_for_tiny_straddling_and_large_writes(tmp_path):
    g = torch.Generator().manual_seed(0)
    sizes = [1, 7, 100, INLINE - 1, INLINE, INLINE + 1, 3, 2 * INLINE // 3, 4096]   # inline and threaded, mixed
    data = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8, generator=g).numpy().tobytes()
    ends = torch.tensor(sizes).cumsum(0).tolist()
    pieces = [data[end - n:end] for n, end in zip(sizes, ends)]
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"".join(pieces))
    for inline_below in (INLINE, math.inf, 1):        # overlapped (the default), all inline, all threaded
        path = tmp_path / f"through_{inline_below}.bin"
        with open(path, "wb") as raw:
            writer = CrcWriter(raw, inline_below=inline_below)
            assert [writer.write(p) for p in pieces] == sizes
        assert path.read_bytes() == plain.read_bytes()
        assert writer.hexdigest() == _crc(plain)

    state = {"w": torch.randn(INLINE // 2 + 3, generator=g), "b": torch.randn(5, generator=g), "step": 3,
             "m": torch.randn(64, 64, generator=g).to(torch.bfloat16)}     # torch.save: tiny records, 2 MiB storage
    with open(tmp_path / "state.pt", "wb") as raw:     # a file object: torch.save names the archive as below
        torch.save(state, raw)
    with open(tmp_path / "state_crc.pt", "wb") as raw:
        writer = CrcWriter(raw)
        torch.save(state, writer)
    assert (tmp_path / "state_crc.pt").read_bytes() == (tmp_path / "state.pt").read_bytes()
    assert writer.hexdigest() == _crc(tmp_path / "state.pt")


def test_safetensors_through_the_writer_are_save_files_bytes_and_crc(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {"blocks.0.attn.qkv.weight::param": torch.randn(3 * INLINE // 16, 4, generator=g),  # 3 MiB
               "blocks.0.attn.qkv.weight::exp_avg": torch.randn(48, 8, generator=g),
               "a::ema": torch.randn((), generator=g), "empty": torch.zeros(0, 3),
               "half": torch.randn(5, generator=g).half(), "bf": torch.randn(2, 3, generator=g).bfloat16(),
               "ids": torch.arange(7), "mask": torch.tensor([True, False, True]),
               "u8": torch.arange(5, dtype=torch.uint8), "f64": torch.randn(3, generator=g).double()}
    metadata = {"index": '{"blocks.0.attn.qkv.weight": {"dim": 0, "parts": [8, 8, 8]}, "é": "\t\\"}'}
    save_file(tensors, tmp_path / "plain.safetensors", metadata=metadata)
    crc = safetensors_crc.save(tensors, tmp_path / "crc.safetensors", metadata=metadata)
    assert (tmp_path / "crc.safetensors").read_bytes() == (tmp_path / "plain.safetensors").read_bytes()
    assert crc == _crc(tmp_path / "plain.safetensors")
    back = load_file(tmp_path / "crc.safetensors")
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], v) for k, v in tensors.items())


def test_the_layout_free_copy_returns_the_crc_of_every_file_it_wrote(tmp_path):
    """relayout.write hashes what it writes (rank 0: its safetensors file and state.json), so
    checkpoint._checksum_files reads none of them back."""
    from parallel.checkpoints import relayout
    from parallel.checkpoints.checksums import file_crc32

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(2)
        part = {"tensors": {"blocks.0.w::param": torch.randn(INLINE // 4 + 1, generator=g),
                            "blocks.0.w::exp_avg": torch.randn(3, generator=g)},
                "index": {"blocks.0.w": {"dim": None}}, "keys": ["exp_avg"], "optimizer_step": 2,
                "expert_steps": {}, "schedule": {"last_epoch": 2}, "global_batch": 4}
        crcs = relayout.write(part, tmp_path / "step2", 2, {"tp_size": 1})
    finally:
        dist.destroy_process_group()
    folder = tmp_path / "step2"
    assert crcs == {str(f.relative_to(folder)): file_crc32(f) for f in folder.rglob("*") if f.is_file()}
    assert sorted(crcs) == ["layout_free/rank00000.safetensors", "layout_free/state.json"]
