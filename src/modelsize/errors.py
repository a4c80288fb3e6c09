"""One exception hierarchy for the whole library.

::

    ModelSizeError                   base of everything raised on purpose
    ├── InputError                   the user's input is at fault: the CLI exits 2 with one line
    │   ├── PathNotFoundError        nothing at that path
    │   ├── UnknownFormatError       a file, but no reader recognises it
    │   ├── CorruptFileError         a reader recognised it, but it is truncated, corrupt or lying
    │   ├── UsageError               arguments that make no sense together
    │   └── LimitError               a file needs more than a resource limit allows
    ├── OutputError                  OUT cannot be written: disk full, read-only, no permission,
    │                                or it appeared meanwhile; nothing was left behind (exit 2)
    ├── MissingDependencyError       an optional framework is needed but not installed (exit 2)
    ├── EstimateError                the model could not be traced (exit 2)
    ├── AccountingError              a bug: categories did not add up (exit 1)
    └── VerificationError            a bug: a slimmed output did not read back as planned (exit 1)

Readers translate ``BadZipFile``, ``struct.error``, decode errors and friends into
:class:`CorruptFileError` at one boundary (:func:`modelsize.formats.read`). Messages say what
was expected, what was found, and what to do.
"""

from __future__ import annotations

from pathlib import Path


def printable(text: str, limit: int = 200) -> str:
    """Escape control characters (and cut long text) before it reaches a terminal."""
    out = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    return out if len(out) <= limit else out[: limit - 3] + "..."


class ModelSizeError(Exception):
    """Base class of every error modelsize raises on purpose."""

    exit_code: int = 2


class InputError(ModelSizeError):
    """The input (a path, a file, an argument) is at fault, not modelsize."""


class PathNotFoundError(InputError):
    """Nothing exists at the given path."""

    def __init__(self, path: str | Path, hint: str = "") -> None:
        self.path = Path(path)
        msg = f"{printable(str(path))}: no such file or directory"
        super().__init__(msg + (f" ({hint})" if hint else ""))


class UnknownFormatError(InputError):
    """The path exists but no registered reader recognises it."""

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{printable(str(path))}: {reason}")


class CorruptFileError(InputError):
    """A reader recognised the file but it is truncated, corrupted or lies about its sizes."""

    def __init__(
        self, path: str | Path, format: str, reason: str, offset: int | None = None
    ) -> None:
        self.path = Path(path)
        self.format = format
        self.reason = reason
        self.offset = offset
        where = f" at byte {offset}" if offset is not None else ""
        super().__init__(
            f"{printable(str(path))}: not a valid {format} file{where}: {printable(reason, 300)}"
        )


class UsageError(InputError):
    """Arguments that cannot work together."""


class LimitError(InputError):
    """A file needs more than a resource limit allows (bytes to parse or inflate, memory).

    The message names the limit and the environment variable that raises it
    (:mod:`modelsize.formats._limits`).
    """

    def __init__(self, path: str | Path, reason: str, env: str) -> None:
        self.path = Path(path)
        self.reason = reason
        self.env = env
        super().__init__(f"{printable(str(path))}: {printable(reason, 400)}")


class OutputError(ModelSizeError):
    """The output cannot be written where asked (no space, a read-only folder, no permission,
    or another writer got there first). Nothing was left behind; the input is untouched."""


class MissingDependencyError(ModelSizeError):
    """An optional framework is required for this operation but is not installed."""

    def __init__(self, package: str, needed_for: str, extra: str = "") -> None:
        self.package = package
        hint = f"pip install 'modelsize[{extra}]'" if extra else f"pip install {package}"
        super().__init__(f"{needed_for} needs {package}, which is not installed: {hint}")


class EstimateError(ModelSizeError):
    """The model could not be traced."""


class AccountingError(ModelSizeError):
    """Internal invariant broken: a report's categories do not add up. Always a modelsize bug."""

    exit_code = 1


class VerificationError(ModelSizeError):
    """A slimmed output did not read back as planned (it was not written). Always a bug."""

    exit_code = 1
