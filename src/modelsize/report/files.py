"""Report files (``--html FILE``): checked before the work, written whole or not at all.

Every verb that takes ``--html`` calls :func:`check_output_file` before it starts, so that a
folder that does not exist is one line and exit 2 before a long trace or slim, not an internal
error after the report was printed; :func:`write_text` turns a failure at write time (a full
disk, a folder removed meanwhile) into one line too, and leaves no partial page behind.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from modelsize.errors import InputError, UsageError, printable


def check_output_file(path: str | os.PathLike[str] | None, option: str = "--html") -> None:
    """Refuse (:class:`~modelsize.errors.UsageError`, one line) a report path that cannot
    be written: an empty name, a folder, a folder that does not exist or is not writable, a
    file that is not writable. ``None`` (no report asked for) passes."""
    if path is None:
        return
    shown = f"{option} {printable(os.fspath(path))}"
    if not os.fspath(path):
        raise UsageError(f"{option}: an empty path; name the file to write the report to")
    target = Path(path)
    try:
        st = target.stat()
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise UsageError(f"{shown}: cannot write there: {exc.strerror or exc}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{shown}: is a folder; name the file to write inside it "
                             f"(e.g. {printable(str(target / 'report.html'))})")
        if stat.S_ISREG(st.st_mode) and not os.access(target, os.W_OK):
            raise UsageError(f"{shown}: the file exists and is not writable")
        return  # a device or pipe (/dev/stdout) is written as it is
    folder = target.parent
    if not folder.exists():
        raise UsageError(f"{shown}: folder {printable(str(folder))} does not exist; "
                         "create it first")
    if not folder.is_dir():
        raise UsageError(f"{shown}: {printable(str(folder))} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{shown}: cannot write into folder {printable(str(folder))} "
                         "(permission denied or read-only)")


def write_text(path: str | os.PathLike[str], text: str, option: str = "--html") -> None:
    """Write a report (UTF-8) whole: staged beside ``path`` and renamed over it, so that a
    failure leaves the old file (or none), never half a page. A failure is one line
    (:class:`~modelsize.errors.InputError`) naming ``path``."""
    target = Path(path)
    shown = f"{option} {printable(os.fspath(path))}"
    try:
        special = target.exists() and not target.is_file()
    except OSError:
        special = False
    if special:  # /dev/stdout, a pipe: written as it is
        try:
            target.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise InputError(f"{shown}: cannot write: {exc.strerror or exc}") from None
        return
    staged = target.with_name(f".{target.name}.modelsize-tmp-{os.getpid()}")
    try:
        with open(staged, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(staged, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            staged.unlink()
        raise InputError(f"{shown}: cannot write: {exc.strerror or exc}") from None
