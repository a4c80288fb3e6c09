"""The Writer protocol and what every writer shares: streaming a planned tensor's bytes.

A writer turns a :class:`~modelsize.slimming.plan.Plan` into a :class:`Job` (everything
decided, sizes known where the format allows) and the job writes its files into an
:class:`~modelsize.slimming.output.Output`. Tensor bytes come from the plan's sources, a chunk
at a time, through :func:`stream`, which casts where the plan says, counts progress and keeps
the CRC-32 of what was written for verification.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from modelsize.findings import slim_target
from modelsize.slimming.cast import Cast, CastError
from modelsize.slimming.checksum import crc32, crc32_combine
from modelsize.slimming.output import Output
from modelsize.slimming.plan import Plan, PlannedTensor
from modelsize.slimming.source import FileRange, TensorSource, _pread_exact

#: ``progress(bytes written, bytes planned)``.
Progress = Callable[[int, int], None]


@dataclass
class Written:
    """What was written for one tensor: its bytes' CRC-32, their count, the cast's error."""

    crc: int = 0
    nbytes: int = 0
    error: CastError | None = None


@dataclass
class Meter:
    """Progress over a whole job: bytes written of bytes planned."""

    total: int
    callback: Progress | None = None
    done: int = 0

    def advance(self, n: int) -> None:
        """Count ``n`` more bytes written."""
        self.done += n
        if self.callback is not None:
            self.callback(self.done, self.total)


@dataclass
class Streamed:
    """The output bytes of one planned tensor, ready to be consumed once."""

    tensor: PlannedTensor
    meter: Meter | None = None
    written: Written = field(default_factory=Written)

    @property
    def nbytes(self) -> int:
        """Bytes the output tensor holds."""
        return self.source().nbytes

    def source(self) -> TensorSource:
        """The source, wrapped in a cast when the plan changes the dtype."""
        t = self.tensor
        if t.source is None:
            raise ValueError(f"{t.name} is an alias and has no bytes of its own")
        if not t.cast:
            return t.source
        cached = getattr(self, "_cast", None)
        if cached is None:
            cached = Cast(t.source, t.record.dtype, t.dtype)
            self._cast = cached
        return cached

    def chunks(self) -> Iterator[bytes | memoryview]:
        """The bytes; CRC, count and cast error land in :attr:`written` as they pass."""
        src = self.source()
        crc, n = 0, 0
        if isinstance(src, Cast):  # checksummed piece by piece where they were cast
            for cast, piece_crc in src.chunks_with_crc():
                crc = crc32_combine(crc, piece_crc, len(cast)) if n else piece_crc
                n += len(cast)
                if self.meter is not None:
                    self.meter.advance(len(cast))
                yield cast
        else:
            for chunk in src.chunks():
                crc = crc32(chunk, crc)
                n += len(chunk)
                if self.meter is not None:
                    self.meter.advance(len(chunk))
                yield chunk
        if n != src.nbytes:
            raise ValueError(f"{self.tensor.name}: expected {src.nbytes} bytes, read {n}")
        self.written.crc, self.written.nbytes = crc, n
        if isinstance(src, Cast):
            self.written.error = src.error


    def write_to(self, fh: BinaryIO) -> int:
        """Write the bytes at ``fh``'s position; returns how many. A plain copy of a contiguous
        run of the input is written straight to the file's descriptor, its CRC-32 taken while
        each piece is in hand (:meth:`FileRange.copy_to`); anything else streams through
        :meth:`chunks`."""
        src = self.source()
        if isinstance(src, FileRange) and src.nbytes >= _KERNEL_COPY_MIN:
            fh.flush()
            start = fh.tell()
            crc = src.copy_to(fh.fileno(), self.meter.advance if self.meter else None)
            fh.seek(start + src.nbytes)  # resynchronise the buffered file's position
            self.written.crc, self.written.nbytes = crc, src.nbytes
            _wrote(fh, start, src.nbytes)
            return src.nbytes
        large = src.nbytes >= _KERNEL_COPY_MIN and hasattr(fh, "wrote")
        start = fh.tell() if large else 0
        n = 0
        for chunk in self.chunks():
            fh.write(chunk)
            n += len(chunk)
        if large:
            fh.flush()
            _wrote(fh, start, n)
        return n


def _wrote(fh: BinaryIO, offset: int, nbytes: int) -> None:
    """Tell an output file that ``nbytes`` at ``offset`` are written: it reads them back on
    other threads while the writer goes on (:class:`~modelsize.slimming.output.OutputFile`)."""
    wrote = getattr(fh, "wrote", None)
    if wrote is not None:
        wrote(offset, nbytes)


#: Tensors this large are copied on their own (:meth:`FileRange.copy_to`), never windowed.
_KERNEL_COPY_MIN = 1 << 20


def stream(tensor: PlannedTensor, meter: Meter | None = None) -> Streamed:
    """A planned tensor's output bytes, with CRC and progress."""
    return Streamed(tensor, meter)


def output_nbytes(tensor: PlannedTensor) -> int:
    """Bytes the output holds for ``tensor`` (after any cast), without reading anything."""
    from modelsize.dtypes import DTYPES

    if tensor.alias_of is not None:
        return 0
    if tensor.dtype != tensor.record.dtype:
        return DTYPES[tensor.dtype].nbytes(tensor.record.numel)
    return tensor.source_nbytes()


class WrittenTable(Mapping[str, Written]):
    """What was written per output tensor, as columns indexed like the plan's tensors: a
    CRC-32 and a byte count each (12 bytes, where a :class:`Written` per tensor costs ten
    times that), the cast errors apart. Read by position (:meth:`at`) or, as the mapping
    :meth:`Job.write` returns, by output name."""

    def __init__(self, plan: Plan) -> None:
        n = len(plan)
        self.plan = plan
        self.crcs = array("I", bytes(4 * n))  # a CRC-32 fits an unsigned int
        self.nbytes = array("q", [-1]) * n
        self.errors: dict[int, CastError] = {}
        self._index: dict[str, int] | None = None

    def put(self, i: int, crc: int, nbytes: int, error: CastError | None = None) -> None:
        """Record what was written for the plan's tensor ``i``."""
        self.crcs[i] = crc
        self.nbytes[i] = nbytes
        if error is not None:
            self.errors[i] = error

    def put_written(self, i: int, w: Written) -> None:
        """:meth:`put` from a :class:`Written`."""
        self.put(i, w.crc, w.nbytes, w.error)

    def at(self, i: int) -> Written | None:
        """What was written for the plan's tensor ``i`` (``None``: nothing)."""
        n = self.nbytes[i]
        if n < 0:
            return None
        return Written(self.crcs[i], n, self.errors.get(i))

    def _names(self) -> dict[str, int]:
        if self._index is None:
            self._index = {t.name: i for i, t in enumerate(self.plan.rows())
                           if self.nbytes[i] >= 0}
        return self._index

    def __getitem__(self, name: str) -> Written:
        w = self.at(self._names()[name])
        assert w is not None
        return w

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


#: Bytes read from the input at once for a run of small tensors lying one after the other.
_WINDOW = 8 << 20
#: A tensor starting at most this many bytes after the last one read counts as read one
#: after the other; a tensor read out of order gets a window of this size.
_GAP = 4096


def write_tensors(fh: BinaryIO, plan: Plan, order: Iterable[int], meter: Meter | None,
                  written: WrittenTable) -> int:
    """Write the stored tensors ``order`` (plan indices) back to back at ``fh``'s position;
    returns the bytes written.

    Small tensors copied as they are from contiguous input bytes (most tensors of a large
    checkpoint) are read from a window of the input, through its open descriptors: a run of
    them lying one after the other costs a few reads of up to :data:`_WINDOW` bytes, into one
    reused buffer, and each is
    checksummed from that window as it is written, never opened or streamed one by one.
    Anything else (cast, strided, decoded, large) goes through :func:`stream`.
    """
    import contextlib

    from modelsize.inputs import reading

    inv = plan.inventory
    sources = plan.sources()
    by_key = sources.storage_map() if sources is not None else None
    crcs, sizes = written.crcs, written.nbytes
    write = fh.write
    total = pending = 0
    window = memoryview(b"")
    buffer: memoryview | None = None  # reused: nothing allocated per window
    w_file, w_start, w_end, prev_end = -1, 0, 0, -1
    with contextlib.ExitStack() as files:
        fds: dict[int, int] = {}
        for i, rec, _name, dtype, alias in plan.described(order):
            n = rec.nbytes
            if (by_key is None or alias is not None or dtype != rec.dtype or rec.strides
                    is not None or rec.storage is None or n >= _KERNEL_COPY_MIN):
                st = None
            else:
                st = by_key[rec.storage]
                if st.compressed:
                    st = None
            if st is None:
                s = stream(plan.row(i), meter)
                total += s.write_to(fh)
                written.put_written(i, s.written)
                continue
            file, offset = st.file, st.offset + rec.storage_offset
            if file != w_file or offset < w_start or offset + n > w_end:
                # Reading one after the other: a window twice the last one (the bytes read
                # stay within twice the run's); else just past this tensor.
                size = (min(_WINDOW, 2 * (w_end - w_start)) if file == w_file
                        and 0 <= offset - prev_end <= _GAP else _GAP)
                fd = fds.get(file)
                if fd is None:
                    fd = fds[file] = files.enter_context(reading(inv.files[file].path))
                if buffer is None:
                    buffer = memoryview(bytearray(_WINDOW + _KERNEL_COPY_MIN))
                got = os.preadv(fd, [buffer[: max(n, size)]], offset)
                if got >= n:
                    data: bytes | memoryview = buffer[:got]
                else:
                    data = _pread_exact(fd, n, offset, inv.files[file].path)
                window, w_file, w_start, w_end = memoryview(data), file, offset, offset + len(data)
                if meter is not None and pending:
                    meter.advance(pending)
                    pending = 0
            piece = window[offset - w_start : offset - w_start + n]
            write(piece)
            crcs[i] = crc32(piece)
            sizes[i] = n
            total += n
            pending += n
            prev_end = offset + n
    if meter is not None and pending:
        meter.advance(pending)
    return total


class Job(Protocol):
    """One output, fully decided."""

    #: Output files, relative to the target's folder (or to the target, when ``directory``).
    files: list[str]
    #: The file that makes the output exist (committed last).
    main: str
    #: Whether the target is a folder.
    directory: bool
    #: The output's exact size in bytes, or ``None`` where it is known only once written.
    predicted_bytes: int | None

    def write(self, out: Output, meter: Meter) -> dict[str, Written]:
        """Write every file; return what was written per stored tensor (by output name)."""
        ...

    def output_name(self, name: str) -> str:
        """The name the output's reader gives a planned tensor."""
        ...


class Writer(Protocol):
    """One output format."""

    name: str

    def default_target(self, plan: Plan, source: Path) -> Path:
        """Where the output goes when ``-o`` is not given."""
        ...

    def prepare(self, plan: Plan, target: Path) -> Job:
        """Decide the whole output (names, offsets, headers) before writing a byte."""
        ...


def slim_name(path: Path, suffix: str | None = None) -> Path:
    """``x.pt`` -> ``x.slim.pt`` (``suffix`` replaces the extension, e.g. ``.safetensors``):
    the names ``inspect``'s findings print (:func:`modelsize.findings.slim_target`)."""
    return slim_target(path, suffix)
