"""The input files of one slim (or inspect), held still: their identity and open descriptors.

A training loop saves its checkpoint by writing a new file and renaming it over the old one, or
rewrites it in place; a slim that streams the input while that happens would copy some tensors
of the old checkpoint and some of the new, and its verification (the output against the bytes
read) cannot notice. So :func:`watch` records each input file's identity (device, inode, size,
``mtime_ns``) *before* the reader reads anything: the path itself and, bounded like
:func:`modelsize.formats.base.check_tree`, the files a reader may open inside it (a checkpoint
folder) or beside it (those sharing its name's first word: the shards an index names, a
TensorFlow prefix's ``.index`` and ``.data-*``). Once the reader has listed the files,
:meth:`InputTable.adopt` opens each of them once and checks that the file opened is the one
that was there at the start; every byte range slim then reads goes through these descriptors
(:func:`reading` for ``pread``, :func:`open_input` and :func:`open_fd` for the writers' own
opens), so a rename can no longer switch files under a read. :func:`ensure_unchanged` checks
every identity again, by path and by descriptor, after the last read and after verification
(:class:`~modelsize.slimming.output.Output` calls it before it commits): a change is
:class:`~modelsize.errors.InputError`, one line, and nothing is written. ``inspect`` compares
the files it summed with the snapshot once the reader is done.

What it cannot see: a rewrite in place that keeps the size and lands within the filesystem's
timestamp granularity of the snapshot (a few milliseconds), and a change, during the reader's
own metadata read, to a file outside the snapshot (external data of another name): such files
are recorded when slim opens them, so changes while slim streams them still show.
Readers that decode storages (deflated ``.npz`` members...) open the file by path themselves;
the final check covers what they read.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import io
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal, ParamSpec, TypeVar, overload

from modelsize.errors import InputError, printable
from modelsize.formats.base import real_path

if TYPE_CHECKING:
    from modelsize.inventory import Inventory

P = ParamSpec("P")
T = TypeVar("T")

#: (st_dev, st_ino, st_size, st_mtime_ns): what tells one file, as written once, from another.
Identity = tuple[int, int, int, int]

#: How deep and how many entries the snapshot looks at (as ``check_tree`` does).
_SCAN_DEPTH = 2
_SCAN_ENTRIES = 10_000


def identity(st: os.stat_result) -> Identity:
    """The identity of a file from its ``stat``."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _real(path: str | Path) -> str:
    """The key of a path: every link followed; a loop or a dangling link keeps its own
    absolute name (the reader that opens it says what is wrong with it)."""
    try:
        return str(real_path(path, must_exist=False))
    except InputError:
        return os.path.abspath(path)


class InputTable:
    """The input files of one operation: identity at the start, one open descriptor each."""

    def __init__(self, path: str | Path, action: str = "slim") -> None:
        self.path = path
        self.action = action
        self.before: dict[str, Identity] = {}
        #: realpath -> (descriptor or None where none could be opened, identity, path as named)
        self.files: dict[str, tuple[int | None, Identity, str]] = {}
        self._keys: dict[str, str] = {}
        self._snapshot(Path(path))

    # -- the snapshot, before any reader reads -------------------------------------------
    def _snapshot(self, root: Path) -> None:
        try:
            st = os.stat(root)
        except (OSError, ValueError):
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode):
            self._scan(root, _SCAN_DEPTH)
            return
        folder = None
        if st is not None and stat.S_ISREG(st.st_mode):
            name = str(root)
            if root.name not in ("", ".", "..") and name not in self._keys:
                with contextlib.suppress(OSError):
                    if not stat.S_ISLNK(os.lstat(name).st_mode):
                        # Not a link: its key is its folder's with its name (one realpath,
                        # the folder's, which the scan below needs too).
                        folder = _real(root.parent)
                        self._keys[name] = os.path.join(folder, root.name)
            self._record(name, st)
            with contextlib.suppress(OSError):
                self._open(name)  # the named file: open before the reader reads it
        # Shards named by an index, a prefix's .index/.data-*: the files beside it that share
        # the name's first word (model.safetensors.index.json: model-00001-of-00002...).
        word = re.split(r"[.-]", root.name, maxsplit=1)[0]
        self._scan(root.parent, 1, word, folder)

    def _scan(self, root: Path, depth: int, prefix: str = "", real_root: str | None = None
              ) -> None:
        todo, seen = [(root, 1)], 0
        while todo:
            folder, level = todo.pop()
            try:
                real = real_root if real_root is not None and folder is root else _real(folder)
                with os.scandir(folder) as entries:
                    for entry in entries:
                        seen += 1
                        if seen > _SCAN_ENTRIES:
                            return
                        if not entry.name.startswith(prefix):
                            continue
                        try:
                            link = entry.is_symlink()
                            if entry.is_dir():
                                if level < depth and not link:
                                    todo.append((Path(entry.path), level + 1))
                                continue
                            st = entry.stat()
                        except OSError:
                            continue
                        if stat.S_ISREG(st.st_mode):
                            key = (_real(entry.path) if link
                                   else os.path.join(real, entry.name))
                            self.before.setdefault(key, identity(st))
            except OSError:
                continue

    def _record(self, path: str, st: os.stat_result) -> None:
        self.before.setdefault(self._key(path), identity(st))

    def _key(self, path: str | Path) -> str:
        name = os.fspath(path)
        key = self._keys.get(name)
        if key is None:
            key = self._keys[name] = _real(name)
        return key

    # -- after the reader --------------------------------------------------------------
    def adopt(self, paths: Iterable[str | Path]) -> None:
        """Open each file the reader found, once, refusing one that is not the file that
        was there at the start."""
        for p in paths:
            self._open(os.fspath(p))

    def confirm(self, paths: Iterable[str | Path]) -> None:
        """Without opening anything (``inspect``): each file is still the one of the start."""
        for p in paths:
            key = self._key(p)
            before = self.before.get(key)
            if before is None:
                continue
            try:
                now = identity(os.stat(p))
            except OSError:
                raise self.changed() from None
            if now != before:
                raise self.changed()
        self.check()

    def _open(self, path: str) -> int | None:
        key = self._key(path)
        hit = self.files.get(key)
        if hit is not None:
            return hit[0]
        before = self.before.get(key)
        fd: int | None = None
        try:
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                # Out of descriptors (a checkpoint of thousands of files): read by path.
            st = os.fstat(fd) if fd is not None else os.stat(path)
        except OSError:
            if fd is not None:
                os.close(fd)
            if before is not None:
                raise self.changed() from None  # it was there at the start
            return None  # not a file of ours to hold (the reader will have said)
        if not stat.S_ISREG(st.st_mode):
            if fd is not None:
                os.close(fd)
            return None
        now = identity(st)
        if before is not None and now != before:
            if fd is not None:
                os.close(fd)
            raise self.changed()
        self.files[key] = (fd, now, path)
        return fd

    def descriptor(self, path: str | Path) -> int | None:
        """The open descriptor of an input file, or ``None`` if it is not one of them."""
        hit = self.files.get(self._key(path))
        return hit[0] if hit is not None else None

    def check(self) -> None:
        """Every file opened is still the one of the start, by its path and by descriptor."""
        for fd, ident, path in self.files.values():
            try:
                same = identity(os.stat(path)) == ident and (
                    fd is None or identity(os.fstat(fd)) == ident)
            except OSError:
                same = False
            if not same:
                raise self.changed()

    def changed(self) -> InputError:
        """The one-line refusal."""
        what = ("nothing was written" if self.action == "slim" else
                "its sizes would be wrong: inspect it again once it is saved")
        return InputError(f"{printable(str(self.path))} changed while it was being read; {what}")

    def close(self) -> None:
        """Close every descriptor."""
        for fd, _, _ in self.files.values():
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.files.clear()


#: The tables of the operations running now in this thread or task (innermost last).
_ACTIVE: contextvars.ContextVar[tuple[InputTable, ...]] = contextvars.ContextVar(
    "modelsize_inputs", default=())


@contextlib.contextmanager
def watch(path: str | Path, action: str = "slim") -> Iterator[InputTable]:
    """Snapshot ``path``'s files now (before reading) and make the table active until exit."""
    table = InputTable(path, action)
    token = _ACTIVE.set((*_ACTIVE.get(), table))
    try:
        yield table
    finally:
        _ACTIVE.reset(token)
        table.close()


def watched(fn: Callable[P, T]) -> Callable[P, T]:
    """Run ``fn(path, ...)`` inside :func:`watch` of its first argument."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        path = args[0] if args else kwargs["path"]
        with watch(path):  # type: ignore[arg-type]
            return fn(*args, **kwargs)

    return wrapper


def read(path: str | Path) -> Inventory:
    """:func:`modelsize.formats.read`, then every file it found held open in the active table
    (each checked to be the file that was there when the table was made)."""
    from modelsize import formats

    inv = formats.read(path)
    table = current()
    if table is not None:
        table.adopt(f.path for f in inv.files)
    return inv


def current() -> InputTable | None:
    """The innermost active table."""
    active = _ACTIVE.get()
    return active[-1] if active else None


def _find(path: str | Path) -> int | None:
    for table in reversed(_ACTIVE.get()):
        fd = table.descriptor(path)
        if fd is not None:
            return fd
    return None


def ensure_unchanged() -> None:
    """Raise the one-line :class:`InputError` if any active input changed since the start."""
    for table in _ACTIVE.get():
        table.check()


@contextlib.contextmanager
def reading(path: str | Path) -> Iterator[int]:
    """A descriptor to ``pread`` ``path`` with: the input table's (left open), or one opened
    here (closed on exit) for a file that is no input (an output read back)."""
    fd = _find(path)
    if fd is not None:
        yield fd
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd
    finally:
        os.close(fd)


def open_fd(path: str | Path) -> int:
    """A new descriptor of input file ``path`` (the caller closes it), with its own file
    position, on the very file the table holds: ``os.open(path, O_RDONLY)`` for writers."""
    fd = _find(path)
    if fd is None:
        table = current()
        if table is not None:
            fd = table._open(os.fspath(path))
    if fd is not None:
        with contextlib.suppress(OSError):
            return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    return os.open(path, os.O_RDONLY)


@overload
def open_input(path: str | Path, buffering: Literal[0]) -> io.FileIO: ...
@overload
def open_input(path: str | Path, buffering: Literal[-1] = -1) -> io.BufferedReader: ...
def open_input(path: str | Path, buffering: int = -1) -> io.FileIO | io.BufferedReader:
    """``open(path, "rb")`` for a writer reading an input file, through :func:`open_fd`."""
    return os.fdopen(open_fd(path), "rb", buffering=buffering)  # type: ignore[return-value]


def reopen_path(path: str | Path) -> str:
    """A path a library that takes names (h5py) can open to read the table's file for
    ``path``: ``/proc/self/fd/N`` where there is one, else ``path``."""
    fd = _find(path)
    if fd is not None and os.path.isdir("/proc/self/fd"):
        return f"/proc/self/fd/{fd}"
    return os.fspath(path)
