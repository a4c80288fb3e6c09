"""Keras files: ``.keras`` zip archives, legacy ``.h5`` full models and ``.weights.h5`` files.

All three keep their variables in HDF5, read here by :mod:`._hdf5` without h5py. Inside a
``.keras`` archive the HDF5 member is read in place: a stored member (what Keras writes) is
addressed directly at its offset in the zip; a deflated one (an archive re-zipped by hand)
through :class:`InflatedBlob`, which inflates it once, keeps restart points, and charges
each dataset the compressed bytes of its stretch of the stream. Nothing is extracted; such
datasets are *encoded* storages, whose bytes :func:`storage_chunks` inflates for ``slim``.

What each part is:

* ``.keras``: ``config.json`` is graph, ``metadata.json`` metadata, ``assets/`` other; in
  ``model.weights.h5``, ``layers/*/vars/*`` are weights, except BatchNormalization's moving
  statistics and Normalization's adapted state (buffers: Keras 3 stores variables by index,
  so the layer class comes from ``config.json``), and ``optimizer/vars/*`` is optimizer
  state. Keras 3 keeps optimizer state even with ``include_optimizer=False`` and in
  ``save_weights`` files: that is what this reader shows.
* legacy ``.h5``: ``model_weights/`` weights and buffers (``moving_mean:0``...),
  ``optimizer_weights/`` optimizer state, the ``model_config`` attribute graph.
* HDF5 structure (headers, B-trees, heaps, attribute names) is metadata.

``config.json`` and ``metadata.json`` are checked against their CRC-32 (as Keras's own
``zipfile`` does when it loads them); a deflated weights member is too, while it is inflated.
A stored one is tensor data in place and is not read, so not checked.
"""

from __future__ import annotations

import bisect
import json
import mmap
import os
import re
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, BinaryIO

from modelsize.categories import Category
from modelsize.errors import UsageError, printable
from modelsize.formats import _limits, _zip
from modelsize.formats._hdf5 import SIGNATURE, Blob, BytesBlob, H5File, HDF5Error, read_hdf5
from modelsize.formats._keras_optimizer import optimizer_facts
from modelsize.formats.base import Source
from modelsize.inventory import Inventory, InventoryBuilder, StorageRecord

__all__ = ["InflatedBlob", "KerasH5Reader", "KerasReader", "account_hdf5", "categorize",
           "layer_classes", "storage_chunks", "unknown_groups", "weight_groups"]

WEIGHTS_MEMBER = "model.weights.h5"
_BUFFER_LEAVES = frozenset(
    {
        "moving_mean", "moving_variance", "moving_stddev", "renorm_mean", "renorm_stddev",
        "renorm_mean_weight", "renorm_stddev_weight", "seed_generator_state",
    }
)
#: Keras 3 layer classes whose last two variables are moving statistics.
_BATCH_NORMS = frozenset({"BatchNormalization", "SyncBatchNormalization"})
#: Keras 3 layer classes whose variables are all adapted, non-trainable state.
_ADAPTED = frozenset({"Normalization"})
_AUTO_BN = re.compile(r"^batch_normalization(_\d+)?$")
_AUTO_NORMALIZATION = re.compile(r"^normalization(_\d+)?$")
_GRAPH_ATTRS = frozenset({"model_config"})

# (blob offset, nbytes) -> (file offset, nbytes, compressed)
Placer = Callable[[int, int], tuple[int, int, bool]]


class InflatedBlob:
    """Random access into a deflated zip member without inflating it to memory or disk.

    One pass inflates the stream, checks its size and CRC-32, and keeps a decompressor
    snapshot every ``interval`` output bytes plus an (input, output) position pair every
    64 KiB of input. Reads restart from the nearest snapshot; pages are cached.
    """

    _STEP = 1 << 16
    _PAGE = 1 << 16
    _CACHE_PAGES = 64
    #: Bytes inflated at a time while scanning.
    _PIECE = 1 << 22

    def __init__(self, fh: BinaryIO, member: _zip.Member) -> None:
        self.fh = fh
        self.start = member.data_offset
        self.csize = member.compress_size
        self.size = member.file_size
        self.interval = max(1 << 20, self.size // 256)
        self.points_c: list[int] = [0]
        self.points_u: list[int] = [0]
        self.snapshots: list[tuple[int, int, zlib._Decompress]] = []
        self.snapshot_u: list[int] = []
        self.pages: OrderedDict[int, bytes] = OrderedDict()
        self._scan(member)

    def _scan(self, member: _zip.Member) -> None:
        d = zlib.decompressobj(-15)
        self.snapshots.append((0, 0, d.copy()))
        self.snapshot_u.append(0)
        crc, out, last_snap = 0, 0, 0
        for c in range(0, self.csize, self._STEP):
            chunk = self._compressed(c)
            # Inflated a piece at a time: a chunk of a highly compressed stream is never held
            # inflated whole.
            while chunk and out <= self.size:
                data = d.decompress(chunk, self._PIECE)
                chunk = d.unconsumed_tail
                crc = zlib.crc32(data, crc)
                out += len(data)
                if not data:
                    break
            if out > self.size:
                break
            self.points_c.append(c + min(self._STEP, self.csize - c))
            self.points_u.append(out)
            if out - last_snap >= self.interval:
                self.snapshots.append((c + min(self._STEP, self.csize - c), out, d.copy()))
                self.snapshot_u.append(out)
                last_snap = out
        if out != self.size or crc != member.crc:
            raise ValueError(
                f"member {member.name!r} inflates to {out} bytes with CRC {crc:#010x}, its "
                f"header says {self.size} bytes with CRC {member.crc:#010x}"
            )

    def _compressed(self, c: int) -> bytes:
        # Plain reads, not a memory map: the scan would otherwise count the whole member as RSS.
        self.fh.seek(self.start + c)
        chunk = self.fh.read(min(self._STEP, self.csize - c))
        if not chunk:
            raise ValueError("deflated member ends early")
        return chunk

    def read(self, offset: int, nbytes: int) -> bytes:
        """Bytes ``offset..offset+nbytes`` of the inflated member."""
        parts = []
        pos = offset
        end = offset + nbytes
        while pos < end:
            page = pos // self._PAGE
            data = self._page(page)
            lo = pos - page * self._PAGE
            take = min(end - pos, len(data) - lo)
            if take <= 0:
                raise ValueError("read past the end of an inflated member")
            parts.append(data[lo : lo + take])
            pos += take
        return b"".join(parts)

    def _page(self, page: int) -> bytes:
        cached = self.pages.get(page)
        if cached is not None:
            self.pages.move_to_end(page)
            return cached
        size = self._PAGE
        i = bisect.bisect_right(self.snapshot_u, page * size) - 1
        c, u, snap = self.snapshots[i]
        d = snap.copy()
        pending = bytearray()  # inflated bytes from output position u on
        while True:
            # Keep every whole page inflated on the way: reads tend to move forward. The page
            # asked for is returned as it is found, not looked up in the cache afterwards: a
            # stream that inflates many pages from one chunk evicts the first of them.
            first = -(-u // size) * size
            found = None
            while first + size <= u + len(pending) or (
                c >= self.csize and first < u + len(pending)
            ):
                data = bytes(pending[first - u : first - u + size])
                self._remember(first // size, data)
                if first // size == page:
                    found = data
                first += size
            if found is not None:
                return found
            if c >= self.csize or first > page * size:
                raise ValueError("read past the end of an inflated member")
            drop = min(len(pending), first - u)
            del pending[:drop]
            u += drop
            chunk = self._compressed(c)
            c += len(chunk)
            pending += d.decompress(chunk)

    def _remember(self, page: int, data: bytes) -> None:
        self.pages[page] = data
        self.pages.move_to_end(page)
        while len(self.pages) > self._CACHE_PAGES:
            self.pages.popitem(last=False)

    def stream(self, offset: int, nbytes: int, chunk: int = 8 << 20) -> Iterator[bytes]:
        """Bytes ``offset..offset+nbytes`` in pieces of at most ``chunk``: one forward pass
        from the nearest snapshot, so a dataset costs its own bytes plus one interval."""
        i = bisect.bisect_right(self.snapshot_u, offset) - 1
        c, u, snap = self.snapshots[i]
        d = snap.copy()
        skip, left = offset - u, nbytes
        while left > 0:
            if c >= self.csize:
                raise ValueError("read past the end of an inflated member")
            pending = self._compressed(c)
            c += len(pending)
            while pending and left > 0:
                data = d.decompress(pending, chunk)
                pending = d.unconsumed_tail
                if skip:
                    cut = min(skip, len(data))
                    data, skip = data[cut:], skip - cut
                if data:
                    data = data[:left]
                    left -= len(data)
                    yield data

    def compressed_offset(self, u: int) -> int:
        """Where output position ``u`` lies in the compressed stream (interpolated)."""
        i = bisect.bisect_left(self.points_u, u)
        if i < len(self.points_u) and self.points_u[i] == u:
            return self.points_c[i]
        if i == 0:
            return 0
        if i >= len(self.points_u):
            return self.csize
        u0, u1 = self.points_u[i - 1], self.points_u[i]
        c0, c1 = self.points_c[i - 1], self.points_c[i]
        return c0 + (u - u0) * (c1 - c0) // max(1, u1 - u0)


class _PathReader:
    """``seek`` and ``read`` on a path, opening it per read: an :class:`InflatedBlob` kept
    between calls of :func:`storage_chunks` holds no open file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pos = 0

    def seek(self, pos: int) -> int:
        self.pos = pos
        return pos

    def read(self, n: int) -> bytes:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            data = os.pread(fd, n, self.pos)
        finally:
            os.close(fd)
        self.pos += len(data)
        return data


#: id(inventory) -> (inventory, inflated weights member, dataset name -> (offset, nbytes)).
_INFLATED: dict[int, tuple[Inventory, InflatedBlob, dict[str, tuple[int, int] | None]]] = {}


def storage_chunks(inv: Inventory, storage: StorageRecord) -> Iterator[bytes]:
    """The raw bytes of a dataset of a deflated ``model.weights.h5`` member, inflated.

    Datasets with HDF5 filters (gzip, shuffle...) are refused: their raw bytes are not the
    data, and Keras never writes them.
    """
    hit = _INFLATED.get(id(inv))
    if hit is None or hit[0] is not inv:
        if len(_INFLATED) > 4:
            _INFLATED.clear()
        hit = _INFLATED[id(inv)] = (inv, *_inflated_weights(inv))
    _, blob, pieces = hit
    where = pieces.get(storage.key)
    if where is None:
        raise UsageError(f"{printable(storage.key)} is stored chunked or with HDF5 filters, "
                         "which modelsize does not decode (Keras never writes such datasets)")
    yield from blob.stream(*where)


def _inflated_weights(
    inv: Inventory,
) -> tuple[InflatedBlob, dict[str, tuple[int, int] | None]]:
    path = inv.files[0].path
    builder = InventoryBuilder(inv.format, [path])
    member = next((m for m in _zip.members(path, builder) if m.name == WEIGHTS_MEMBER), None)
    if member is None or member.method != _zip.DEFLATED:
        raise UsageError(f"{printable(str(path))}: a chunked or filtered HDF5 dataset, which "
                         "modelsize does not decode (Keras never writes such datasets)")
    blob = InflatedBlob(_PathReader(path), member)  # type: ignore[arg-type]  # seek + read
    h5 = _parse(builder, blob, 0, member.data_offset)
    pieces: dict[str, tuple[int, int] | None] = {}
    for d in h5.datasets:
        ok = len(d.pieces) == 1 and not d.filters
        pieces[d.path.lstrip("/")] = d.pieces[0] if ok else None
    return blob, pieces


# --------------------------------------------------------------------------------------
# Categories
# --------------------------------------------------------------------------------------
def layer_classes(config: object) -> dict[str, str]:
    """Layer name -> class name for every layer in a Keras ``config.json`` (nested too)."""
    found: dict[str, str] = {}
    stack = [config]
    steps = 0
    while stack and steps < 1_000_000:
        steps += 1
        item = stack.pop()
        if isinstance(item, dict):
            cls, cfg = item.get("class_name"), item.get("config")
            if isinstance(cls, str) and isinstance(cfg, dict) and isinstance(cfg.get("name"), str):
                found.setdefault(cfg["name"], cls)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def categorize(h5: H5File, classes: dict[str, str] | None = None) -> dict[str, Category]:
    """Dataset path -> category for the layouts Keras writes (and any other HDF5 file)."""
    classes = classes or {}
    per_group: dict[str, int] = {}
    for d in h5.datasets:
        parent = d.path.rsplit("/", 1)[0]
        per_group[parent] = per_group.get(parent, 0) + 1
    out: dict[str, Category] = {}
    for d in h5.datasets:
        parts = d.path.strip("/").split("/")
        top = parts[0]
        leaf = parts[-1].split(":", 1)[0]
        if top in ("optimizer_weights", "optimizer"):
            out[d.path] = Category.OPTIMIZER_STATE
        elif top in ("metrics", "compile_metrics"):
            out[d.path] = Category.OTHER
        elif leaf in _BUFFER_LEAVES or any(p.startswith("seed_generator") for p in parts):
            out[d.path] = Category.BUFFERS
        elif len(parts) >= 3 and parts[-2] == "vars" and leaf.isdigit():
            layer = parts[-3]
            cls = classes.get(layer, "")
            count = per_group[d.path.rsplit("/", 1)[0]]
            adapted = cls in _ADAPTED or (not cls and _AUTO_NORMALIZATION.match(layer))
            batch_norm = cls in _BATCH_NORMS or (not cls and _AUTO_BN.match(layer))
            if adapted or (batch_norm and int(leaf) >= count - 2):
                out[d.path] = Category.BUFFERS
            else:
                out[d.path] = Category.WEIGHTS
        else:
            out[d.path] = Category.WEIGHTS
    return out


def account_hdf5(builder: InventoryBuilder, h5: H5File, categories: dict[str, Category],
                 place: Placer, file: int = 0) -> None:
    """Declare every dataset's raw data and graph attributes of an HDF5 file to ``builder``."""
    builder.notes.extend(h5.notes)
    for path, attrs in h5.groups.items():
        for attr in attrs.values():
            if attr.name not in _GRAPH_ATTRS:
                continue
            for start, nbytes in attr.ranges:
                where, n, _ = place(start, nbytes)
                builder.add_region(where, n, Category.GRAPH, f"attribute {path}:{attr.name}",
                                   file)
    for d in h5.datasets:
        cat = categories.get(d.path, Category.WEIGHTS)
        name = d.path.lstrip("/")
        tags = [f"filters={'+'.join(d.filters)}"] if d.filters else []
        shape: tuple[int, ...] = d.shape
        dtype = d.dtype or "uint8"
        if d.dtype is None:
            shape = (d.stored_nbytes,)
            tags += [f"hdf5_type={d.dtype_class}", f"shape={list(d.shape)}"]
        if len(d.pieces) == 1:
            start, nbytes = d.pieces[0]
            where, n, inflated = place(start, nbytes)
            # A single chunk is laid out in the chunk's shape, not the dataset's: not raw data.
            compressed = inflated or bool(d.filters) or d.layout == "chunked"
            builder.add_storage(name, where, n, file=file, compressed=compressed,
                                logical_nbytes=d.logical_nbytes if compressed else None,
                                dtype=dtype)
            builder.add_tensor(name, dtype, shape, cat, storage=name, tags=tags)
            continue
        # Several chunks cannot be one storage; their bytes still go to the dataset's category.
        for i, (start, nbytes) in enumerate(d.pieces):
            where, n, _ = place(start, nbytes)
            builder.add_region(where, n, cat, f"{name} chunk {i}", file)
        if d.pieces:
            tags.append(f"chunks={len(d.pieces)}")
        builder.add_tensor(name, dtype, shape, cat, tags=tags)


def _parse(builder: InventoryBuilder, blob: Blob, file: int, offset: int = 0) -> H5File:
    try:
        return read_hdf5(blob)
    except HDF5Error as exc:
        where = None if exc.offset is None else offset + exc.offset
        raise builder.corrupt(exc.reason, where, file) from exc


def _map(stack: ExitStack, path: Path) -> mmap.mmap:
    with open(path, "rb") as fh:
        return stack.enter_context(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))


def _config_classes(builder: InventoryBuilder, path: Path, member: _zip.Member,
                    ) -> dict[str, Any] | None:
    """A ``.keras`` archive's ``config.json``, parsed; None (with a note) when it cannot be:
    too large to parse within ``MODELSIZE_MAX_JSON_BYTES``, or not JSON."""
    limit = _limits.JSON_BYTES
    if member.file_size > limit.value():
        _zip.check_members(path, [member], builder)
        builder.notes.append(
            f"config.json is {member.file_size:,} bytes, more than modelsize parses "
            f"({limit.hint()}): layer roles are guessed from their names"
        )
        return None
    try:
        config = json.loads(_zip.read_member(path, member, builder, limit))
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError
        builder.notes.append("config.json is not valid JSON (Keras cannot load this file)")
        return None
    return config if isinstance(config, dict) else None


def _snake_case(name: str) -> str:
    """Keras 3's ``naming.to_snake_case``: ``BatchNormalization`` -> ``batch_normalization``."""
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def weight_groups(config: object) -> dict[str, str] | None:
    """The groups a Keras 3 model's layers keep their variables in, each with its layer's
    class: ``layers/<group>/vars/<i>``; None if the config lists no layers.

    Keras names them after the class, not the layer (``Dense`` -> ``dense``, the next one
    ``dense_1``), in the order of the model's layers; loading looks them up the same way, so
    a group no layer of the config accounts for is one Keras cannot load.
    """
    inner = config.get("config") if isinstance(config, dict) else None
    layers = inner.get("layers") if isinstance(inner, dict) else None
    if not isinstance(layers, list):
        return None
    used: dict[str, int] = {}
    groups: dict[str, str] = {}
    for layer in layers:
        cls = layer.get("class_name") if isinstance(layer, dict) else None
        if not isinstance(cls, str):
            return None
        name = _snake_case(cls)
        if name in used:
            used[name] += 1
            name = f"{name}_{used[name]}"
        else:
            used[name] = 0
        groups[name] = cls
    return groups


def unknown_groups(datasets: Iterable[str], groups: dict[str, str]) -> list[str]:
    """The layer groups of weights paths (``layers/<group>/...``) that ``groups`` lacks."""
    found = {p.strip("/").split("/")[1] for p in datasets if p.strip("/").startswith("layers/")}
    return sorted(found - set(groups))


def _note_unknown_layers(builder: InventoryBuilder, h5: H5File, groups: dict[str, str]) -> None:
    """A note when the weights hold layer groups the config's layers do not account for."""
    unknown = unknown_groups((d.path for d in h5.datasets), groups)
    if unknown:
        builder.notes.append(
            f"{WEIGHTS_MEMBER} holds variables of {len(unknown)} layer(s) config.json does not "
            f"have ({', '.join(printable(n, 40) for n in unknown[:3])}): Keras cannot load them"
        )


# --------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------
class KerasH5Reader:
    """HDF5 files: Keras 3 ``.weights.h5``, legacy Keras ``.h5`` models and weights."""

    name = "keras-h5"
    extensions = (".h5", ".hdf5", ".weights.h5")

    def sniff(self, source: Source) -> bool:
        """The HDF5 signature at byte 0 (or after a 512/1024/2048-byte user block)."""
        return source.kind == "file" and any(
            source.head[at : at + len(SIGNATURE)] == SIGNATURE for at in (0, 512, 1024, 2048)
        )

    def read(self, source: Source) -> Inventory:
        """Account for every byte: datasets by Keras role, ``model_config`` as graph."""
        builder = InventoryBuilder(self.name, [source.path], root=source.path)
        with ExitStack() as stack:
            mm = _map(stack, source.path)
            h5 = _parse(builder, BytesBlob(mm), 0)
            config = h5.groups.get("/", {}).get("model_config")
            classes: dict[str, str] = {}
            if config is not None and isinstance(config.value, str):
                if len(config.value) > _limits.JSON_BYTES.value():
                    builder.notes.append(
                        f"the model_config attribute is {len(config.value):,} characters, more "
                        f"than modelsize parses ({_limits.JSON_BYTES.hint()})"
                    )
                else:
                    try:
                        classes = layer_classes(json.loads(config.value))
                    except (ValueError, RecursionError):
                        builder.notes.append("model_config attribute is not valid JSON")
            builder.facts["layout"] = _h5_layout(h5)
            account_hdf5(builder, h5, categorize(h5, classes), lambda o, n: (o, n, False))
            return builder.build()


def _h5_layout(h5: H5File) -> str:
    root = h5.groups.get("/", {})
    if "model_config" in root or "/model_weights" in h5.groups:
        return "legacy Keras model"
    if "layer_names" in root:
        return "legacy Keras weights"
    if "/layers" in h5.groups or "/vars" in h5.groups:
        return "Keras 3 weights"
    return "HDF5"


class KerasReader:
    """Keras 3 ``.keras`` archives (zip of ``config.json``, ``metadata.json``, weights)."""

    name = "keras"
    extensions = (".keras",)
    storage_chunks = staticmethod(storage_chunks)

    def sniff(self, source: Source) -> bool:
        """A zip holding ``config.json`` and ``model.weights.h5`` or ``metadata.json``."""
        if source.kind != "file" or not source.is_zip:
            return False
        names = set(source.zip_names())
        return "config.json" in names and bool(names & {WEIGHTS_MEMBER, "metadata.json"})

    def read(self, source: Source) -> Inventory:
        """Account for every byte of the archive, the HDF5 member read in place."""
        path = source.path
        builder = InventoryBuilder(self.name, [path], root=path)
        members = _zip.members(path, builder, infos=source.zip_infos(), names=True)
        _zip.refuse_duplicates(members, builder, "Keras would read only the last")
        _zip.account_headers(builder, members)
        classes: dict[str, str] = {}
        groups: dict[str, str] | None = None
        weights: _zip.Member | None = None
        for m in members:
            if m.name == "config.json":
                builder.add_region(m.data_offset, m.compress_size, Category.GRAPH, m.name)
                config = _config_classes(builder, path, m)
                if config is not None:
                    classes = layer_classes(config)
                    builder.facts.update(optimizer_facts(config))
                    groups = weight_groups(config)
                    # The weights name a layer by its group: its class is known from there too.
                    classes.update(groups or {})
            elif m.name == "metadata.json":
                builder.add_region(m.data_offset, m.compress_size, Category.METADATA, m.name)
                _zip.check_members(path, [m], builder)
            elif m.name == WEIGHTS_MEMBER:
                weights = m
            elif not m.name.endswith("/"):
                builder.add_region(m.data_offset, m.compress_size, Category.OTHER, m.name)
        if weights is None:
            builder.notes.append(f"archive has no {WEIGHTS_MEMBER}")
            return builder.build()
        with ExitStack() as stack:
            mm = _map(stack, path)
            fh = stack.enter_context(open(path, "rb"))
            blob, place = self._blob(builder, mm, fh, weights)
            h5 = _parse(builder, blob, 0, weights.data_offset)
            builder.facts["weights_member"] = (
                "stored" if weights.method == _zip.STORED else "deflated"
            )
            if groups is not None:
                _note_unknown_layers(builder, h5, groups)
            account_hdf5(builder, h5, categorize(h5, classes), place)
            # Interpolated spans of a deflated stream are not data: never hash them as such.
            return builder.build(dedupe=weights.method == _zip.STORED)

    def _blob(self, builder: InventoryBuilder, mm: mmap.mmap, fh: BinaryIO,
              member: _zip.Member) -> tuple[Blob, Placer]:
        base = member.data_offset
        if member.method == _zip.STORED:
            return BytesBlob(mm, base, member.compress_size), lambda o, n: (base + o, n, False)
        if member.method != _zip.DEFLATED:
            raise builder.corrupt(
                f"{member.name} uses compression method {member.method}; modelsize reads "
                "stored and deflated members", member.header_offset,
            )
        _limits.check_inflate(builder.files[0].path, member.name, member.compress_size,
                              member.file_size)
        try:
            inflated = InflatedBlob(fh, member)
        except (ValueError, zlib.error) as exc:
            raise builder.corrupt(str(exc), base) from exc
        builder.notes.append(
            f"{member.name} is deflated: each dataset is charged the compressed bytes of its "
            "stretch of the stream"
        )

        def place(offset: int, nbytes: int) -> tuple[int, int, bool]:
            c0 = inflated.compressed_offset(offset)
            c1 = inflated.compressed_offset(offset + nbytes)
            return base + c0, c1 - c0, True

        return inflated, place


