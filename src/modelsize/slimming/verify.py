"""Verification: the output, read back by modelsize's own reader, holds exactly the plan, and
loads by its format's own rules.

Every stored tensor must be there under its name, with the planned dtype and shape, and the
CRC-32 of its bytes as read back must equal the CRC-32 of the bytes streamed from the input
(or of their cast) while writing. An alias present in the output must match its original. The
output must carry no unsafe global. And it must pass what the format's own loader checks
before it reads a byte of data (:mod:`modelsize.slimming.loadable`: NumPy's header rules for
``.npy``/``.npz``, Keras 3's for ``.keras``), or CRCs of what was written would vouch for a file
its framework refuses. Anything else is a modelsize bug: the staged output is thrown away and
nothing is committed.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from modelsize import formats
from modelsize.errors import CorruptFileError, VerificationError, printable
from modelsize.inventory import Inventory, TensorRecord
from modelsize.slimming.loadable import problems_loading
from modelsize.slimming.plan import Plan
from modelsize.slimming.source import FileRange, tensor_source
from modelsize.slimming.source import _storages as storages_of
from modelsize.slimming.writers.base import Job, Written

#: Bytes read at a time when the CRCs of many tensors are computed in file order.
_WINDOW = 8 << 20


def crc_of(inv: Inventory, record: TensorRecord) -> tuple[int, int]:
    """CRC-32 and length of a tensor's bytes, as modelsize reads them from ``inv``'s files."""
    reader = formats.registry().get(inv.format)
    src = tensor_source(inv, record, getattr(reader, "storage_chunks", None))
    if isinstance(src, FileRange):
        return src.crc(), src.nbytes
    crc, n = 0, 0
    for chunk in src.chunks():
        crc = zlib.crc32(chunk, crc)
        n += len(chunk)
    return crc, n


def crcs_of(inv: Inventory, records: Sequence[TensorRecord]) -> Iterator[tuple[int, int, int]]:
    """``(index, crc, nbytes)`` of each record (:func:`crc_of`), in no particular order.

    Records whose bytes lie plainly in a file (most) are read in file order, a window at a
    time, through one open file per file: a million small tensors cost a few hundred reads,
    not a million opens. Nothing is kept per record but its place in the order.
    """
    storages = storages_of(inv)  # the map tensor_source keeps for the same inventory
    places: list[int] = []
    plain: list[int] = []
    for i, rec in enumerate(records):
        st = storages.get(rec.storage) if rec.storage is not None else None
        if st is None or st.compressed or rec.strides is not None:
            yield (i, *crc_of(inv, rec))
        else:
            plain.append(i)
            places.append((st.file << 64) | (st.offset + rec.storage_offset))
    order = sorted(range(len(plain)), key=places.__getitem__)
    fds: dict[int, int] = {}
    try:
        window, w_file, w_start = b"", -1, 0
        for k in order:
            i = plain[k]
            file, offset, nbytes = places[k] >> 64, places[k] & (2**64 - 1), records[i].nbytes
            path = inv.files[file].path
            fd = fds.get(file)
            if fd is None:
                fd = fds[file] = os.open(path, os.O_RDONLY)
            if nbytes > _WINDOW:
                yield i, _crc_range(fd, offset, nbytes, path), nbytes
                continue
            if file != w_file or offset < w_start or offset + nbytes > w_start + len(window):
                window = os.pread(fd, max(_WINDOW, nbytes), offset)
                w_file, w_start = file, offset
                if len(window) < nbytes:
                    raise CorruptFileError(path, inv.format,
                                           f"file ends before byte {offset + nbytes}", offset)
            at = offset - w_start
            yield i, zlib.crc32(memoryview(window)[at : at + nbytes]), nbytes
    finally:
        for fd in fds.values():
            os.close(fd)


def _crc_range(fd: int, offset: int, nbytes: int, path: Path) -> int:
    crc, pos, end = 0, offset, offset + nbytes
    while pos < end:
        data = os.pread(fd, min(_WINDOW, end - pos), pos)
        if not data:
            raise CorruptFileError(path, "slim", f"file ends before byte {end}", pos)
        crc = zlib.crc32(data, crc)
        pos += len(data)
    return crc


def _find(by_name: Mapping[str, TensorRecord], *names: str) -> TensorRecord | None:
    """The output tensor under the first of ``names`` it has: the writer's name for it, else
    the input's (multi-file outputs read back under the input's file labels)."""
    for name in names:
        rec = by_name.get(name)
        if rec is not None:
            return rec
    return None


def verify(plan: Plan, job: Job, written: Mapping[str, Written], staged: Path) -> Inventory:
    """Read ``staged`` back and check it against the plan; returns the output's inventory."""
    out = formats.read(staged)
    by_name = {t.name: t for t in out.tensors}
    problems: list[str] = []
    form = getattr(job, "output_form", None)
    names: list[str] = []
    records: list[TensorRecord] = []
    for t in plan.stored:
        rec = _find(by_name, job.output_name(t.name), t.record.name, t.record.key)
        if rec is None:
            problems.append(f"{t.name} is missing")
            continue
        dtype, shape = form(t) if form is not None else (t.dtype, t.shape)
        if rec.dtype != dtype or rec.shape != shape:
            problems.append(f"{t.name} reads back as {rec.dtype}{list(rec.shape)}, planned "
                            f"{dtype}{list(shape)}")
            continue
        names.append(t.name)
        records.append(rec)
    for i, crc, n in crcs_of(out, records):
        w = written.get(names[i])
        if w is None or (crc, n) != (w.crc, w.nbytes):
            problems.append(f"{names[i]}: its bytes read back differ from the bytes written")
    planned = {t.name: t for t in plan.tensors} if plan.aliases else {}
    for alias, original in plan.aliases.items():
        rec = _find(by_name, job.output_name(alias), planned[alias].record.name)
        orig = _find(by_name, job.output_name(original), planned[original].record.name)
        if rec is None or orig is None:
            continue  # the format records the alias in its metadata
        if rec.shape != planned[alias].shape:
            problems.append(f"alias {alias} reads back with another shape")
        elif crc_of(out, rec) != crc_of(out, orig):
            problems.append(f"alias {alias} differs from {original}")
    if out.unsafe_globals:
        problems.append("the output would call " + ", ".join(out.unsafe_globals[:3]))
    problems += problems_loading(out)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise VerificationError(
            "the slimmed output failed verification and was not written: "
            + "; ".join(printable(p, 200) for p in problems[:3]) + more
            + " (a modelsize bug: please report it)"
        )
    return out
