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

Where the bytes are read back: tensors of 1 MiB and more are read back from the output file
by a thread of their own as soon as they are written, while the writer goes on
(:class:`~modelsize.slimming.output.OutputFile`); here their CRCs are taken at the offsets the
output's reader declares, and any range that was not read back that way, or was written
again after, is read here, on every core (:mod:`modelsize.slimming.checksum`), while the
disk finishes the fsync.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from modelsize import formats
from modelsize.errors import VerificationError, printable
from modelsize.inventory import (
    FileInfo,
    Inventory,
    LazyInventory,
    NotSimpleError,
    TensorRecord,
    TotalsBuilder,
)
from modelsize.slimming.checksum import crc32, crc_ranges
from modelsize.slimming.loadable import problems_loading
from modelsize.slimming.plan import Plan
from modelsize.slimming.source import FileRange, tensor_source
from modelsize.slimming.source import _storages as storages_of
from modelsize.slimming.writers.base import Job, Written, WrittenTable

#: Bytes read at a time when two headers are compared.
_WINDOW = 8 << 20


def crc_of(inv: Inventory, record: TensorRecord) -> tuple[int, int]:
    """CRC-32 and length of a tensor's bytes, as modelsize reads them from ``inv``'s files."""
    reader = formats.registry().get(inv.format)
    src = tensor_source(inv, record, getattr(reader, "storage_chunks", None))
    if isinstance(src, FileRange):
        return src.crc(), src.nbytes
    crc, n = 0, 0
    for chunk in src.chunks():
        crc = crc32(chunk, crc)
        n += len(chunk)
    return crc, n


#: ``crc(offset, nbytes)`` of a range of one output file read back early, or ``None``.
EarlyCRC = Callable[[int, int], "int | None"]
#: The early read-back of the staged file at a path, if any.
EarlyFor = Callable[[Path], "EarlyCRC | None"]


def crcs_of(inv: Inventory, records: Sequence[TensorRecord], early: EarlyFor | None = None,
            ) -> Iterator[tuple[int, int, int]]:
    """``(index, crc, nbytes)`` of each record (:func:`crc_of`), in no particular order.

    Records whose bytes lie plainly in a file (most) are read in file order, neighbours
    together, through one open file per file and on every core
    (:func:`~modelsize.slimming.checksum.crc_ranges`): a million small tensors cost a few
    hundred reads, not a million opens. ``early`` gives the CRCs of ranges of an output file
    read back while it was written (:class:`~modelsize.slimming.output.OutputFile`).
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
    by_file: dict[int, list[int]] = {}
    for k in range(len(plain)):
        by_file.setdefault(places[k] >> 64, []).append(k)
    for file, all_ks in by_file.items():
        path = inv.files[file].path
        known = early(path) if early is not None else None
        ks = []
        for k in all_ks:
            crc = (known(places[k] & (2**64 - 1), records[plain[k]].nbytes)
                   if known is not None else None)
            if crc is None:
                ks.append(k)
            else:
                yield plain[k], crc, records[plain[k]].nbytes
        ranges = [(places[k] & (2**64 - 1), records[plain[k]].nbytes) for k in ks]
        fd = os.open(path, os.O_RDONLY)
        try:
            crcs = crc_ranges(fd, ranges, path, inv.format)
        finally:
            os.close(fd)
        for k, crc, (_, nbytes) in zip(ks, crcs, ranges, strict=True):
            yield plain[k], crc, nbytes


def _find(by_name: Mapping[str, TensorRecord], *names: str) -> TensorRecord | None:
    """The output tensor under the first of ``names`` it has: the writer's name for it, else
    the input's (multi-file outputs read back under the input's file labels)."""
    for name in names:
        rec = by_name.get(name)
        if rec is not None:
            return rec
    return None


def verify(plan: Plan, job: Job, written: Mapping[str, Written], staged: Path,
           early: EarlyFor | None = None) -> Inventory:
    """Read ``staged`` back and check it against the plan; returns the output's inventory.

    A safetensors file laid out from the plan is read back by the reader's own accounting
    into a :class:`~modelsize.inventory.TotalsBuilder` (:func:`_verify_streamed`): the same
    checks, without a second inventory of records. ``early``: the CRCs of the output's
    ranges read back while it was written, where there are (the rest is read here).
    """
    lays = getattr(job, "layouts", None)
    if (isinstance(written, WrittenTable) and lays is not None and len(lays) == 1
            and lays[0].order is not None and not getattr(job, "directory", True)):
        try:
            return _verify_streamed(plan, lays[0].order, written, staged, early)
        except NotSimpleError:
            pass  # read back in full below (never expected: slim wrote the file)
    out = formats.read(staged)
    by_name = {t.name: t for t in out.tensors}
    problems: list[str] = []
    form = getattr(job, "output_form", None)
    names: list[str] = []
    indices: list[int] = []
    records: list[TensorRecord] = []
    for index, t in enumerate(plan.rows()):
        if t.alias_of is not None:
            continue
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
        indices.append(index)
        records.append(rec)
    for i, crc, n in crcs_of(out, records, early):
        w = (written.at(indices[i]) if isinstance(written, WrittenTable)
             else written.get(names[i]))
        if w is None or (crc, n) != (w.crc, w.nbytes):
            problems.append(f"{names[i]}: its bytes read back differ from the bytes written")
    aliases = plan.aliases
    planned = {t.name: t for t in plan.rows()} if aliases else {}
    for alias, original in aliases.items():
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
        raise _failed(problems)
    return out


def _failed(problems: list[str]) -> VerificationError:
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return VerificationError(
        "the slimmed output failed verification and was not written: "
        + "; ".join(printable(p, 200) for p in problems[:3]) + more
        + " (a modelsize bug: please report it)"
    )


def _verify_streamed(plan: Plan, order: Sequence[int], written: WrittenTable,
                     staged: Path, early: EarlyFor | None = None) -> Inventory:
    """:func:`verify` of a single safetensors file laid out from ``plan`` (``order``: the
    plan's indices in data order): the safetensors reader's own accounting of the file
    (:func:`modelsize.formats.safetensors.account_file`) into a
    :class:`~modelsize.inventory.TotalsBuilder`, each tensor compared as it is declared
    with the planned one in its place (name, dtype, shape as the file holds it), then the
    CRC-32 of every tensor's bytes read back, in file order a window at a time, with the
    CRC-32 of the bytes written. Returns the output's totals, its records read on demand.
    """
    from modelsize.formats.safetensors import account_file
    from modelsize.slimming.writers.safetensors import DTYPE_CODES, stored_form

    problems: list[str] = []
    extra: list[str] = []
    # The layout must place each stored tensor of the plan once, and no alias.
    seen = bytearray(len(plan))
    for i in order:
        seen[i] = 2 if seen[i] else 1
    aliases = plan.alias_indices()
    if (len(order) != plan.stored_count or seen.count(1) != len(order)
            or any(seen[i] for i in aliases)):
        problems += [f"{plan.row(i).name} is missing" for i in range(len(plan))
                     if not seen[i] and i not in aliases][:3]
        problems += [f"{plan.row(i).name} is written twice, or as an alias"
                     for i in range(len(plan)) if seen[i] > 1 or (seen[i] and i in aliases)][:3]
    del seen
    planned = plan.described(order)
    raw = set(DTYPE_CODES)

    def expect(k: int, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        found = next(planned, None)
        if found is None:
            extra.append(name)
            return
        _, rec, want_name, want_dtype, _ = found
        if name != want_name:
            problems.append(f"{want_name} is missing (found {name} in its place)")
            return
        if dtype == want_dtype and shape == rec.shape:
            return
        want_shape = rec.shape
        if want_dtype not in raw:  # kept as raw bytes (see stored_form)
            want_dtype, want_shape = stored_form(plan.row(found[0]))
        if dtype != want_dtype or shape != want_shape:
            problems.append(f"{want_name} reads back as {dtype}{list(shape)}, planned "
                            f"{want_dtype}{list(want_shape)}")

    builder = TotalsBuilder("safetensors", [staged], root=staged, expect=expect)
    account_file(builder)
    if len(builder.st_offset) != builder.count:
        raise NotSimpleError("a tensor without its own storage")
    if builder.count < len(order):
        problems += [f"{plan.row(order[k]).name} is missing"
                     for k in range(builder.count, min(len(order), builder.count + 3))]
    if extra:
        problems.append(f"{extra[0]} was not planned" + (
            f" (and {len(extra) - 1} more tensors)" if len(extra) > 1 else ""))
    crcs = array("I", bytes(4 * builder.count))
    if not problems:
        w_crcs, w_nbytes = written.crcs, written.nbytes
        for k, crc, n in _crcs_in_order(builder, staged, early):
            crcs[k] = crc
            i = order[k]
            if crc != w_crcs[i] or n != w_nbytes[i]:
                problems.append(f"{plan.row(i).name}: its bytes read back differ from "
                                "the bytes written")
    if problems:
        raise _failed(problems)
    out = builder.build(crcs=crcs)
    if out.unsafe_globals:
        problems.append("the output would call " + ", ".join(out.unsafe_globals[:3]))
    problems += problems_loading(out)
    if problems:
        raise _failed(problems)
    return out


def _crcs_in_order(builder: TotalsBuilder, path: Path, early: EarlyFor | None = None,
                   ) -> Iterator[tuple[int, int, int]]:
    """``(index, crc, nbytes)`` of each storage the builder holds: read back early where it
    was, the rest read here on every core."""
    offsets, sizes = builder.st_offset, builder.st_nbytes
    known = early(path) if early is not None else None
    left: list[int] = []
    for k in range(len(offsets)):
        crc = known(offsets[k], sizes[k]) if known is not None else None
        if crc is None:
            left.append(k)
        else:
            yield k, crc, sizes[k]
    fd = os.open(path, os.O_RDONLY)
    try:
        crcs = crc_ranges(fd, [(offsets[k], sizes[k]) for k in left], path, "safetensors")
    finally:
        os.close(fd)
    for k, crc in zip(left, crcs, strict=True):
        yield k, crc, sizes[k]


def copy_read_back(inv: Inventory, staged: Path) -> tuple[Inventory, bool] | None:
    """For a byte copy of one safetensors file: whether the copy reads back with the input's
    tensors, and the copy's inventory (the input's totals: the same bytes read by the same
    reader; its records read on demand). ``None`` where this does not apply (the copy is then
    read back in full).

    The copy's header (its length and JSON) is compared byte for byte with the input's, read
    through the input's open descriptor: the header is all the reader reads to list a
    safetensors file's tensors (names, dtypes, shapes, offsets), so equal headers read back as
    the inventory the reader made of the input, without parsing a million entries again.
    """
    from modelsize.inputs import reading

    if inv.format != "safetensors" or len(inv.files) != 1 or staged.is_dir():
        return None
    source = inv.files[0].path
    with reading(source) as fd_in:
        fd_out = os.open(staged, os.O_RDONLY)
        try:
            same = _same_header(fd_in, fd_out)
            size = os.fstat(fd_out).st_size
        finally:
            os.close(fd_out)
    # The same bytes: the input's regions are the copy's (stray bytes among them).
    out = LazyInventory(inv.format, (FileInfo(staged, size),), dict(inv.bytes_by_category),
                        unsafe_globals=inv.unsafe_globals, notes=inv.notes,
                        facts={**inv.facts, "path": str(staged)}, declared_regions=inv.regions)
    return out, same and size == inv.file_bytes


def _same_header(fd_a: int, fd_b: int) -> bool:
    """Whether two safetensors files open as ``fd_a`` and ``fd_b`` have the same header
    bytes (length prefix and JSON), compared a piece at a time."""
    head_a, head_b = os.pread(fd_a, 8, 0), os.pread(fd_b, 8, 0)
    if len(head_a) < 8 or head_a != head_b:
        return False
    end = 8 + int.from_bytes(head_a, "little")
    pos = 8
    while pos < end:
        n = min(_WINDOW, end - pos)
        a, b = os.pread(fd_a, n, pos), os.pread(fd_b, n, pos)
        if len(a) != n or a != b:
            return False
        pos += n
    return True
