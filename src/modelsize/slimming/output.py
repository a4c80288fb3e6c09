"""Writing output files so that nothing is ever half there.

What is guaranteed, for every writer:

* **Never a complete-looking output under OUT's name before it is verified, nor after a
  kill.** Each file is written *anonymously* (Linux ``O_TMPFILE``: an inode with no name, so a
  process killed while writing, even by ``SIGKILL``, leaves nothing) and fsynced. For
  verification (readers go by names: suffixes, a ``.npy``'s stem, files that name each other)
  the files then get their names inside a staging folder beside OUT whose own name says what
  it is, ``.OUT.modelsize-partial-PID-XXXX/``; only once verified do they get OUT's name.
  Where ``O_TMPFILE`` is missing the files are written straight into the staging folder.
  The fsync runs on a thread of its own while verification reads the files back, and the
  commit waits for it (and raises its error); large ranges are handed to the kernel's
  writeback as soon as they are written and read back (:class:`OutputFile`).
* **Nothing left behind.** Any error or ``KeyboardInterrupt`` removes the staging folder and
  the unnamed files. A process killed outright cannot clean up, so each staging folder has a
  janitor: a tiny ``sh`` holding the read end of a pipe whose write end only this process
  holds; when this process dies before the commit the kernel closes the pipe and the janitor
  removes the folder (at once, ``SIGKILL`` and the OOM killer included). Behind that, a
  staging folder is *owned*: its name holds the owner's pid and the owner holds an ``flock``
  on it; every slim into the same folder removes the staging folders whose owner is dead (its
  pid gone and its lock free), and never a live one.
* **No silent replacement.** Without ``force`` OUT gets its name by ``link()`` (a file) or
  ``renameat2(RENAME_NOREPLACE)`` (a folder), so an OUT that appeared while slim was writing
  is refused (:class:`~modelsize.errors.OutputError`, "OUT appeared while slim was writing;
  nothing was replaced"), never overwritten. With ``force`` a file is replaced by
  ``rename()`` and a folder swapped in by ``renameat2(RENAME_EXCHANGE)``: atomic, the last
  commit wins. Commits into one folder take an ``flock`` on it, so the files of two concurrent
  multi-file outputs never interleave. The main file is named last and the folder fsynced.
* **Space and permissions up front.** :meth:`Output.check` refuses an output folder on a
  read-only filesystem, one this process may not write, or one without room for the predicted
  size (``statvfs``), in one line saying how much is needed and how much is free. ``ENOSPC``,
  ``EDQUOT``, ``EFBIG``, ``EROFS``, ``EACCES`` and ``EPERM`` that still happen while writing,
  at fsync, link or rename are :class:`~modelsize.errors.OutputError`: one line naming OUT
  (never the staging name), nothing left behind.
* **The input never changes under the output.** The input is never opened for writing; an
  output that is the input, or an existing output without ``force``, is refused before anything
  is written; and :func:`modelsize.inputs.ensure_unchanged` runs after the last read of the
  input and again, after verification, as the first step of the commit.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import io
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from modelsize.errors import OutputError, UsageError, printable
from modelsize.formats.base import real_path, special_kind
from modelsize.inputs import ensure_unchanged
from modelsize.slimming.checksum import EarlyCRCs

try:
    import fcntl
except ImportError:  # pragma: no cover (not POSIX)
    fcntl = None  # type: ignore[assignment]

T = TypeVar("T")

_PARTIAL = ".modelsize-partial-"
#: The staging folders of earlier versions (no owner recorded).
_LEGACY = ".modelsize-tmp-"
_OWNED = re.compile(r"\..*\.modelsize-partial-(\d+)-")
#: Seconds a commit waits for another process's commit into the same folder.
_COMMIT_WAIT = 30.0

#: errno -> what the one line says; these always concern the output being written.
_FULL = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large for the filesystem",
    errno.EROFS: "the folder is on a read-only filesystem",
}
#: These concern the output when the failing call named a path in its folder (or none).
_DENIED = {
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _human(n: int) -> str:
    from modelsize.report.units import human_bytes

    return human_bytes(n)


def free_bytes(folder: Path) -> int | None:
    """Bytes this process may still write in ``folder``'s filesystem (``None``: unknown)."""
    try:
        vfs = os.statvfs(folder)
    except OSError:
        return None
    blocks = vfs.f_bfree if os.geteuid() == 0 else vfs.f_bavail  # root may use the reserve
    return blocks * vfs.f_frsize


class Output:
    """The files of one output, staged and committed together.

    ``target`` is the path the user named. With ``directory=False`` the output is one or more
    files named relative to ``target.parent`` (``model.slim.pt``; a TensorFlow prefix's
    ``.index`` and ``.data-*``); with ``directory=True`` ``target`` is a folder and the files
    are named relative to it (sharded checkpoints).
    """

    def __init__(
        self, target: Path, *, directory: bool = False, force: bool = False,
        inputs: tuple[Path, ...] = (),
    ) -> None:
        self.target = target
        self.directory = directory
        self.force = force
        self.inputs = inputs
        self.base = target if directory else target.parent
        self.parent = target.parent
        self.files: dict[str, BinaryIO] = {}
        self.order: list[str] = []
        self.names: list[str] | None = None
        self.needed: int | None = None
        self.staging: Path | None = None
        self.committed = False
        self._owner: int | None = None
        self._janitor: tuple[int, int] | None = None
        self._anonymous = hasattr(os, "O_TMPFILE")
        self._syncing: _Fsync | None = None

    # -- checks -----------------------------------------------------------------------
    def check(self, names: list[str], needed: int | None = None) -> None:
        """Refuse before writing: output equal to an input, existing without ``force``, a
        folder that cannot be written or has no room for ``needed`` bytes. Removes the
        staging folders that dead slims left in the output's folder."""
        paths = [self.target] if self.directory else [self.base / n for n in names]
        for p in [self.target, *paths]:
            for source in self.inputs:
                if real_path(p, must_exist=False) == real_path(source, must_exist=False) \
                        or _same(p, source):
                    raise UsageError(
                        f"{printable(str(p))}: the output would overwrite the input; "
                        "choose another -o path"
                    )
            if self.directory and self.inputs and any(
                real_path(source, must_exist=False).is_relative_to(
                    real_path(self.target, must_exist=False)) for source in self.inputs
            ):
                raise UsageError(
                    f"{printable(str(self.target))}: the output folder holds the input; "
                    "choose another -o path"
                )
        existing = [p for p in paths if p.exists() or p.is_symlink()]
        for p in existing:
            # --force replaces files, never a FIFO or a device: as root, /dev/null would go.
            with contextlib.suppress(OSError):
                what = special_kind(p.stat().st_mode)
                if what is not None:
                    raise UsageError(
                        f"{printable(str(p))}: is {what}, not a file slim may replace; "
                        "choose another -o path"
                    )
        if existing and not self.force:
            raise UsageError(
                f"{printable(str(existing[0]))} exists; use --force to replace it"
            )
        if self.directory and self.target.exists() and not self.target.is_dir():
            raise UsageError(f"{printable(str(self.target))} exists and is not a folder")
        if not self.parent.is_dir():
            raise UsageError(f"{printable(str(self.parent))}: no such folder for the output")
        self.names = list(names)
        self.needed = needed
        self._check_folder(needed)
        remove_dead_staging(self.parent, self.target.name)

    def _check_folder(self, needed: int | None) -> None:
        """A folder we may write in, with room for ``needed`` bytes."""
        folder = self.parent
        where = printable(str(folder))
        with contextlib.suppress(OSError):
            if os.statvfs(folder).f_flag & os.ST_RDONLY:
                raise self._error(f"{where} is on a read-only filesystem")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise self._error(f"cannot write in {where} (permission denied)")
        free = free_bytes(folder)
        if needed is not None and free is not None and free < needed:
            raise self._error(f"needs {_human(needed)} free in {where}, "
                              f"and {_human(free)} is free")

    def _error(self, why: str) -> OutputError:
        return OutputError(f"{printable(str(self.target))}: {why}; nothing was written")

    def error_for(self, exc: OSError) -> OutputError | None:
        """The one-line error for an ``OSError`` met while writing, fsyncing or naming the
        output (disk full, read-only, denied); ``None`` for any other."""
        why = _FULL.get(exc.errno or 0)
        if why is None and exc.errno in _DENIED and self._concerns_output(exc):
            why = _DENIED[exc.errno or 0]
        if why is None:
            return None
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            free = free_bytes(self.parent)
            if free is not None:
                need = f"{_human(self.needed)} needed, " if self.needed else ""
                why += f" ({need}{_human(free)} free in {printable(str(self.parent))})"
        return OutputError(f"{printable(str(self.target))}: cannot write it: {why}; "
                           "nothing was written")

    def _concerns_output(self, exc: OSError) -> bool:
        named = [f for f in (exc.filename, exc.filename2) if f is not None]
        if not named:
            return True  # a write or fsync on one of our own descriptors
        folder = os.path.abspath(self.parent)
        return any(os.path.abspath(os.fsdecode(f)).startswith(folder)
                   or os.fsdecode(f).startswith("/proc/self/fd/") for f in named)

    # -- writing ----------------------------------------------------------------------
    def open(self, name: str) -> BinaryIO:
        """A new, empty, readable and writable file that will be ``name`` once committed."""
        if name in self.files:
            raise ValueError(f"output file {name!r} opened twice")
        fh: BinaryIO
        if self._anonymous:
            try:
                fd = os.open(self.parent, os.O_TMPFILE | os.O_RDWR, 0o644)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                    raise
                self._anonymous = False  # the filesystem does not support it
        if self._anonymous:
            fh = OutputFile(io.FileIO(fd, "r+"))
        else:
            path = self._stage() / name
            path.parent.mkdir(parents=True, exist_ok=True)
            fh = OutputFile(io.FileIO(path, "w+"))
        self.files[name] = fh
        self.order.append(name)
        return fh

    def _stage(self) -> Path:
        if self.staging is None:
            stem = self.target.name[:150]
            name = f".{stem}{_PARTIAL}{os.getpid()}-{secrets.token_hex(4)}"
            path = self.parent / name
            path.mkdir()
            self.staging = path
            self._owner = _lock(path, wait=False)
            self._janitor = _spawn_janitor(path)
        return self.staging

    def early_crcs(self, path: Path) -> Callable[[int, int], int | None] | None:
        """For the staged file at ``path``: ``crc(offset, nbytes)``, the CRC-32 of a range
        read back while the file was written (``None`` where it was not, or was written again
        since: verification reads it then)."""
        stage = self.staging
        if stage is None:
            return None
        for name, fh in self.files.items():
            if isinstance(fh, OutputFile) and os.path.abspath(stage / name) == os.path.abspath(
                    path):
                return fh.read_back
        return None

    def staged_path(self) -> Path:
        """Where the output can be read before it is committed (what verification reads)."""
        stage = self._stage()
        return stage if self.directory else stage / self.target.name

    def seal(self) -> None:
        """Flush and name every file inside the staging folder, and start fsyncing them on a
        thread of their own: verification reads the files back while the disk writes them.
        :meth:`commit` waits for the fsync (and raises its error) before naming anything."""
        stage = self._stage()
        for name in self.order:
            fh = self.files[name]
            fh.flush()
            if self._anonymous:
                dest = stage / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                _link_unnamed(fh.fileno(), dest)
        fds = [self.files[name].fileno() for name in self.order]
        self._syncing = _Fsync(fds)

    def synced(self) -> None:
        """Wait for the fsync :meth:`seal` started, raise its error, close the files."""
        syncing, self._syncing = self._syncing, None
        try:
            if syncing is not None:
                syncing.wait()
        finally:
            for fh in self.files.values():
                with contextlib.suppress(OSError):
                    fh.close()

    def commit(self, main: str | None = None) -> None:
        """Check the input is unchanged, then give the staged files their names (``main``
        last; without ``force`` never over an OUT that appeared meanwhile) and fsync the
        folder."""
        self.synced()
        ensure_unchanged()
        stage = self._stage()
        with _committing(self.parent):
            if self.directory:
                self._commit_folder(stage)
            else:
                self._commit_files(stage, main)
        _fsync_dir(self.parent)
        self.staging = None
        self.committed = True
        self._release()

    def _appeared(self) -> OutputError:
        return OutputError(f"{printable(str(self.target))} appeared while slim was writing; "
                           "nothing was replaced")

    def _commit_files(self, stage: Path, main: str | None) -> None:
        names = [n for n in self.order if n != main] + ([main] if main in self.order else [])
        linked: list[tuple[Path, Path]] = []
        try:
            for name in names:
                src, dest = stage / name, self.base / name
                if dest.is_dir() and not dest.is_symlink():
                    raise UsageError(f"{printable(str(dest))} is a folder; cannot replace it")
                if self.force:
                    os.replace(src, dest)
                    continue
                try:
                    _link_noreplace(src, dest)
                except FileExistsError:
                    raise self._appeared() from None
                linked.append((src, dest))
        except BaseException:
            for src, dest in linked:  # take back the names given so far
                with contextlib.suppress(OSError):
                    if os.path.samefile(src, dest):
                        dest.unlink()
            raise
        shutil.rmtree(stage, ignore_errors=True)

    def _commit_folder(self, stage: Path) -> None:
        target = self.target
        try:
            done = _renameat2(stage, target, _RENAME_NOREPLACE)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            if not self.force:
                raise self._appeared() from None
            if _renameat2(stage, target, _RENAME_EXCHANGE):
                _remove(stage)  # now the old output
                return
            done = False
        if done:
            return
        # No renameat2 here: check, then rename (a narrow race remains).
        old = None
        if target.exists() or target.is_symlink():
            if not self.force:
                raise self._appeared()
            old = stage.with_name(stage.name + "-old")
            os.replace(target, old)
        os.replace(stage, target)
        if old is not None:
            _remove(old)

    def discard(self) -> None:
        """Close and remove everything written (the target is untouched)."""
        with contextlib.suppress(OSError):
            self.synced()
        for fh in self.files.values():
            with contextlib.suppress(OSError):
                fh.close()
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None
        self._release()

    def _release(self) -> None:
        if self._janitor is not None:
            _dismiss_janitor(*self._janitor)
            self._janitor = None
        if self._owner is not None:
            with contextlib.suppress(OSError):
                os.close(self._owner)
            self._owner = None


class OutputFile(io.BufferedRandom):
    """A file of the output, as writers get it: a buffered file that also reads back, on
    other threads, the byte ranges a writer reports written straight to its descriptor
    (:meth:`wrote`), so verification finds their CRC-32 done.

    A range read back early counts only if no byte of it was written again later: the file
    keeps the ranges rewritten after a seek backwards (a zip member's header patched once its
    data is written), from the seek to the next one (or to the verification), and a
    truncation; verification reads any range they touch again. Every write of a writer goes
    through this object or is reported by :meth:`wrote`.
    """

    def __init__(self, raw: io.FileIO) -> None:
        super().__init__(raw)
        self.early = EarlyCRCs(raw.fileno())
        self.high = 0  # the end of the furthest range reported written
        self.rewritten: list[tuple[int, int]] = []
        self._back: int | None = None  # where the current rewrite started
        self._merged: tuple[list[int], list[int], int] | None = None  # rewritten, merged

    def _end_rewrite(self) -> None:
        if self._back is not None:
            self.rewritten.append((self._back, max(self._back, super().tell())))
            self._back = None

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """Seek; a seek before the end of a range read back starts a rewrite."""
        self._end_rewrite()
        pos = super().seek(offset, whence)
        if pos < self.high:
            self._back = pos
        return pos

    def truncate(self, size: int | None = None) -> int:
        """Truncate; whatever lay past ``size`` counts as rewritten."""
        end = super().truncate(size)
        self.rewritten.append((end, 1 << 63))
        return end

    def wrote(self, offset: int, nbytes: int) -> None:
        """``nbytes`` at ``offset`` are written (in the file, not in this object's buffer):
        read them back now, on another thread, then have the kernel start writing them to
        the disk (the fsync before the commit then finds most of the file there)."""
        self.high = max(self.high, offset + nbytes)
        fd = self.fileno()
        self.early.add(offset, nbytes, then=lambda: _start_writeback(fd, offset, nbytes))

    def read_back(self, offset: int, nbytes: int) -> int | None:
        """The CRC-32 of ``nbytes`` at ``offset`` read back early, if no byte of them was
        written again since (``None``: read them)."""
        if (offset, nbytes) not in self.early.futures:
            return None
        self._end_rewrite()
        if self._merged is None or self._merged[2] != len(self.rewritten):
            starts: list[int] = []
            ends: list[int] = []
            for start, stop in sorted(self.rewritten):
                if ends and start <= ends[-1]:
                    ends[-1] = max(ends[-1], stop)
                else:
                    starts.append(start)
                    ends.append(stop)
            self._merged = (starts, ends, len(self.rewritten))
        starts, ends, _ = self._merged
        i = bisect.bisect_left(starts, offset + nbytes) - 1  # the last starting before the end
        if i >= 0 and ends[i] > offset:
            return None
        return self.early.crc(offset, nbytes)

    def close(self) -> None:
        """Wait for the reads back, then close."""
        self.early.close()
        super().close()


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range_fn: Any = None


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """``sync_file_range(SYNC_FILE_RANGE_WRITE)``: start writing the range's dirty pages to
    the disk without waiting (Linux; nothing elsewhere). No durability is claimed from it:
    the commit still waits for ``fsync``."""
    global _sync_file_range_fn
    if _sync_file_range_fn is None:
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _sync_file_range_fn = fn
        except (OSError, AttributeError, ImportError):
            _sync_file_range_fn = False
    if _sync_file_range_fn is not False:
        _sync_file_range_fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class _Fsync:
    """``fsync`` of some descriptors, in order, on a thread of its own."""

    def __init__(self, fds: list[int]) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fds,), daemon=True,
                                       name="modelsize-fsync")
        self.thread.start()

    def _run(self, fds: list[int]) -> None:
        try:
            for fd in fds:
                os.fsync(fd)
        except BaseException as exc:  # raised again by wait(), in the caller's thread
            self.error = exc

    def wait(self) -> None:
        """Wait for the last fsync; raise the first error met."""
        self.thread.join()
        if self.error is not None:
            raise self.error


# -- ownership of staging folders ----------------------------------------------------------
def _lock(path: Path, wait: bool) -> int | None:
    """An open descriptor of folder ``path`` holding an exclusive ``flock`` (``None`` if it
    is held elsewhere and ``wait`` is false; the descriptor without a lock where the
    filesystem has no ``flock``). Closing the descriptor releases it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    if fcntl is None:
        return fd
    deadline = time.monotonic() + _COMMIT_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if not wait or time.monotonic() > deadline:
                os.close(fd)
                return None
            time.sleep(0.01)
        except OSError:
            return fd  # no flock on this filesystem


@contextlib.contextmanager
def _committing(folder: Path) -> Iterator[None]:
    """Commits into one folder, one at a time (across processes); after a wait of
    :data:`_COMMIT_WAIT` seconds for a stuck one, go on anyway."""
    fd = _lock(folder, wait=True)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


_JANITOR = 'read -r word; [ "$word" = done ] || rm -rf -- "$1"'


def _spawn_janitor(stage: Path) -> tuple[int, int] | None:
    """A tiny ``sh`` that removes ``stage`` when this process dies before it says ``done``
    (even by ``SIGKILL``: the kernel closes the pipe, ``read`` sees its end). Its own session,
    so a Ctrl-C on the terminal does not end it first. ``(pid, pipe)``; ``None`` without
    ``/bin/sh`` (the next slim removes dead owners' staging then)."""
    if not hasattr(os, "posix_spawn") or not os.path.exists("/bin/sh"):
        return None
    r, w = os.pipe()  # both ends close on exec: only the child's stdin survives
    try:
        pid = os.posix_spawn(
            "/bin/sh", ["sh", "-c", _JANITOR, "modelsize-janitor", os.fspath(stage)],
            {"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            file_actions=[(os.POSIX_SPAWN_DUP2, r, 0),
                          (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                          (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)],
            setsid=True,
        )
    except OSError:
        os.close(w)
        return None
    finally:
        os.close(r)
    return pid, w


def _dismiss_janitor(pid: int, pipe: int) -> None:
    """Tell the janitor the staging folder is taken care of, and reap it."""
    with contextlib.suppress(OSError):
        os.write(pipe, b"done\n")
    with contextlib.suppress(OSError):
        os.close(pipe)
    with contextlib.suppress(OSError):
        os.waitpid(pid, 0)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process
    return True


def remove_dead_staging(folder: Path, target: str | None = None) -> list[Path]:
    """Remove the staging folders in ``folder`` whose owner is dead: its pid is gone and
    nobody holds its lock (and, for ``target``, the unowned ones of earlier versions)."""
    removed: list[Path] = []
    legacy = f".{target}{_LEGACY}" if target is not None else None
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        owner = _OWNED.match(entry.name)
        if owner is not None:
            if _alive(int(owner[1])):
                continue
        elif legacy is None or not entry.name.startswith(legacy):
            continue
        with contextlib.suppress(OSError):
            if not entry.is_dir(follow_symlinks=False):
                continue
            fd = _lock(Path(entry.path), wait=False)
            if fd is None:
                continue  # locked: a live owner (in another pid namespace)
            try:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
            finally:
                os.close(fd)
    return removed


# -- naming --------------------------------------------------------------------------------
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2_fn: Any = None


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; ``False`` where the C library or the filesystem has
    no ``renameat2`` with these flags (the caller falls back). ``OSError`` on failure."""
    global _renameat2_fn
    if _renameat2_fn is None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                           ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2_fn = (fn, ctypes.get_errno)
        except (OSError, AttributeError, ImportError):
            _renameat2_fn = False
    if _renameat2_fn is False:
        return False
    fn, get_errno = _renameat2_fn
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def _link_noreplace(src: Path, dest: Path) -> None:
    """Give ``src``'s file the name ``dest`` too, failing with ``FileExistsError`` if
    ``dest`` exists: ``link()``, else ``renameat2(RENAME_NOREPLACE)`` where the filesystem
    has no hard links, else a check before the rename."""
    try:
        os.link(src, dest)
        return
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise
    if _renameat2(src, dest, _RENAME_NOREPLACE):
        return
    if dest.exists() or dest.is_symlink():
        raise FileExistsError(errno.EEXIST, "File exists", str(dest))
    os.rename(src, dest)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _link_unnamed(fd: int, dest: Path) -> None:
    """Give an ``O_TMPFILE`` file a name: ``linkat`` with ``AT_SYMLINK_FOLLOW`` through /proc
    (a directory fd makes Python call ``linkat``, not ``link``, which would not follow)."""
    dir_fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.link(f"/proc/self/fd/{fd}", dest.name, dst_dir_fd=dir_fd, follow_symlinks=True)
    finally:
        os.close(dir_fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def staged(output: Output) -> Iterator[Output]:
    """Discard ``output`` on any exception (``KeyboardInterrupt`` included) before commit;
    a full disk, a read-only folder or a denied write becomes one :class:`OutputError`."""
    try:
        yield output
    except OSError as exc:
        output.discard()
        err = output.error_for(exc)
        if err is None:
            raise
        raise err from exc
    except BaseException:
        output.discard()
        raise
    finally:
        if not output.committed:
            output.discard()


def write_verified(output: Output, write: Callable[[Output], None],
                   verify: Callable[[Path], T], main: str | None = None) -> T:
    """Write, check the input is unchanged, seal, verify the staged output, then commit it
    (which checks the input again); nothing is left on failure."""
    with staged(output):
        write(output)
        ensure_unchanged()
        output.seal()
        result = verify(output.staged_path())
        output.commit(main)
        return result
