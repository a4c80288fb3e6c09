"""Writing output files so that nothing is ever half there.

Every file of an output is first written *anonymously*: on Linux with ``O_TMPFILE``, an inode
with no name in the target's directory, so a process killed mid-write (even by ``SIGKILL``)
leaves nothing behind. When all files are written and fsynced they get names inside a hidden
staging folder beside the target (``.NAME.modelsize-tmp-XXXX``), the output is verified there,
and only then renamed into place, the main file last, and the directory fsynced. Where
``O_TMPFILE`` is not available the files are written straight into the staging folder, which
is removed on any error or ``KeyboardInterrupt``. A staging folder left by a process killed
during verification is removed by the next slim of the same target.

The input is never opened for writing, and an output that is the input, or an existing output
without ``force``, is refused before anything is written.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, TypeVar

from modelsize.errors import UsageError, printable
from modelsize.formats.base import real_path, special_kind

T = TypeVar("T")

_STAGING = ".modelsize-tmp-"


def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


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
        self.staging: Path | None = None
        self.committed = False
        self._anonymous = hasattr(os, "O_TMPFILE")

    # -- checks -----------------------------------------------------------------------
    def check(self, names: list[str]) -> None:
        """Refuse before writing: output equal to an input, or existing without ``force``."""
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
        self._remove_stale()

    def _remove_stale(self) -> None:
        """Staging folders of this target left by a process killed while verifying."""
        prefix = f".{self.target.name}{_STAGING}"
        with contextlib.suppress(OSError):
            for p in self.parent.iterdir():
                if p.name.startswith(prefix) and p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)

    # -- writing ----------------------------------------------------------------------
    def open(self, name: str) -> BinaryIO:
        """A new, empty, readable and writable file that will be ``name`` once committed."""
        if name in self.files:
            raise ValueError(f"output file {name!r} opened twice")
        fh: BinaryIO
        if self._anonymous:
            try:
                fd = os.open(self.parent, os.O_TMPFILE | os.O_RDWR, 0o644)
            except OSError:
                self._anonymous = False  # the filesystem does not support it
        if self._anonymous:
            fh = os.fdopen(fd, "w+b")
        else:
            path = self._stage() / name
            path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(path, "w+b")  # noqa: SIM115 (closed by commit or discard)
        self.files[name] = fh
        self.order.append(name)
        return fh

    def _stage(self) -> Path:
        if self.staging is None:
            name = f".{self.target.name}{_STAGING}{secrets.token_hex(4)}"
            self.staging = self.parent / name
            self.staging.mkdir()
        return self.staging

    def staged_path(self) -> Path:
        """Where the output can be read before it is committed (what verification reads)."""
        stage = self._stage()
        return stage if self.directory else stage / self.target.name

    def seal(self) -> None:
        """Flush, fsync and name every file inside the staging folder."""
        stage = self._stage()
        for name in self.order:
            fh = self.files[name]
            fh.flush()
            os.fsync(fh.fileno())
            if self._anonymous:
                dest = stage / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                _link_unnamed(fh.fileno(), dest)
            fh.close()

    def commit(self, main: str | None = None) -> None:
        """Move the staged files into place (``main`` last) and fsync the directory."""
        stage = self._stage()
        if self.directory:
            old = None
            if self.target.exists():
                old = self.parent / f".{self.target.name}{_STAGING}old-{secrets.token_hex(4)}"
                os.replace(self.target, old)
            os.replace(stage, self.target)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        else:
            names = [n for n in self.order if n != main] + ([main] if main in self.order else [])
            for name in names:
                dest = self.base / name
                if dest.is_dir() and not dest.is_symlink():
                    raise UsageError(f"{printable(str(dest))} is a folder; cannot replace it")
                os.replace(stage / name, dest)
            shutil.rmtree(stage, ignore_errors=True)
        _fsync_dir(self.parent)
        self.staging = None
        self.committed = True

    def discard(self) -> None:
        """Close and remove everything written (the target is untouched)."""
        for fh in self.files.values():
            with contextlib.suppress(OSError):
                fh.close()
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None


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
    """Discard ``output`` on any exception (``KeyboardInterrupt`` included) before commit."""
    try:
        yield output
    except BaseException:
        output.discard()
        raise
    finally:
        if not output.committed:
            output.discard()


def write_verified(output: Output, write: Callable[[Output], None],
                   verify: Callable[[Path], T], main: str | None = None) -> T:
    """Write, seal, verify the staged output, then commit it; nothing is left on failure."""
    with staged(output):
        write(output)
        output.seal()
        result = verify(output.staged_path())
        output.commit(main)
        return result
