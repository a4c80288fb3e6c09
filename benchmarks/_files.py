"""Files the benchmarks build with real headers and their data a hole (sparse on disk)."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

#: Bytes of one element of each safetensors dtype the benchmarks write.
SAFETENSORS_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "I64": 8, "U8": 1,
                     "I8": 1, "F8_E4M3": 1}


def sparse_safetensors(path: Path, tensors: Iterable[tuple[str, str, Sequence[int]]],
                       metadata: dict[str, str] | None = None) -> tuple[int, int]:
    """A safetensors file of ``(name, dtype, shape)`` tensors, in that order, whose data region
    is a hole; returns (its data bytes, its size)."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    at = 0
    for name, dtype, shape in tensors:
        n = SAFETENSORS_BYTES[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + at)
    return at, 8 + len(raw) + at
