"""PyTorch output: a ``torch.save`` zip archive that ``torch.load(weights_only=True)`` opens.

Written without torch and without running the input's pickle. The layout is what
``torch.save`` writes: ``<name>/data.pkl`` (a protocol-2 pickle), ``.format_version``,
``.storage_alignment``, ``byteorder``, one stored member per storage under ``data/`` aligned
to 64 bytes, ``version`` and ``.data/serialization_id``. The pickle references only what the
weights-only unpickler allows: ``collections.OrderedDict``, ``torch._utils._rebuild_tensor_v2``
(``_v3`` with an ``UntypedStorage`` for dtypes that have no legacy storage class) and torch's
storage and dtype names. Every tensor is written contiguous, in its own storage; a
deduplicated alias views its original's storage, so loading gives both names, tied.

By default the output is the model's flat state dict (``{key: tensor}``); with ``--keep`` the
checkpoint's top-level layout is kept for what survives (``{"model": {...}, "epoch": 3}``),
non-tensor values included when they are plain data (numbers, strings, lists, dicts). Tensors
kept from several of the checkpoint's entries (``{"model": ..., "grads": ...}`` with only the
optimizer dropped) keep that layout too, for those entries: the entry a tensor sits in says
what it is (gradients stay gradients when read back).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from modelsize.errors import UsageError, printable
from modelsize.inventory import Inventory, contiguous_strides
from modelsize.slimming.output import Output
from modelsize.slimming.plan import Plan, PlannedTensor, matches
from modelsize.slimming.writers.base import (
    Meter,
    Streamed,
    Written,
    output_nbytes,
    slim_name,
    stream,
)
from modelsize.slimming.zipwriter import Member, ZipWriter, plan_sizes

#: canonical dtype -> legacy storage class (``torch.FloatStorage``...).
STORAGE_CLASSES: dict[str, str] = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage",
    "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage",
    "bool": "BoolStorage", "complex64": "ComplexFloatStorage",
    "complex128": "ComplexDoubleStorage",
}
#: canonical dtype -> ``torch.<dtype>`` for ``_rebuild_tensor_v3``.
TORCH_DTYPES: dict[str, str] = {
    "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
    "float8_e4m3fnuz": "float8_e4m3fnuz", "float8_e5m2fnuz": "float8_e5m2fnuz",
    "float8_e8m0fnu": "float8_e8m0fnu", "complex32": "complex32",
}
ALIGN = 64


# -- a minimal pickler for state dicts -------------------------------------------------------


class _TensorRef:
    """A tensor in the output tree: its storage key, dtype and shape."""

    def __init__(self, key: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
        self.key = key
        self.dtype = dtype
        self.shape = shape
        self.nbytes = nbytes


class _OrderedDict(dict):  # type: ignore[type-arg]
    """Pickled as ``collections.OrderedDict`` (a state dict)."""


class _Pickler:
    """Protocol 2, the opcodes ``torch.save`` uses, nothing that a weights-only load refuses."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")

    def globl(self, module: str, name: str) -> None:
        self.out += b"c" + module.encode() + b"\n" + name.encode() + b"\n"

    def dump(self, value: Any) -> None:
        out = self.out
        if value is None:
            out += b"N"
        elif value is True:
            out += b"\x88"
        elif value is False:
            out += b"\x89"
        elif isinstance(value, int):
            if 0 <= value < 256:
                out += b"K" + bytes([value])
            elif 0 <= value < 65536:
                out += b"M" + struct.pack("<H", value)
            elif -(2**31) <= value < 2**31:
                out += b"J" + struct.pack("<i", value)
            else:
                raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
                out += b"\x8a" + bytes([len(raw)]) + raw
        elif isinstance(value, float):
            out += b"G" + struct.pack(">d", value)
        elif isinstance(value, str):
            raw = value.encode("utf-8", "surrogatepass")
            out += b"X" + struct.pack("<I", len(raw)) + raw
        elif isinstance(value, _TensorRef):
            self.tensor(value)
        elif isinstance(value, _OrderedDict):
            self.globl("collections", "OrderedDict")
            out += b")R"
            self.items(value)
        elif isinstance(value, dict):
            out += b"}"
            self.items(value)
        elif isinstance(value, list):
            out += b"]"
            if value:
                out += b"("
                for v in value:
                    self.dump(v)
                out += b"e"
        elif isinstance(value, tuple):
            out += b"("
            for v in value:
                self.dump(v)
            out += b"t"
        else:  # pragma: no cover - the tree is built from the types above only
            raise TypeError(f"cannot pickle {type(value).__name__}")

    def items(self, mapping: dict[Any, Any]) -> None:
        if not mapping:
            return
        self.out += b"("
        for k, v in mapping.items():
            self.dump(k)
            self.dump(v)
        self.out += b"u"

    def tensor(self, t: _TensorRef) -> None:
        legacy = STORAGE_CLASSES.get(t.dtype)
        self.globl("torch._utils", "_rebuild_tensor_v2" if legacy else "_rebuild_tensor_v3")
        out = self.out
        out += b"(("
        self.dump("storage")
        if legacy:
            self.globl("torch", legacy)
            numel = t.nbytes // _itemsize(t.dtype)
        else:
            self.globl("torch.storage", "UntypedStorage")
            numel = t.nbytes
        self.dump(t.key)
        self.dump("cpu")
        self.dump(numel)
        out += b"tQ"
        self.dump(0)
        self.dump(tuple(t.shape))
        self.dump(contiguous_strides(t.shape))
        out += b"\x89"
        self.globl("collections", "OrderedDict")
        out += b")R"
        if not legacy:
            self.globl("torch", TORCH_DTYPES[t.dtype])
        out += b"tR"

    def finish(self) -> bytes:
        return bytes(self.out + b".")


def _itemsize(dtype: str) -> int:
    from modelsize.dtypes import DTYPES

    return DTYPES[dtype].block_bytes


def check_dtype(t: PlannedTensor) -> None:
    """A :class:`UsageError` for dtypes a torch zip cannot hold without torch's help."""
    if t.dtype not in STORAGE_CLASSES and t.dtype not in TORCH_DTYPES:
        raise UsageError(
            f"{printable(t.name)}: modelsize writes no {t.dtype} tensors in torch files; "
            "use --to safetensors or --to same"
        )


# -- the layout of the checkpoint ------------------------------------------------------------


def _root_object(inv: Inventory) -> object | None:
    """The parsed (never loaded) top-level object of a torch file, for ``--keep``."""
    from modelsize.formats import _zip
    from modelsize.formats._pickle import PickleError, scan
    from modelsize.inventory import InventoryBuilder

    if inv.format != "pytorch" or len(inv.files) != 1:
        return None
    path = inv.files[0].path
    builder = InventoryBuilder(inv.format, [path])
    members = [m for m in _zip.members(path, builder) if m.name.endswith("data.pkl")
               and m.name.count("/") <= 1]
    if not members:
        return None
    data = _zip.read_member(path, members[0], builder)
    try:
        return scan(data, persistent_load=lambda pid: pid).value
    except PickleError:
        return None


@dataclass
class _Tree:
    """What the output pickle holds, and what could not be carried over."""

    root: Any
    skipped: list[str] = field(default_factory=list)


_TENSOR_CALLS = ("torch._utils._rebuild", "torch._tensor._rebuild", "numpy.core.multiarray",
                 "numpy._core.multiarray")


def _plain(value: object, path: str, tensors: dict[str, _TensorRef], tree: _Tree) -> Any:
    """``value`` rebuilt from plain data and kept tensors; ``_SKIP`` where it cannot be."""
    from modelsize.formats._pickle import Call, Global
    from modelsize.formats._torch_tree import _key_text, global_name, mapping_items

    if path in tensors:
        return tensors[path]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Call) and global_name(value.func).startswith(_TENSOR_CALLS):
        return _SKIP  # a tensor the plan dropped
    items = mapping_items(value)
    if items is not None:
        out = _OrderedDict() if isinstance(value, Call) else {}
        for k, v in items:
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                tree.skipped.append(f"{path}[{_key_text(k)}]")
                continue
            sub = f"{path}.{_key_text(k)}" if path else _key_text(k)
            got = _plain(v, sub, tensors, tree)
            if got is not _SKIP:
                out[k] = got
        return out
    if isinstance(value, (list, tuple)):
        got_items = [_plain(v, f"{path}.{i}" if path else str(i), tensors, tree)
                     for i, v in enumerate(value)]
        kept = [g for g in got_items if g is not _SKIP]
        return kept if isinstance(value, list) else tuple(kept)
    tree.skipped.append(path or "<root>")
    _ = Global  # imported for the isinstance family above
    return _SKIP


_SKIP = object()


def _build_tree(plan: Plan, refs: dict[str, _TensorRef]) -> _Tree:
    """The object to pickle: a flat state dict, or the kept part of the checkpoint's layout.

    A file that held one bare tensor (``torch.save(t)``) gives a file holding one tensor.
    """
    from modelsize.formats._pickle import Call
    from modelsize.formats._torch_tree import _key_text, global_name, mapping_items

    root = _root_object(plan.inventory) if plan.options.to == "same" else None
    if (isinstance(root, Call) and global_name(root.func).startswith(_TENSOR_CALLS)
            and len(refs) == 1):
        return _Tree(next(iter(refs.values())))
    containers = {t.record.container for t in plan.tensors}
    # Tensors kept from several containers ({"model": ..., "grads": ...}) keep the layout
    # too: flattened to "grads.fc.weight", gradients would read back as weights.
    several = not plan.container and len(containers) > 1
    if not plan.options.keep and not several:
        return _Tree(_OrderedDict(refs))

    items = mapping_items(root) if root is not None else None
    if items is None:
        return _Tree(_OrderedDict(refs))
    tree = _Tree(None)
    by_record = {t.record.name: refs[t.name] for t in plan.tensors}
    out: dict[Any, Any] = {}
    for k, v in items:
        key = _key_text(k)
        if matches(key, plan.options.keep) or f"{key}." in containers or key in by_record:
            got = _plain(v, key, by_record, tree)
            if got is not _SKIP:
                out[k] = got
    placed = _placed(out)
    missing = [n for n in by_record if id(by_record[n]) not in placed]
    for name in missing:  # tensors the parsed layout did not reach (never expected)
        out[name] = by_record[name]
    tree.root = out
    return tree


def _placed(value: Any, seen: set[int] | None = None) -> set[int]:
    seen = set() if seen is None else seen
    if isinstance(value, _TensorRef):
        seen.add(id(value))
    elif isinstance(value, dict):
        for v in value.values():
            _placed(v, seen)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _placed(v, seen)
    return seen


_NAME = re.compile(r"[^A-Za-z0-9_.-]")


def archive_name(target: Path) -> str:
    """The archive folder inside the zip: the file's stem, as ``torch.save`` names it."""
    stem = target.name.split(".", 1)[0] or "archive"
    return _NAME.sub("_", stem)[:64] or "archive"


@dataclass
class TorchFile:
    """One torch zip archive: its pickle and its storages, all sizes known."""

    name: str
    archive: str
    pickle: bytes
    storages: list[tuple[str, PlannedTensor]]
    skipped: list[str] = field(default_factory=list)

    def members(self) -> list[Member]:
        """Every member, in the order ``torch.save`` writes them."""
        a = self.archive
        out = [Member(f"{a}/data.pkl", len(self.pickle)),
               Member(f"{a}/.format_version", 1), Member(f"{a}/.storage_alignment", 2),
               Member(f"{a}/byteorder", 6)]
        out += [Member(f"{a}/data/{key}", output_nbytes(t), ALIGN) for key, t in self.storages]
        out += [Member(f"{a}/version", 2), Member(f"{a}/.data/serialization_id", 40)]
        return out

    @property
    def nbytes(self) -> int:
        """The archive's exact size."""
        return plan_sizes(self.members())

    def write(self, fh: BinaryIO, meter: Meter, written: dict[str, Written]) -> None:
        """The archive, storages streamed from the input."""
        zw = ZipWriter(fh)
        members = iter(self.members())
        for data in (self.pickle, b"1", b"64", b"little"):
            zw.write_member(next(members), [data])
        for _key, t in self.storages:
            s = stream(t, meter)
            zw.write_member(next(members), None, crc=_crc_of(s), fill=s.write_to)
            written[t.name] = s.written
        zw.write_member(next(members), [b"3\n"])
        zw.write_member(next(members), [_serialization_id(self.pickle)])
        zw.close()


def _crc_of(s: Streamed) -> Callable[[], int]:
    """The CRC-32 the stream computed, once it has been consumed."""
    return lambda: s.written.crc


def torch_file(name: str, tensors: Sequence[PlannedTensor], keys: dict[str, str],
               root: Any = None, skipped: Sequence[str] = ()) -> TorchFile:
    """The archive holding ``tensors`` under ``keys`` (plan name -> key in the file): a flat
    state dict, or ``root`` (a tree of :class:`_TensorRef` s by plan name) when given."""
    refs: dict[str, _TensorRef] = {}
    storages: list[tuple[str, PlannedTensor]] = []
    for t in tensors:
        check_dtype(t)
        if t.alias_of is None:
            key = str(len(storages))
            storages.append((key, t))
            refs[t.name] = _TensorRef(key, t.dtype, t.shape, output_nbytes(t))
    for t in tensors:
        if t.alias_of is not None:
            orig = refs.get(t.alias_of)
            if orig is None:
                raise ValueError(f"{t.name}: alias of {t.alias_of}, which is not in this file")
            refs[t.name] = _TensorRef(orig.key, orig.dtype, t.shape, orig.nbytes)
    if root is None:
        obj: Any = _OrderedDict((keys[t.name], refs[t.name]) for t in tensors)
    else:
        obj = root(refs) if callable(root) else root
    pickler = _Pickler()
    pickler.dump(obj)
    return TorchFile(name, archive_name(Path(name)), pickler.finish(), storages, list(skipped))


@dataclass
class TorchJob:
    """One torch zip file."""

    files: list[str]
    main: str
    directory: bool
    predicted_bytes: int | None
    file: TorchFile

    def write(self, out: Output, meter: Meter) -> dict[str, Written]:
        """The archive."""
        written: dict[str, Written] = {}
        self.file.write(out.open(self.main), meter, written)
        return written

    def output_name(self, name: str) -> str:
        """Names are the state dict's keys."""
        return name


def _serialization_id(pickle: bytes) -> bytes:
    """40 decimal digits, as torch writes, derived from the content (reproducible output)."""
    import hashlib

    digest = int.from_bytes(hashlib.sha256(pickle).digest(), "big")
    return str(digest).rjust(40, "0")[-40:].encode()


class TorchWriter:
    """``torch.save`` zip archives (``.pt``, ``.pth``, ``.bin``)."""

    name = "pytorch"

    def default_target(self, plan: Plan, source: Path) -> Path:
        """``x.slim.pt`` (the input's extension kept for torch files)."""
        torch_input = plan.inventory.format in ("pytorch", "pytorch-legacy")
        if torch_input and source.is_file() and source.suffix:
            return slim_name(source)
        return slim_name(source, ".pt")

    def prepare(self, plan: Plan, target: Path) -> TorchJob:
        """The pickle and the member list, before any byte is written."""
        names = {t.name: t.name for t in plan.tensors}
        tree: list[_Tree] = []

        def tree_root(refs: dict[str, _TensorRef]) -> Any:
            tree.append(_build_tree(plan, {t.name: refs[t.name] for t in plan.tensors}))
            return tree[0].root

        file = torch_file(target.name, plan.tensors, names, tree_root)
        file.skipped = tree[0].skipped if tree else []
        if file.skipped:
            plan.notes.append("not kept (not plain data, or not loadable with "
                              "weights_only=True): " + ", ".join(file.skipped[:5]))
        return TorchJob([target.name], target.name, False, file.nbytes, file)


def chunked(data: bytes) -> Iterator[bytes]:
    """One chunk (small records)."""
    yield data


__all__: Sequence[str] = ("TorchJob", "TorchWriter")
