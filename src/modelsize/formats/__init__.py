"""File formats: one module per format behind the :class:`Reader` protocol, registered here.

Registration is explicit: the list below is the whole set, in sniffing order (the most
specific magic first). :func:`read` is the one boundary where low-level decoding errors become
:class:`~modelsize.errors.CorruptFileError`.
"""

from __future__ import annotations

import json
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from modelsize.errors import (
    CorruptFileError,
    InputError,
    ModelSizeError,
    PathNotFoundError,
    UnknownFormatError,
)
from modelsize.formats.base import Reader, Source
from modelsize.inventory import Inventory

__all__ = ["Reader", "Registry", "Source", "read", "registry"]


@dataclass
class Registry:
    """An ordered set of readers; the first whose ``sniff`` accepts a source reads it."""

    readers: list[Reader]

    def register(self, reader: Reader) -> None:
        """Add a reader at the end of the sniffing order."""
        if any(r.name == reader.name for r in self.readers):
            raise ValueError(f"reader {reader.name!r} registered twice")
        self.readers.append(reader)

    def get(self, name: str) -> Reader:
        """The reader called ``name``."""
        for r in self.readers:
            if r.name == name:
                return r
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        """Reader names, in sniffing order (for CLI choices)."""
        return [r.name for r in self.readers]

    def for_source(self, source: Source) -> Reader:
        """The reader that recognises ``source``, or an :class:`InputError` saying why none."""
        for r in self.readers:
            if r.sniff(source):
                return r
        if source.kind == "missing":
            raise PathNotFoundError(source.path)
        if source.kind == "dir":
            raise UnknownFormatError(
                source.path, "directory holds no model file modelsize can read"
            )
        if source.size == 0:
            raise UnknownFormatError(source.path, "file is empty")
        known = sorted({e for r in self.readers for e in r.extensions})
        raise UnknownFormatError(
            source.path,
            f"unrecognised format (magic bytes {source.head[:8]!r}); "
            f"modelsize reads {', '.join(known)}",
        )


def _build_registry() -> Registry:
    # Explicit and ordered: most specific magic first; each reader imports its framework lazily.
    from modelsize.formats.gguf import GgufReader
    from modelsize.formats.keras import KerasH5Reader, KerasReader
    from modelsize.formats.numpy import NpyReader, NpzReader
    from modelsize.formats.onnx import OnnxReader
    from modelsize.formats.pickle_file import PickleReader
    from modelsize.formats.safetensors import SafetensorsIndexReader, SafetensorsReader
    from modelsize.formats.t7 import T7Reader
    from modelsize.formats.tensorflow import TensorflowReader
    from modelsize.formats.torch_legacy import TorchLegacyReader
    from modelsize.formats.torch_zip import TorchZipReader

    return Registry(
        [
            SafetensorsIndexReader(),
            SafetensorsReader(),
            TorchZipReader(),
            NpzReader(),
            NpyReader(),
            TorchLegacyReader(),
            GgufReader(),
            OnnxReader(),
            T7Reader(),
            TensorflowReader(),
            KerasReader(),
            KerasH5Reader(),
            # Generic pickles last: protocol 0/1 pickles have the weakest magic of all.
            PickleReader(),
        ]
    )


_REGISTRY: Registry | None = None


def registry() -> Registry:
    """The registry of every reader (built on first use, so ``import modelsize`` stays cheap)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = _build_registry()
    return _REGISTRY



# Low-level failures a reader may let through on a malformed file. MemoryError and
# RecursionError are here on purpose: a hostile file must never end in a traceback.
_DECODE_ERRORS = (
    struct.error,
    zipfile.BadZipFile,
    zlib.error,
    json.JSONDecodeError,
    UnicodeDecodeError,
    ValueError,
    EOFError,
    IndexError,
    KeyError,
    TypeError,
    OverflowError,
    RecursionError,
    MemoryError,
)


def read(path: str | Path, registry_: Registry | None = None) -> Inventory:
    """Find the reader for ``path`` and return its :class:`Inventory`."""
    reg = registry_ or registry()
    try:
        source = Source.open(path)
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    reader = reg.for_source(source)
    try:
        return reader.read(source)
    except ModelSizeError:
        raise
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except _DECODE_ERRORS as exc:
        raise CorruptFileError(path, reader.name, f"{type(exc).__name__}: {exc}") from exc


def sniff_format(path: str | Path) -> str:
    """The name of the reader that would read ``path``."""
    return registry().for_source(Source.open(Path(path))).name
