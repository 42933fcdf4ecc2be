"""A safetensors file written one tensor at a time: the header (names, dtypes, shapes, offsets) first, from
shapes alone, then each tensor's bytes as it arrives; the file the safetensors library reads."""

import json
import math
import struct
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(file: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]], tensors, metadata: dict):
    """A safetensors file of `entries` (name, shape, dtype, in file order), its data written one tensor at a
    time from the iterator `tensors` of (name, tensor) in the same order."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, shape, dtype in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(file, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for (name, shape, dtype), (got, tensor) in zip(entries, tensors, strict=True):
            if name != got or tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"{got} {tuple(tensor.shape)} came where {name} {tuple(shape)} was announced")
            out.write(tensor.to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy())
