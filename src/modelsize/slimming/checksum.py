"""CRC-32 of byte ranges of a file, read through small reused buffers, on every core.

Checksums are what slim's verification costs: the CRC-32 of every tensor's bytes as read from
the input (or as cast) and again as read back from the output. ``zlib.crc32`` and ``preadv``
release the GIL, so the ranges are cut into pieces of :data:`PIECE` bytes that threads read
and checksum at once (one per core this process may run on), each through its own buffer of
:data:`BUFFER` bytes: small enough to stay in the CPU's cache between the read and the CRC,
never a fresh allocation per read. The pieces of one range are put back together with
:func:`crc32_combine`, zlib's algorithm (Python's ``zlib`` does not expose it).

:data:`crc32` is ISA-L's (the ``isal`` package, in the ``slim`` extra) where it is installed:
the zlib that Python links computes about 4 GB/s a core, ISA-L about 12 (measured on this
project's 2-core machine), and a slim of a 4 GB checkpoint checksums each kept byte twice.
Same polynomial, same values, same signature; it releases the GIL too. Without it, ``zlib``'s.
"""

from __future__ import annotations

import contextlib
import os
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from modelsize.errors import CorruptFileError

if TYPE_CHECKING:  # imported when a pool is made (about 20 ms, for slims only)
    from concurrent.futures import Future, ThreadPoolExecutor

R = TypeVar("R")

#: Bytes read at a time into a thread's buffer (stays in cache for the CRC that follows).
BUFFER = 1 << 20
#: Bytes one thread checksums as one piece of work.
PIECE = 8 << 20
#: Small ranges this close to each other are read together, gap included.
_GAP = 64 << 10


def _fastest_crc32() -> Callable[..., int]:
    try:
        from isal.isal_zlib import crc32 as isal_crc32
    except ImportError:
        return zlib.crc32
    return isal_crc32  # type: ignore[no-any-return]


#: ``crc32(data, value=0)``, as ``zlib.crc32``: ISA-L's where installed (see above).
crc32: Callable[..., int] = _fastest_crc32()


# -- crc32_combine (zlib's crc32.c: multmodp / x2nmodp) ---------------------------------------
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32 polynomial (bit-reflected, as zlib)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    p, table = 1 << 30, []  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def _x2nmodp(n: int, k: int) -> int:
    """``x^(n * 2^k)`` modulo the polynomial."""
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    return _multmodp(_x2nmodp(len2, 3), crc1) ^ crc2


# -- threads -------------------------------------------------------------------------------------
def cores() -> int:
    """How many cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_LOCAL = threading.local()


def pool() -> ThreadPoolExecutor | None:
    """The process's checksum and cast threads (``None`` on a single core: work inline)."""
    global _POOL
    if cores() < 2:
        return None
    with _POOL_LOCK:
        if _POOL is None:
            from concurrent.futures import ThreadPoolExecutor

            _POOL = ThreadPoolExecutor(cores(), thread_name_prefix="modelsize")
        return _POOL


def ordered(fn: Callable[[Any], R], items: Iterable[Any], ahead: int | None = None
            ) -> Iterator[R]:
    """``fn(item)`` for each item, in order, computed by the pool's threads with at most
    ``ahead`` items in flight (memory stays bounded); inline on one core. Pending work is
    cancelled if the consumer stops early (an error, Ctrl-C)."""
    ex = pool()
    if ex is None:
        for item in items:
            yield fn(item)
        return
    ahead = ahead or 2 * cores()
    futures: deque[Future[R]] = deque()
    try:
        for item in items:
            futures.append(ex.submit(fn, item))
            if len(futures) >= ahead:
                yield futures.popleft().result()
        while futures:
            yield futures.popleft().result()
    finally:
        for f in futures:
            f.cancel()


_READBACK: ThreadPoolExecutor | None = None


def _readback_pool() -> ThreadPoolExecutor | None:
    """One thread that reads output back while the writer (and the pool) work: never queued
    behind a cast's pieces, nor they behind it. ``None`` on a single core."""
    global _READBACK
    if cores() < 2:
        return None
    with _POOL_LOCK:
        if _READBACK is None:
            from concurrent.futures import ThreadPoolExecutor

            _READBACK = ThreadPoolExecutor(1, thread_name_prefix="modelsize-readback")
        return _READBACK


def thread_buffer() -> memoryview:
    """This thread's reusable buffer of :data:`BUFFER` bytes."""
    view: memoryview | None = getattr(_LOCAL, "view", None)
    if view is None:
        view = _LOCAL.view = memoryview(bytearray(BUFFER))
    return view


# -- CRCs of ranges ------------------------------------------------------------------------------
#: One piece of work: (start, end, [(range index, offset, nbytes), ...]) of one file.
_Work = tuple[int, int, list[tuple[int, int, int]]]


def _pieces(ranges: Sequence[tuple[int, int]]) -> list[_Work]:
    """The ranges in file order, cut into pieces of about :data:`PIECE` bytes: a large range
    in several, neighbouring small ones together."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    work: list[_Work] = []
    cur: _Work | None = None
    for i in order:
        offset, n = ranges[i]
        if n > PIECE:
            for pos in range(offset, offset + n, PIECE):
                end = min(offset + n, pos + PIECE)
                work.append((pos, end, [(i, pos, end - pos)]))
            cur = None
            continue
        if (cur is not None and offset >= cur[0] and offset <= cur[1] + _GAP
                and max(cur[1], offset + n) - cur[0] <= PIECE):
            cur[2].append((i, offset, n))
            work[-1] = cur = (cur[0], max(cur[1], offset + n), cur[2])
            continue
        cur = (offset, offset + n, [(i, offset, n)])
        work.append(cur)
    return work


def _crc_piece(fd: int, path: Path, fmt: str, work: _Work) -> list[tuple[int, int, int]]:
    """``(range index, crc, nbytes)`` of each part of one piece, read through this thread's
    buffer (each byte read once where the parts lie in order)."""
    view = thread_buffer()
    preadv = os.preadv
    _, end, parts = work
    b_start = b_end = 0
    out = []
    for i, offset, n in parts:
        crc, pos, stop = 0, offset, offset + n
        while pos < stop:
            if not b_start <= pos < b_end:
                got = preadv(fd, [view[: min(BUFFER, max(end, stop) - pos)]], pos)
                if got <= 0:
                    raise CorruptFileError(path, fmt, f"file ends before byte {stop}", pos)
                b_start, b_end = pos, pos + got
            take = min(stop, b_end) - pos
            crc = crc32(view[pos - b_start : pos - b_start + take], crc)
            pos += take
        out.append((i, crc, n))
    return out


def _crc_mapped(fd: int, work: _Work) -> list[tuple[int, int, int]]:
    """:func:`_crc_piece` of one range of a file only this process writes (an output being
    written), read through a mapping of it: the page cache checksummed where it lies, not
    copied to a buffer first."""
    import mmap

    _, _, parts = work
    (i, offset, n), = parts
    if offset + n > os.fstat(fd).st_size:  # never map past the end (SIGBUS): say what is wrong
        return _crc_piece(fd, Path(f"/proc/self/fd/{fd}"), "slim", work)
    base = offset - offset % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(fd, offset + n - base, prot=mmap.PROT_READ, offset=base) as m:
        view = memoryview(m)
        try:
            return [(i, crc32(view[offset - base :]), n)]
        finally:
            view.release()


def crc_ranges(fd: int, ranges: Sequence[tuple[int, int]], path: Path,
               fmt: str = "slim") -> list[int]:
    """The CRC-32 of each ``(offset, nbytes)`` range of the file open as ``fd`` (``path``
    names it in errors), in the order given; read in file order, on every core.
    :class:`CorruptFileError` if the file ends before a range does."""
    crcs = [0] * len(ranges)
    done = [0] * len(ranges)

    def run(work: _Work) -> list[tuple[int, int, int]]:
        return _crc_piece(fd, path, fmt, work)

    for parts in ordered(run, _pieces(ranges)):
        for i, crc, n in parts:
            crcs[i] = crc32_combine(crcs[i], crc, n) if done[i] else crc
            done[i] += n
    return crcs


def crc_file_range(fd: int, offset: int, nbytes: int, path: Path, fmt: str = "slim") -> int:
    """The CRC-32 of one range (:func:`crc_ranges`)."""
    return crc_ranges(fd, [(offset, nbytes)], path, fmt)[0]


class EarlyCRCs:
    """CRC-32s of byte ranges of an output file, read back by the pool's threads as soon as
    the ranges are written, while the writer goes on with the next ones (verification then
    finds them done). Nothing is computed on a single core (nothing to overlap with)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.futures: dict[tuple[int, int], list[Future[list[tuple[int, int, int]]]]] = {}
        self.after: list[Future[object]] = []

    def add(self, offset: int, nbytes: int, then: Callable[[], object] | None = None) -> None:
        """Start reading back ``nbytes`` at ``offset`` (already written to the descriptor),
        and run ``then`` on the same thread afterwards."""
        ex = _readback_pool()
        if ex is None or not nbytes:
            return
        self.futures[(offset, nbytes)] = [ex.submit(_crc_mapped, self.fd, work)
                                          for work in _pieces([(offset, nbytes)])]
        if then is not None:
            self.after.append(ex.submit(then))

    def crc(self, offset: int, nbytes: int) -> int | None:
        """The CRC-32 read back for exactly that range (``None``: not read back, or the read
        failed: the caller reads it itself)."""
        futures = self.futures.get((offset, nbytes))
        if not futures:
            return None
        crc = 0
        try:
            for k, f in enumerate(futures):
                for _, part, n in f.result():
                    crc = crc32_combine(crc, part, n) if k else part
        except Exception:  # read again by the caller, who reports what fails
            return None
        return crc

    def close(self) -> None:
        """Cancel what has not started and wait for what has (the descriptor may then be
        closed)."""
        every = [f for futures in self.futures.values() for f in futures] + self.after
        for f in every:
            f.cancel()
        for f in every:
            if not f.cancelled():
                with contextlib.suppress(BaseException):
                    f.exception()
        self.futures.clear()
        self.after.clear()


def in_background(fn: Callable[[], object]) -> Callable[[], object]:
    """Run ``fn`` on a thread of its own now; the returned function waits for it and gives
    its result (or raises its exception)."""
    box: list[object] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # handed to the caller
            error.append(exc)

    t = threading.Thread(target=target, name="modelsize-bg", daemon=True)
    t.start()

    def wait() -> object:
        t.join()
        if error:
            raise error[0]
        return box[0]

    return wait
