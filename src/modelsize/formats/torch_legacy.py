"""PyTorch checkpoints in the pre-zip format (``_use_new_zipfile_serialization=False``).

The file is five pickles followed by raw storages::

    magic number      0x1950a86a20f9469cfc6c
    protocol version  1001
    sys info          {'protocol_version', 'little_endian', 'type_sizes'}
    the object        persistent ids ('storage', type, key, location, numel, view)
                      and ('module', class, source file, source) for pickled modules
    storage keys      the order the storages follow in
    per key:          int64 element count, then count * itemsize raw bytes

torch 0.3 to 1.5 wrote it by default, today's torch on request, under Python 2 and 3:
Python 2 pickles carry strings as ``SHORT_BINSTRING``/``BINSTRING``, integers past 32 bits as
text ``INT`` and ``long`` s as ``LONG1``, which the parser reads like their Python 3 forms.
``sys_info`` is not needed: storages hold torch's element sizes whatever ``type_sizes`` says
(Windows writes ``long`` as 4 bytes), and a location (``cuda:1``) does not change the bytes.

The even older tar format of the first releases (members ``sys_info``, ``pickle``, ``tensors``,
``storages``) is recognised and refused with a clear message.
"""

from __future__ import annotations

import mmap
import struct

from modelsize.categories import Category
from modelsize.errors import UnknownFormatError
from modelsize.formats._pickle import (
    Call,
    Data,
    Global,
    PickleError,
    PickleScan,
    looks_like_pickle,
    scan,
)
from modelsize.formats._torch_tree import (
    StorageRef,
    add_pickle_region,
    classify,
    describe,
    place_python2_array,
    storage_dtype,
    torch_storage_chunks,
)
from modelsize.formats.base import Source
from modelsize.inventory import Inventory, InventoryBuilder

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
_TAR_MEMBERS = frozenset({b"sys_info", b"pickle", b"tensors", b"storages"})


def _is_tar_checkpoint(head: bytes) -> bool:
    return (
        len(head) >= 262
        and head[257:262] == b"ustar"
        and head[:100].split(b"\0", 1)[0].rstrip(b"/") in _TAR_MEMBERS
    )


def open_mapped(path: object) -> Data:
    """The whole file, memory-mapped read-only.

    The map is never closed explicitly: the parser's views of it may outlive an exception, and
    closing a map with live views fails. It is unmapped when the last reference goes.
    """
    with open(str(path), "rb") as fh:
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)


class TorchLegacyReader:
    """``torch.save(obj, f, _use_new_zipfile_serialization=False)`` files."""

    name = "pytorch-legacy"
    extensions = (".pt", ".pth", ".bin", ".ckpt", ".tar")
    #: NumPy arrays pickled as latin-1 text (slim writes their bytes).
    storage_chunks = staticmethod(torch_storage_chunks)

    def sniff(self, source: Source) -> bool:
        """The first pickle is torch's magic number (or the file is torch's old tar format)."""
        if _is_tar_checkpoint(source.head):
            return True
        if not looks_like_pickle(source.head):
            return False
        try:
            first = scan(source.head)
        except PickleError:
            return False
        return type(first.value) is int and first.value == MAGIC_NUMBER

    def read(self, source: Source) -> Inventory:
        """Account for every byte: the five pickles, the size prefixes and the storages."""
        if _is_tar_checkpoint(source.head):
            raise UnknownFormatError(
                source.path,
                "PyTorch tar checkpoint (the first torch releases): modelsize does not read this "
                "format; load it with an old torch and save it again",
            )
        return _LegacyRead(source, self.name).run()


class _LegacyRead:
    def __init__(self, source: Source, fmt: str) -> None:
        self.builder = InventoryBuilder(fmt, [source.path])
        self.data = open_mapped(source.path)
        self.size = self.builder.files[0].nbytes
        self.refs: dict[str, StorageRef] = {}

    def pickle(self, offset: int, what: str, hook: bool = False) -> PickleScan:
        b = self.builder
        try:
            load = self.persistent if hook else None
            parsed = scan(self.data, offset=offset, persistent_load=load,
                          on_build=self.build_hook if hook else None)
        except PickleError as exc:
            extra = f" (before that it calls {', '.join(exc.unsafe)})" if exc.unsafe else ""
            raise b.corrupt(f"{what} pickle: {exc}{extra}", exc.offset) from exc
        if parsed.fails:
            raise b.corrupt(f"{what} pickle fails to load ({parsed.fails}, which is not "
                            "callable: TypeError)", offset)
        for name in parsed.unsafe:
            b.add_unsafe_global(name)
        return parsed

    def run(self) -> Inventory:
        b = self.builder
        magic = self.pickle(0, "magic number")
        if not (type(magic.value) is int and magic.value == MAGIC_NUMBER):
            raise b.corrupt(f"first pickle is {describe(magic.value)}, not torch's magic number", 0)
        proto = self.pickle(magic.end, "protocol version")
        if type(proto.value) is not int or proto.value != PROTOCOL_VERSION:
            raise b.corrupt(
                f"protocol version is {describe(proto.value)}, expected {PROTOCOL_VERSION}",
                magic.end,
            )
        info = self.pickle(proto.end, "system info")
        little = not (isinstance(info.value, dict) and info.value.get("little_endian") is False)
        main = self.pickle(info.end, "object", hook=True)
        keys = self.pickle(main.end, "storage keys")
        for p in (magic, proto, info):
            b.add_region(p.start, p.end - p.start, Category.METADATA, "header pickle")

        summary = classify(main.value, b, blob_base=0)
        add_pickle_region(
            b, main.start, main.end,
            Category.GRAPH if summary.has_modules else Category.METADATA, "object pickle",
            summary.blobs,
        )
        b.add_region(keys.start, keys.end - keys.start, Category.METADATA, "storage keys pickle")
        self.read_storages(keys, little)
        return b.build()

    def read_storages(self, keys: PickleScan, little: bool) -> None:
        b = self.builder
        order = keys.value
        if not isinstance(order, list) or not all(isinstance(k, str) for k in order):
            raise b.corrupt(f"storage key list is {describe(order)}, not a list of strings",
                            keys.start)
        if len(order) != len(set(order)):
            raise b.corrupt("storage key list names a storage twice", keys.start)
        if len(order) * 8 > self.size - keys.end:
            raise b.corrupt(
                f"{len(order)} storages need at least {len(order) * 8} bytes, "
                f"{self.size - keys.end} remain", keys.end,
            )
        missing = set(self.refs) - set(order)
        if missing:
            raise b.corrupt(f"tensors use storage {sorted(missing)[0]!r} but its data is not saved")
        fmt = "<q" if little else ">q"
        pos = keys.end
        for key in order:
            ref = self.refs.get(key)
            if ref is None:
                raise b.corrupt(f"storage {key!r} is saved but no tensor refers to it", pos)
            b.check_range(pos, 8, f"size of storage {key}")
            (numel,) = struct.unpack(fmt, self.data[pos : pos + 8])
            if numel != ref.numel:
                raise b.corrupt(
                    f"storage {key!r} is declared with {ref.numel} elements but its data "
                    f"says {numel}", pos,
                )
            b.add_region(pos, 8, Category.METADATA, f"size of storage {key}")
            b.check_range(pos + 8, ref.nbytes, f"storage {key}")
            b.add_storage(key, pos + 8, ref.nbytes, dtype=ref.dtype)
            pos += 8 + ref.nbytes
        if pos < self.size:
            b.add_region(pos, self.size - pos, Category.OTHER, "bytes after the last storage")

    def build_hook(self, obj: Call, pos: int) -> None:
        """NumPy arrays pickled by Python 2 get the place of their data (see pickle_file)."""
        place_python2_array(self.data, obj, pos)

    def persistent(self, pid: object) -> object:
        b = self.builder
        if isinstance(pid, tuple) and len(pid) >= 2 and pid[0] == "module":
            if not isinstance(pid[1], Global):
                raise b.corrupt(f"module persistent id names {describe(pid[1])}, not a class")
            return pid[1]
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise b.corrupt(
                f"persistent id {describe(pid)} is neither ('storage', ...) nor ('module', ...)"
            )
        if len(pid) != 6:  # torch unpacks exactly five values after "storage"
            raise b.corrupt(
                f"a storage persistent id holds {len(pid)} values where torch's "
                "loader takes 6 ('storage', type, key, location, size, view)")
        storage_type, key, location, numel = pid[1:5]
        dtype = storage_dtype(storage_type)
        if dtype is None:
            raise b.corrupt(f"unknown storage type {describe(storage_type)}")
        if not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise b.corrupt(f"storage key {describe(key)} / size {describe(numel)} invalid")
        ref = self.refs.setdefault(key, StorageRef(key, dtype, numel, str(location)))
        view = pid[5] if len(pid) > 5 else None
        if view is None:
            return ref
        if not (
            isinstance(view, tuple) and len(view) == 3
            and all(type(v) is int and v >= 0 for v in view[1:])
        ):
            raise b.corrupt(f"storage view {describe(view)} is not (key, offset, size)")
        if view[1] + view[2] > ref.numel:
            raise b.corrupt(
                f"view of storage {key!r} covers elements {view[1]}..{view[1] + view[2]} "
                f"but it holds {ref.numel}"
            )
        return StorageRef(key, ref.dtype, ref.numel, ref.location, view[1], view[2])
