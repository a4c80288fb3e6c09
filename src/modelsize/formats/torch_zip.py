"""PyTorch zip checkpoints (``torch.save`` since 1.6) and TorchScript archives.

Layout: ``<archive>/data.pkl`` (the object tree, a pickle), one stored member
``<archive>/data/<key>`` per storage (64-byte aligned, the padding in the local header's extra
field), and small records (``version``, ``byteorder``, ``.format_version``,
``.storage_alignment``, ``.data/serialization_id``). TorchScript adds ``code/`` (the compiled
model, with ``.debug_pkl`` source maps) and ``constants.pkl`` with storages in ``constants/``.

``data.pkl`` is parsed by :mod:`~modelsize.formats._pickle`, never loaded: each persistent id
``('storage', torch.FloatStorage, key, location, numel)`` becomes a
:class:`~modelsize.formats._torch_tree.StorageRef` to its zip member, whose size must agree with
``numel * itemsize``. :mod:`~modelsize.formats._torch_tree` then names and classifies tensors.

Every member read (the pickles, ``code/*.py``) or charged to graph or metadata (the rest of
``code/``, the records, ``extra/``) is checked against its CRC-32: a few kB to a few MB, which
costs nothing next to parsing the pickle. Storages are tensor data, never read, never checked.
"""

from __future__ import annotations

import re
import struct

from modelsize.categories import Category
from modelsize.errors import printable
from modelsize.formats import _zip
from modelsize.formats._limits import ParseBudget
from modelsize.formats._pickle import (
    Global,
    PickleError,
    PickleScan,
    looks_like_pickle,
    scan,
    scan_all,
)
from modelsize.formats._torch_tree import (
    ScriptRoles,
    StorageRef,
    Summary,
    add_pickle_region,
    classify,
    describe,
    script_roles,
    storage_dtype,
    storage_itemsize,
    torch_storage_chunks,
)
from modelsize.formats.base import Source
from modelsize.inventory import Inventory, InventoryBuilder, paused_gc

_LOCAL = struct.Struct("<4sHHHHHIIIHH")
#: Small records torch writes beside the pickle.
_RECORDS = frozenset(
    {"version", "byteorder", ".format_version", ".storage_alignment",
     ".data/serialization_id", ".data/version"}
)


#: The compression methods torch's miniz reads.
_METHODS = frozenset({_zip.STORED, _zip.DEFLATED})

#: What ``std::stoull`` reads of a version record: blanks, a sign, digits (the rest ignored).
_VERSION = re.compile(r"[ \t\n\v\f\r]*[+-]?(\d+)")


def _first_member_name(head: bytes) -> str:
    """Name of the first local header in ``head`` ('' if none): sniffing a cut-off archive."""
    if len(head) < _LOCAL.size or head[:4] != b"PK\x03\x04":
        return ""
    name_len = _LOCAL.unpack_from(head)[9]
    return head[_LOCAL.size : _LOCAL.size + name_len].decode("utf-8", "replace")


def _is_data_pkl(name: str) -> bool:
    return name == "data.pkl" or (name.endswith("/data.pkl") and name.count("/") == 1)


class TorchZipReader:
    """``torch.save`` zip archives and TorchScript (``torch.jit.save``) archives."""

    name = "pytorch"
    extensions = (".pt", ".pth", ".bin", ".ckpt", ".tar")
    #: NumPy arrays pickled as latin-1 text (slim writes their bytes).
    storage_chunks = staticmethod(torch_storage_chunks)

    def sniff(self, source: Source) -> bool:
        """A zip whose ``data.pkl`` sits at the top or one folder deep (torch's layout)."""
        if not source.is_zip:
            return False
        names = source.zip_names()
        if names:
            return any(_is_data_pkl(n) for n in names)
        # Central directory unreadable (a cut-off file): torch writes data.pkl first.
        return _is_data_pkl(_first_member_name(source.head))

    def read(self, source: Source) -> Inventory:
        """Account for every byte of the archive.

        The cyclic garbage collector is paused while the pickle's placeholders are made (tens
        of thousands of objects a second would set it off again and again, each time walking
        all made so far: 40% of the time of a pickle of 100,000 tensors); the parse's memory
        budget still bounds what a pickle may make."""
        with paused_gc():
            return _ZipRead(source, self.name).run()


class _ZipRead:
    def __init__(self, source: Source, fmt: str) -> None:
        self.source = source
        self.path = source.path
        self.builder = InventoryBuilder(fmt, [source.path])
        self.members: dict[str, _zip.Member] = {}
        self.archive = ""
        self.roles: ScriptRoles = {}
        #: Members read whole, so already checked against their CRC-32.
        self.read_whole: set[str] = set()
        #: Storage class (``module.name``) -> (dtype, bytes per element), for each class a
        #: persistent id named.
        self.types: dict[str, tuple[str, int]] = {}
        #: The pickle being parsed: its member, its storages' folder, and their members' prefix.
        self.owner: _zip.Member | None = None
        self.folder = ""
        self.prefix = ""

    def run(self) -> Inventory:
        b = self.builder
        infos = self.source.zip_infos()
        items = _zip.members(self.path, b, infos=infos)
        # torch's miniz takes a member to start on this disk (0) or disk 1, nothing else
        # ("unsupported multidisk archive"); Python's zipfile does not look.
        disk = next((i for i in infos or () if i.volume not in (0, 1)), None)
        del infos
        self.source.forget_zip_infos()  # the members hold all we need: free it for the pickle
        if disk is not None:
            raise b.corrupt(f"member {printable(disk.filename)!r} starts on disk {disk.volume}; "
                            "torch reads single-disk archives only", disk.header_offset)
        odd = next((m for m in items if m.method not in _METHODS), None)
        if odd is not None:  # torch's miniz reads no other ("unsupported method")
            raise b.corrupt(f"member {odd.name!r} uses compression method {odd.method}; "
                            "torch reads stored and deflated members", odd.header_offset)
        if items:
            self.one_folder(items)
        self.members = {m.name: m for m in items}
        data_pkl = next((m for m in items if _is_data_pkl(m.name)), None)
        if data_pkl is None:
            raise b.corrupt("zip archive has no data.pkl member (not a torch.save checkpoint)")
        self.archive = data_pkl.name[: -len("data.pkl")]
        code = self.archive + "code/"
        scripted = any(n.startswith(code) for n in self.members)
        if not _zip.crc_recorded(data_pkl):
            b.notes.append(
                f"{data_pkl.name} records no CRC-32 (saved with compute_crc32=False): the "
                "archive's members could not be checked for corruption"
            )

        if scripted:
            self.roles = self.read_script_roles(items)
        done: set[str] = set()
        summary = self.read_pickle(data_pkl, "data", scripted)
        done.add(data_pkl.name)
        graph = scripted or summary.has_modules
        add_pickle_region(
            b, data_pkl.data_offset, data_pkl.data_offset + data_pkl.compress_size,
            Category.GRAPH if graph else Category.METADATA, data_pkl.name, summary.blobs,
        )
        constants = self.members.get(self.archive + "constants.pkl")
        if constants is not None:
            csummary = self.read_pickle(constants, "constants", scripted)
            add_pickle_region(
                b, constants.data_offset, constants.data_offset + constants.compress_size,
                Category.GRAPH, constants.name, csummary.blobs,
            )
            done.add(constants.name)
        if scripted:
            b.facts["torchscript"] = "yes"
        # declared after the pickles: their regions (one a member) are not alive beside the
        # parse's tree and memo, the peak of a file of many tensors
        _zip.account_headers(b, items)

        charged: list[_zip.Member] = []  # graph or metadata, not read: CRC-checked below
        declared = b.has_storage
        for m in items:
            if m.name in done or declared(m.name):
                continue
            rel = m.name[len(self.archive) :] if m.name.startswith(self.archive) else m.name
            if rel.startswith(("data/", "constants/")):
                # A storage no tensor refers to: all of it is unused.
                b.add_storage(
                    m.name, m.data_offset, m.compress_size, logical_nbytes=m.file_size,
                    compressed=m.method != _zip.STORED,
                    crc32=m.crc if _zip.crc_recorded(m) else None,
                )
            elif rel.startswith("code/"):
                b.add_region(m.data_offset, m.compress_size, Category.GRAPH, m.name)
                if m.name not in self.read_whole:
                    charged.append(m)
            elif rel == "byteorder":
                b.add_region(m.data_offset, m.compress_size, Category.METADATA, m.name)
                self.byteorder(m)
            elif rel in ("version", ".data/version"):
                b.add_region(m.data_offset, m.compress_size, Category.METADATA, m.name)
                self.version(m)
            elif rel == ".storage_alignment":
                b.add_region(m.data_offset, m.compress_size, Category.METADATA, m.name)
                self.alignment(m)
            elif rel == ".data/serialization_id" and not scripted:
                b.add_region(m.data_offset, m.compress_size, Category.METADATA, m.name)
                self.serialization_id(m)
            elif rel in _RECORDS or rel.startswith(("extra/", ".data/")):
                b.add_region(m.data_offset, m.compress_size, Category.METADATA, m.name)
                charged.append(m)
            else:
                if rel.endswith(".pkl") and "/" not in rel:
                    self.scan_for_globals(m, scripted)  # e.g. TorchScript's traced_inputs.pkl
                b.add_region(m.data_offset, m.compress_size, Category.OTHER, m.name)
        _zip.check_members(self.path, charged, b)
        # The member table (tens of MB for 100,000 members) is let go of before the inventory
        # is built: what build() makes then reuses its memory.
        del items, charged
        self.members = {}
        return b.build()

    def one_folder(self, items: list[_zip.Member]) -> None:
        """torch's reader takes the archive's folder from its first member (up to the first
        ``/``) and refuses a member outside it ("file in archive is not in a subdirectory")."""
        first = items[0]
        if "/" not in first.name:
            raise self.builder.corrupt(
                f"member {printable(first.name)!r}, the archive's first, lies in no folder: "
                "torch.load reads archives whose members all lie in one folder",
                first.header_offset)
        folder = first.name[: first.name.index("/") + 1]
        odd = next((m for m in items if not m.name.startswith(folder)), None)
        if odd is not None:
            raise self.builder.corrupt(
                f"member {printable(odd.name)!r} lies outside the archive's folder "
                f"{printable(folder)!r} (its first member's): torch.load refuses it",
                odd.header_offset)

    def byteorder(self, member: _zip.Member) -> None:
        """The ``byteorder`` record: ``little`` or ``big``, as ``torch.load`` requires
        ("Unknown endianness type")."""
        if member.file_size > 16:
            raise self.builder.corrupt(f"{member.name} is {member.file_size} bytes, where torch "
                                       "writes 'little' or 'big'", member.data_offset)
        value = _zip.read_member(self.path, member, self.builder)
        if value not in (b"little", b"big"):
            raise self.builder.corrupt(
                f"{member.name} says '{printable(value.decode('utf-8', 'replace'), 40)}', where "
                "torch.load accepts 'little' or 'big'", member.data_offset)

    def version(self, member: _zip.Member) -> None:
        """The archive's version record: a number from 1, as torch reads it (``std::stoull``:
        "Couldn't parse the version ... as Long Long"). A number past the versions this torch
        reads is a newer torch's archive, not a corrupt one."""
        if member.file_size > 64:
            raise self.builder.corrupt(f"{member.name} is {member.file_size} bytes, where torch "
                                       "writes a version number", member.data_offset)
        text = _zip.read_member(self.path, member, self.builder).decode("latin-1")
        m = _VERSION.match(text)
        if m is None or int(m.group(1)) == 0:
            raise self.builder.corrupt(
                f"{member.name} says '{printable(text, 40)}', where torch.load needs a version "
                "number from 1", member.data_offset)

    def alignment(self, member: _zip.Member) -> None:
        """The ``.storage_alignment`` record: ``torch.load`` reads it with ``int()``."""
        value = _zip.read_member(self.path, member, self.builder) if member.file_size <= 64 \
            else b""
        try:
            int(value)
        except ValueError:
            raise self.builder.corrupt(
                f"{member.name} says '{printable(value.decode('latin-1'), 40)}', where torch.load "
                "reads an integer", member.data_offset) from None

    def serialization_id(self, member: _zip.Member) -> None:
        """The ``.data/serialization_id`` record: ``torch.load`` hands it to Python as a str
        after the tensors are loaded (``zip_file.serialization_id()``, strict UTF-8), so bytes
        that are not UTF-8 fail every load with a ``UnicodeDecodeError``. (``torch.jit.load``
        does not read it: TorchScript archives are not checked.)"""
        value = _zip.read_member(self.path, member, self.builder)
        try:
            value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.builder.corrupt(
                f"{member.name} is not UTF-8 text (byte {exc.start}: {value[exc.start]:#04x}): "
                "torch.load fails on it (UnicodeDecodeError) after reading the tensors",
                member.data_offset) from None

    def scan_for_globals(self, member: _zip.Member, scripted: bool) -> None:
        """Record the unsafe globals of a side pickle whose tensors are not itemized."""
        data, start, end = _zip.pickle_data(self.path, member, self.builder)
        try:
            scans = scan_all(data, offset=start, end=end,
                             budget=ParseBudget(self.path, member.name))
        except PickleError as exc:
            self.builder.notes.append(f"{member.name} is not a valid pickle: {exc}")
            scans = [PickleScan(None, exc.offset, [], exc.unsafe)]
        self.record_unsafe(scans, scripted)

    def record_unsafe(self, scans: list[PickleScan], scripted: bool) -> None:
        """Unsafe globals of ``scans``; TorchScript's own classes run no Python on load."""
        for s in scans:
            for name in s.unsafe:
                if not (scripted and name.startswith("__torch__.")):
                    self.builder.add_unsafe_global(name)

    def read_pickle(self, member: _zip.Member, folder: str, scripted: bool) -> Summary:
        """Parse one pickle member, declare the storages it names, classify its tensors.

        A stored pickle (what torch writes) is parsed in place in a map of the file, its
        offsets the file's; the parse is bounded by what it finds (:class:`ParseBudget`).
        """
        b = self.builder
        data, start, end = _zip.pickle_data(self.path, member, b)
        in_place = member.method == _zip.STORED
        self.owner, self.folder, self.prefix = member, folder, f"{self.archive}{folder}/"
        budget = ParseBudget(self.path, member.name)
        try:
            parsed = scan(data, offset=start, end=end, persistent_load=self.storage,
                          budget=budget)
        except PickleError as exc:
            extra = f" (before that it calls {', '.join(exc.unsafe)})" if exc.unsafe else ""
            raise b.corrupt(
                f"{member.name} is not a valid pickle: {exc}{extra}",
                exc.offset if in_place else None,
            ) from exc
        if parsed.fails:
            raise b.corrupt(f"{member.name}: its pickle fails to load ({parsed.fails}, which is "
                            "not callable: TypeError)", start if in_place else None)
        scans = [parsed]
        if parsed.end < end and looks_like_pickle(data, parsed.end, end):
            # torch.load reads one pickle; a second one hidden after STOP is still reported.
            try:
                scans.extend(scan_all(data, offset=parsed.end, end=end, budget=budget))
            except PickleError as exc:
                scans.append(PickleScan(None, exc.offset, [], exc.unsafe))
            b.notes.append(f"{member.name} holds bytes after its pickle's STOP")
        self.record_unsafe(scans, scripted)
        prefix = ("constants",) if folder == "constants" else ()
        # The walk needs the tree only: the map of the file (whose pages the parse read count
        # to this process's memory) is let go of first.
        del data
        return classify(parsed.value, b, prefix=prefix, blob_base=0 if in_place else None,
                        script_roles=self.roles, unshared=not parsed.shared)

    def read_script_roles(self, items: list[_zip.Member]) -> ScriptRoles:
        """Parameter/buffer names of every TorchScript class, from the ``code/`` sources."""
        roles: ScriptRoles = {}
        code = self.archive + "code/"
        for m in items:
            if m.name.startswith(code) and m.name.endswith(".py"):
                text = _zip.read_member(self.path, m, self.builder)
                self.read_whole.add(m.name)
                module = m.name[len(code) : -len(".py")].replace("/", ".")
                roles.update(script_roles(module, text.decode("utf-8", "replace")))
        return roles

    def storage(self, pid: object) -> StorageRef:
        """The storage a persistent id of the pickle being parsed names, declared (once) to
        the builder."""
        if type(pid) is tuple and len(pid) >= 5 and pid[0] == "storage":
            # The common form first, its checks the same as below's (one call per tensor).
            storage_type, key, location, numel = pid[1], pid[2], pid[3], pid[4]
            known = (self.types.get(storage_type.qualname) if type(storage_type) is Global
                     else None)
            if known is not None and type(key) is str and type(numel) is int and numel >= 0:
                member = self.members.get(self.prefix + key)
                if member is not None and numel * known[1] == member.file_size:
                    name, _, data_offset, compress_size, file_size, method, _ = member
                    b = self.builder
                    if not b.has_storage(name):
                        b.add_storage(
                            name, data_offset, compress_size, logical_nbytes=file_size,
                            compressed=method != _zip.STORED, dtype=known[0],
                            crc32=member.crc if _zip.crc_recorded(member) else None,
                        )
                    return StorageRef(name, known[0], numel,
                                      location if type(location) is str else str(location))
        folder, owner = self.folder, self.owner
        assert owner is not None  # set by read_pickle
        b = self.builder
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise b.corrupt(
                f"{owner.name}: persistent id {describe(pid)} is not "
                "('storage', type, key, location, numel)", owner.header_offset,
            )
        storage_type, key, location, numel = pid[1:5]
        dtype = storage_dtype(storage_type)
        if dtype is None:
            raise b.corrupt(f"{owner.name}: unknown storage type {describe(storage_type)}")
        if not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
            raise b.corrupt(
                f"{owner.name}: storage key {describe(key)} / size {describe(numel)} invalid"
            )
        if type(storage_type) is Global:
            # its dtype is its qualname's (storage_dtype): classes of one name share an entry
            self.types[storage_type.qualname] = (dtype, storage_itemsize(dtype))
        name = f"{self.archive}{folder}/{key}"
        m = self.members.get(name)
        if m is None:
            raise b.corrupt(f"{owner.name} refers to storage {key!r} but the archive has no {name}")
        name = m.name  # the member's own string: one copy of each name (6.5 MB of 100,000)
        nbytes = numel * storage_itemsize(dtype)
        if nbytes != m.file_size:
            raise b.corrupt(
                f"storage {name} should hold {numel} x {dtype} = {nbytes} bytes "
                f"but the member holds {m.file_size}", m.header_offset,
            )
        if not b.has_storage(name):
            b.add_storage(
                name, m.data_offset, m.compress_size, logical_nbytes=m.file_size,
                compressed=m.method != _zip.STORED, dtype=dtype,
                crc32=m.crc if _zip.crc_recorded(m) else None,
            )
        return StorageRef(name, dtype, numel, str(location))
