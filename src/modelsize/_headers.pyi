"""The common entries of a safetensors header, scanned in C (``_headers.c``); absent where not
built."""

from typing import Any

def scan_safetensors(
    raw: bytes, pos: int, data_size: int, known: dict[bytes, tuple[str, int]],
    shapes: dict[bytes, tuple[tuple[int, ...], int | None]], names: list[str],
    dtypes: list[str], shape_col: list[Any], /,
) -> tuple[int, bool, bytes, bytes]:
    """Entries from ``pos`` into the columns: (pos, closed, begins, ends)."""

def setup_zip(entry_type: type, member_type: type, max_extract_version: int, /) -> None:
    """The ``_zip.Entry`` and ``_zip.Member`` classes, and zipfile's highest version."""

def central_records(
    data: bytes, q: int, limit: int, room: int, concat: int, out: list[Any], /,
) -> tuple[int, int]:
    """Central directory records of ``data[q:limit]`` into ``out``: (q, bytes consumed)."""

def check_records(raw: bytes, q: int, count: int, /) -> tuple[int, int]:
    """Up to ``count`` records lying in ``raw[q:]`` one after the other: (q, how many)."""

def local_headers(
    window: bytes, start: int, infos: list[Any], i: int, size: int, names: bool, mask: int,
    out: list[Any], fd: int, /,
) -> int:
    """Members of ``infos[i:]`` whose local headers pass every check, into ``out``: the next i."""
