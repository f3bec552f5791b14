"""safetensors files written through the CRC-32 writer: the bytes of safetensors.torch.save_file, hashed as
they are written, so a checkpoint's layout-free copy (parallel/checkpoints/relayout.py) needs no read-back.

The format (safetensors 0.x): an 8-byte little-endian header length n, n bytes of JSON padded with spaces
to a multiple of 8, then every tensor's bytes in the header's order:

    {"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...}

save_file orders the tensors by dtype (widest first, DTYPES below) then name, and writes its JSON compactly;
so does `save`, so the two files are the same bytes (tests/unit/test_crc_writer.py) when the metadata has
one key, as the layout-free copy's has (save_file writes several in a random order: a Rust HashMap). Each tensor is written
straight from its storage, as save_file does: the only difference is the CRC-32 taken on the way."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Optional

import torch

from parallel.distributed.deepspeed.checkpoint import CrcWriter

# safetensors' Dtype order, widest first (its sort key; measured against save_file 0.8)
DTYPES = {torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.complex64: "C64",
          torch.float32: "F32", torch.uint32: "U32", torch.int32: "I32", torch.bfloat16: "BF16",
          torch.float16: "F16", torch.uint16: "U16", torch.int16: "I16", torch.float8_e4m3fn: "F8_E4M3",
          torch.float8_e5m2: "F8_E5M2", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_RANK = {d: i for i, d in enumerate(DTYPES)}


def _header(tensors: dict[str, torch.Tensor], metadata: Optional[dict[str, str]]) -> tuple[bytes, list[str]]:
    """The length-prefixed, space-padded JSON header and the tensor names in file order."""
    for name, t in tensors.items():
        if t.dtype not in DTYPES or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"safetensors_crc.save: tensor {name!r} is {t.dtype} on {t.device} "
                             f"(contiguous: {t.is_contiguous()}); a contiguous CPU tensor of "
                             f"{', '.join(str(d) for d in DTYPES)} would do")
    order = sorted(tensors, key=lambda n: (_RANK[tensors[n].dtype], n))
    header, offset = ({"__metadata__": metadata} if metadata is not None else {}), 0
    for name in order:
        t = tensors[name]
        end = offset + t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def save(tensors: dict[str, torch.Tensor], path: Path, metadata: Optional[dict[str, str]] = None) -> str:
    """Write `tensors` to `path` as save_file would; returns the file's CRC-32 (8 hex digits)."""
    head, order = _header(tensors, metadata)
    with open(path, "wb") as raw:
        writer = CrcWriter(raw)
        writer.write(head)
        for name in order:
            t = tensors[name]
            if t.numel():
                writer.write(t.reshape(-1).view(torch.uint8).numpy())
        writer.flush()
    return writer.hexdigest()
