"""The Reader protocol and the :class:`Source` a reader sniffs.

A reader has a ``name``, the ``extensions`` it usually sees, ``sniff(source) -> bool`` (magic
bytes beat extensions) and ``read(source) -> Inventory``. Readers import their framework, if
any, inside ``read`` so that sniffing costs nothing and ``inspect`` runs without frameworks.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from modelsize.inventory import Inventory

HEAD_BYTES = 4096


@dataclass
class Source:
    """What a reader may look at before committing to a path: cheap facts, computed once."""

    path: Path
    kind: str  # "file", "dir" or "missing"
    head: bytes = b""
    size: int = 0
    _zip_infos: list[zipfile.ZipInfo] | None = field(default=None, repr=False)
    _zip_checked: bool = field(default=False, repr=False)

    @classmethod
    def open(cls, path: str | Path) -> Source:
        """Stat the path and read the first bytes of a file."""
        p = Path(path)
        if p.is_dir():
            return cls(p, "dir")
        if not p.exists():
            return cls(p, "missing")
        with open(p, "rb") as fh:
            head = fh.read(HEAD_BYTES)
        return cls(p, "file", head, p.stat().st_size)

    @property
    def suffix(self) -> str:
        """Lower-case extension, with the dot."""
        return self.path.suffix.lower()

    @property
    def is_zip(self) -> bool:
        """A zip archive (local file header magic)."""
        return self.head[:4] == b"PK\x03\x04"

    def zip_infos(self) -> list[zipfile.ZipInfo] | None:
        """The central directory of a zip archive, parsed once; ``None`` if unreadable.

        Sniffing reads it and the reader reuses it: parsing it costs as much as a checkpoint's
        whole pickle.
        """
        if not self._zip_checked:
            self._zip_checked = True
            if self.is_zip:
                try:
                    with zipfile.ZipFile(self.path) as zf:
                        self._zip_infos = zf.infolist()
                except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
                    # NotImplementedError: zipfile on a version field it does not know.
                    self._zip_infos = None
        return self._zip_infos

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
