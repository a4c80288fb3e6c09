"""File formats: one module per format behind the :class:`Reader` protocol, registered here.

Registration is explicit: the list below is the whole set, in sniffing order (the most
specific magic first). :func:`read` is the one boundary where low-level decoding errors become
:class:`~modelsize.errors.CorruptFileError`.
"""

from __future__ import annotations

import importlib
import json
import os
import struct
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from modelsize._records import field, record
from modelsize.errors import (
    CorruptFileError,
    InputError,
    ModelSizeError,
    PathNotFoundError,
    UnknownFormatError,
    UsageError,
    printable,
)
from modelsize.formats.base import Reader, Source, real_path
from modelsize.inventory import Inventory

if TYPE_CHECKING:
    from dataclasses import InitVar

__all__ = ["Reader", "Registry", "Source", "read", "registry"]


Hint = Callable[[Source], bool]


@record
class Entry:
    """A reader known by name before its module is imported.

    ``hint`` is a cheap look at the magic bytes: readers whose hint fires are sniffed first, so
    the common formats are recognised without importing every reader (imports cost more than
    reading a checkpoint's metadata).
    """

    name: str
    module: str
    cls: str
    hint: Hint | None = None
    _reader: Reader | None = None

    def load(self) -> Reader:
        """The reader instance (its module imported on first use)."""
        if self._reader is None:
            module = importlib.import_module(f"modelsize.formats.{self.module}")
            self._reader = getattr(module, self.cls)()
        return self._reader


@record
class Registry:
    """An ordered set of readers; the first whose ``sniff`` accepts a source reads it."""

    items: InitVar[Sequence[Entry | Reader]]
    entries: list[Entry] = field(init=False)

    def __post_init__(self, items: Sequence[Entry | Reader]) -> None:
        # Reader instances are accepted too (tests build registries of one or two readers).
        self.entries = [
            e if isinstance(e, Entry) else Entry(e.name, "", "", None, e) for e in items
        ]

    def register(self, reader: Reader) -> None:
        """Add a reader instance at the end of the sniffing order."""
        if reader.name in self.names:
            raise ValueError(f"reader {reader.name!r} registered twice")
        self.entries.append(Entry(reader.name, "", "", None, reader))

    def get(self, name: str) -> Reader:
        """The reader called ``name``."""
        for e in self.entries:
            if e.name == name:
                return e.load()
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        """Reader names, in sniffing order (for CLI choices)."""
        return [e.name for e in self.entries]

    def for_source(self, source: Source) -> Reader:
        """The reader that recognises ``source``, or an :class:`InputError` saying why none."""
        hinted = [e for e in self.entries if e.hint is not None and e.hint(source)]
        for e in hinted + [e for e in self.entries if e not in hinted]:
            reader = e.load()
            try:
                claimed = reader.sniff(source)
            except _decode_errors():  # a head too broken to sniff is not this reader's
                claimed = False
            if claimed:
                return reader
        if source.kind == "missing":
            real_path(source.path)  # a link that loops or dangles says so
            raise PathNotFoundError(source.path)
        if source.kind == "dir":
            raise UnknownFormatError(source.path, _no_model_in(source.path, self.entries))
        if source.size == 0:
            raise UnknownFormatError(source.path, "file is empty")
        known = sorted({x for e in self.entries for x in e.load().extensions})
        raise UnknownFormatError(
            source.path,
            f"unrecognised format (magic bytes {source.head[:8]!r}); "
            f"modelsize reads {', '.join(known)}",
        )


def _no_model_in(folder: Path, entries: Sequence[Entry]) -> str:
    """Why a folder is not a model, naming the model files in it (a folder is one model only
    when an index, a config or the format says so; its files can be inspected one by one)."""
    known = {x for e in entries for x in e.load().extensions}
    found: list[str] = []
    try:
        for entry in sorted(os.scandir(folder), key=lambda e: e.name)[:10_000]:
            if entry.is_file() and any(entry.name.endswith(x) for x in known):
                found.append(entry.name)
    except OSError:
        pass
    if not found:
        return "directory holds no model file modelsize can read"
    shown = ", ".join(printable(n, 60) for n in found[:4]) + (", ..." if len(found) > 4 else "")
    return (f"a folder is one model only when an index, a config or its format says so; it "
            f"holds {len(found)} model file{'s' if len(found) > 1 else ''} ({shown}): give one")


def _is_zip(s: Source) -> bool:
    return s.kind == "file" and s.is_zip


def _starts(*magic: bytes) -> Hint:
    return lambda s: s.kind == "file" and s.head.startswith(magic)


def _build_registry() -> Registry:
    # Explicit and ordered: most specific magic first. Each reader imports its framework (if it
    # has one) inside read(), and its own module only when a source gets as far as it.
    return Registry(
        [
            Entry("safetensors-index", "safetensors", "SafetensorsIndexReader"),
            Entry("safetensors", "safetensors", "SafetensorsReader",
                  lambda s: s.kind == "file" and s.head[8:9] == b"{"),
            Entry("torch-dcp", "torch_dcp", "TorchDcpReader", lambda s: s.suffix == ".distcp"),
            Entry("pytorch", "torch_zip", "TorchZipReader", _is_zip),
            Entry("npz", "numpy", "NpzReader", _is_zip),
            Entry("npy", "numpy", "NpyReader", _starts(b"\x93NUMPY")),
            Entry("pytorch-legacy", "torch_legacy", "TorchLegacyReader",
                  _starts(b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19")),
            Entry("pytorch-sharded", "torch_sharded", "TorchShardedReader",
                  lambda s: s.kind == "dir" and (s.path / "trainer_state.json").is_file()),
            Entry("deepspeed", "deepspeed", "DeepSpeedReader"),
            Entry("gguf", "gguf", "GgufReader", _starts(b"GGUF")),
            Entry("tflite", "tflite", "TfliteReader",
                  lambda s: s.kind == "file" and s.head[4:8] == b"TFL3"),
            Entry("onnx", "onnx", "OnnxReader", lambda s: s.suffix == ".onnx"),
            Entry("t7", "t7", "T7Reader"),
            Entry("tensorflow", "tensorflow", "TensorflowReader"),
            Entry("keras", "keras", "KerasReader", _is_zip),
            Entry("keras-h5", "keras", "KerasH5Reader", _starts(b"\x89HDF\r\n\x1a\n")),
            # Generic pickles last: protocol 0/1 pickles have the weakest magic of all.
            Entry("pickle", "pickle_file", "PickleReader"),
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
_DECODE_ERRORS: tuple[type[BaseException], ...] = (
    struct.error,
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
    NotImplementedError,  # zipfile on archive features it does not implement
)


def _decode_errors() -> tuple[type[BaseException], ...]:
    """:data:`_DECODE_ERRORS` and ``zipfile.BadZipFile`` (:func:`_zip.bad_zip_class`: the
    torch and safetensors paths do not import zipfile, and nothing raises it before)."""
    from modelsize.formats import _zip

    return (*_DECODE_ERRORS, _zip.bad_zip_class())


def read(path: str | Path, registry_: Registry | None = None) -> Inventory:
    """Find the reader for ``path`` and return its :class:`Inventory`."""
    reg = registry_ or registry()
    if isinstance(path, str) and "://" in path:
        from modelsize.remote import is_remote

        if is_remote(path):  # Path() would make "http:/host/x" of it
            raise UsageError(f"{printable(path)}: a URL; modelsize reads it remotely in "
                             "`modelsize inspect/diff/check/slim URL` and "
                             "modelsize.remote.inspect_remote(URL)")
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
    except _decode_errors() as exc:
        raise CorruptFileError(path, reader.name, f"{type(exc).__name__}: {exc}") from exc


def sniff_format(path: str | Path) -> str:
    """The name of the reader that would read ``path``."""
    return registry().for_source(Source.open(Path(path))).name
