"""The Reader protocol and the :class:`Source` a reader sniffs.

A reader has a ``name``, the ``extensions`` it usually sees, ``sniff(source) -> bool`` (magic
bytes beat extensions) and ``read(source) -> Inventory``. Readers import their framework, if
any, inside ``read`` so that sniffing costs nothing and ``inspect`` runs without frameworks.

Paths that are neither regular files nor directories are refused before anything opens them:
opening a named pipe blocks until someone writes to it, and a device such as ``/dev/zero``
reads as an endless (or empty) file whose size means nothing. :meth:`Source.open` checks the
path it is given and, for a directory, the entries a reader may open inside it;
:func:`check_file` is the same check for any other path a reader is about to open.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from modelsize._records import field, record
from modelsize.errors import InputError, PathNotFoundError, printable
from modelsize.inventory import Inventory

if TYPE_CHECKING:
    from modelsize.formats import _zip

HEAD_BYTES = 4096
#: How deep :meth:`Source.open` looks into a directory for special files: the directory and
#: its subfolders (``global_step1/``, ``variables/``, ``checkpoint-500/``), where readers look.
_SCAN_DEPTH = 2
#: Entries looked at, at most: a directory this large is no checkpoint, and readers refuse it.
_SCAN_ENTRIES = 10_000
_SPECIAL = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
#: stat() errors that mean "nothing there", as :meth:`pathlib.Path.exists` reads them.
_MISSING = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EBADF)


def special_kind(mode: int) -> str | None:
    """What a path is when it is neither a regular file nor a directory, from its ``st_mode``
    (``"a named pipe (FIFO)"``, ``"a character device"``...); ``None`` for files and folders."""
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return next((what for test, what in _SPECIAL if test(mode)), "not a regular file")


def not_a_file(path: str | Path, what: str) -> InputError:
    """The error for a special path (raise it): one line saying what the path is."""
    return InputError(f"{printable(str(path))}: is {what}, not a model file")


def check_file(path: str | Path) -> os.stat_result:
    """``stat`` of a path a reader is about to open (symlinks followed), refusing FIFOs,
    devices and sockets with :func:`not_a_file`. ``OSError`` (a missing path...) propagates."""
    st = os.stat(path)
    what = special_kind(st.st_mode)
    if what is not None:
        raise not_a_file(path, what)
    return st


def real_path(path: str | Path, *, must_exist: bool = True) -> Path:
    """The absolute path with every symbolic link followed: the one way modelsize resolves
    a path (never ``Path.resolve()`` or ``os.path.realpath`` directly).

    A link that loops (to itself, or round a circle) is the input's fault and becomes one line
    (:class:`~modelsize.errors.InputError`, exit 2), where ``Path.resolve()`` raises
    ``RuntimeError`` (Python < 3.13) and ``realpath`` quietly returns a path. So is a link
    that points at nothing, and a path that is not there (:class:`PathNotFoundError`), unless
    ``must_exist=False`` (an output about to be written): then it is resolved as far as it goes.
    """
    try:
        return Path(os.path.realpath(path, strict=True))
    except OSError as exc:
        shown = printable(str(path))
        if exc.errno == errno.ELOOP:
            raise InputError(f"{shown}: symbolic link loop (a link that leads back to "
                             "itself); point modelsize at the real file") from None
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise InputError(f"{shown}: cannot read: {exc.strerror or exc}") from None
        if not must_exist:
            return Path(os.path.realpath(path))
        try:
            target = os.readlink(path)
        except OSError:
            raise PathNotFoundError(path) from None
        raise InputError(f"{shown}: symbolic link to {printable(target)}, which does not "
                         "exist") from None


def is_regular_file(path: str | Path) -> bool:
    """:meth:`pathlib.Path.is_file` for a file a checkpoint names (a shard in an index...):
    ``False`` if nothing is there, but a FIFO, device or socket is refused, not passed over."""
    try:
        check_file(path)
    except OSError:
        return False
    return True


def check_tree(root: Path) -> None:
    """Refuse a model directory holding a FIFO, device or socket where a reader may look.

    Readers list a checkpoint directory with ``is_file()``, which quietly passes over a named
    pipe called ``model.safetensors``: the checkpoint would be read without that shard, or a
    reader would open it and wait forever. No checkpoint holds such entries, so any one of
    them, down to :data:`_SCAN_DEPTH` levels, is an error. Directory links are not followed.
    """
    todo, seen = [(root, 1)], 0
    while todo:
        folder, depth = todo.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    seen += 1
                    if seen > _SCAN_ENTRIES:
                        return
                    if entry.is_dir(follow_symlinks=False):
                        if depth < _SCAN_DEPTH:
                            todo.append((Path(entry.path), depth + 1))
                        continue
                    if entry.is_file(follow_symlinks=False):
                        continue
                    try:
                        what = special_kind(entry.stat().st_mode)  # a link: its target
                    except OSError:
                        continue  # a dangling link is the reader's "missing" to report
                    if what is not None:
                        raise not_a_file(entry.path, what)
        except OSError:
            continue  # an unreadable subfolder: the reader says so if it needs it


@record
class Source:
    """What a reader may look at before committing to a path: cheap facts, computed once."""

    path: Path
    kind: str  # "file", "dir" or "missing"
    head: bytes = b""
    size: int = 0
    _zip_infos: list[_zip.Entry] | None = field(default=None, repr=False)
    _zip_checked: bool = field(default=False, repr=False)

    @classmethod
    def open(cls, path: str | Path) -> Source:
        """Stat the path and read the first bytes of a file.

        A FIFO, device or socket is refused (:func:`not_a_file`) without being opened, and so
        is a directory holding one (:func:`check_tree`).
        """
        if isinstance(path, str) and not path:
            raise PathNotFoundError(path, "an empty path")
        p = Path(path)
        if p.name in ("", ".."):
            # ".", "..", "run/..": no name to print or to build an output's name from
            # ("x.slim"); the real folder has one.
            p = real_path(p)
        try:
            st = p.stat()
        except OSError as exc:
            if exc.errno in _MISSING:
                return cls(p, "missing")
            raise
        if stat.S_ISDIR(st.st_mode):
            check_tree(p)
            return cls(p, "dir")
        what = special_kind(st.st_mode)
        if what is not None:
            raise not_a_file(p, what)
        with open(p, "rb") as fh:
            head = fh.read(HEAD_BYTES)
        return cls(p, "file", head, st.st_size)

    @property
    def suffix(self) -> str:
        """Lower-case extension, with the dot."""
        return self.path.suffix.lower()

    @property
    def is_zip(self) -> bool:
        """A zip archive (local file header magic)."""
        return self.head[:4] == b"PK\x03\x04"

    def zip_infos(self) -> list[_zip.Entry] | None:
        """The central directory of a zip archive, parsed once; ``None`` if unreadable.

        Sniffing reads it and the reader reuses it: parsing it costs as much as a checkpoint's
        whole pickle.
        """
        if not self._zip_checked:
            self._zip_checked = True
            if self.is_zip:
                from modelsize.formats import _zip

                try:
                    self._zip_infos = _zip.directory(self.path)
                except (_zip.bad_zip_class(), OSError, ValueError, EOFError,
                        NotImplementedError):
                    # NotImplementedError: zipfile on a version field it does not know.
                    self._zip_infos = None
        return self._zip_infos

    def forget_zip_infos(self) -> None:
        """Let go of the parsed central directory (a reader that took what it needs from it):
        for an archive of 100,000 members it holds tens of MB. A later :meth:`zip_infos`
        parses it again."""
        self._zip_infos = None
        self._zip_checked = False

    def zip_names(self) -> list[str]:
        """Member names of a zip archive from its central directory (empty if unreadable)."""
        return [info.filename for info in self.zip_infos() or ()]


@runtime_checkable
class Reader(Protocol):
    """One file format."""

    name: str
    extensions: tuple[str, ...]

    def sniff(self, source: Source) -> bool:
        """Whether this reader recognises the source (from magic bytes, then structure)."""
        ...

    def read(self, source: Source) -> Inventory:
        """Account for every byte of the source. Raises ``CorruptFileError`` on bad input."""
        ...


class SeekableBytes(io.RawIOBase):
    """A read-only, seekable file of ``size`` bytes whose subclass says how to read them
    (``readinto`` from ``pos``): a slice of another file, bytes fetched so far."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.pos = size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, {0: 0, 1: self.pos, 2: self.size}[whence] + pos)
        return self.pos
