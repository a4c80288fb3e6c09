"""The Writer protocol and what every writer shares: streaming a planned tensor's bytes.

A writer turns a :class:`~modelsize.slimming.plan.Plan` into a :class:`Job` (everything
decided, sizes known where the format allows) and the job writes its files into an
:class:`~modelsize.slimming.output.Output`. Tensor bytes come from the plan's sources, a chunk
at a time, through :func:`stream`, which casts where the plan says, counts progress and keeps
the CRC-32 of what was written for verification.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from modelsize.findings import slim_target
from modelsize.slimming.cast import Cast, CastError
from modelsize.slimming.output import Output
from modelsize.slimming.plan import Plan, PlannedTensor
from modelsize.slimming.source import FileRange, TensorSource

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
        for chunk in src.chunks():
            crc = zlib.crc32(chunk, crc)
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
        run of the input goes through the kernel (``copy_file_range``), the CRC-32 taken from
        the input's bytes; anything else streams through :meth:`chunks`."""
        src = self.source()
        if isinstance(src, FileRange) and src.nbytes >= _KERNEL_COPY_MIN:
            fh.flush()
            start = fh.tell()
            try:
                crc = src.copy_to(fh.fileno(), self.meter.advance if self.meter else None)
            except OSError:
                fh.seek(start)  # the kernel cannot copy between these files: stream instead
                if self.meter is not None:
                    self.meter.done = self.meter.done  # progress restarts with the stream
            else:
                fh.seek(start + src.nbytes)  # resynchronise the buffered file's position
                self.written.crc, self.written.nbytes = crc, src.nbytes
                return src.nbytes
        n = 0
        for chunk in self.chunks():
            fh.write(chunk)
            n += len(chunk)
        return n


#: Runs shorter than this are cheaper to copy through Python than to hand to the kernel.
_KERNEL_COPY_MIN = 1 << 20


def stream(tensor: PlannedTensor, meter: Meter | None = None) -> Streamed:
    """A planned tensor's output bytes, with CRC and progress."""
    return Streamed(tensor, meter)


def output_nbytes(tensor: PlannedTensor) -> int:
    """Bytes the output holds for ``tensor`` (after any cast), without reading anything."""
    from modelsize.dtypes import DTYPES

    if tensor.alias_of is not None:
        return 0
    if tensor.cast:
        return DTYPES[tensor.dtype].nbytes(tensor.record.numel)
    return tensor.source.nbytes if tensor.source is not None else 0


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
