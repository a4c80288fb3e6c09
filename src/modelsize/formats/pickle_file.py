"""Plain pickle files (``.pkl``, ``.pickle``, ``.joblib``...), read without loading them.

Every consecutive pickle in the file is parsed (a loader that calls ``load`` twice runs a
second, hidden one). The pickles' bytes are metadata, or graph when they hold module objects;
NumPy arrays whose data is a bytes payload inside the pickle (protocol 3 and later) are
tensors whose data is accounted as a storage of its own; bytes after the last pickle are
``other``. Every callable a load would import and call and that is not known to be safe is
listed in ``unsafe_globals``.

Python 2 pickled a NumPy array's data as a ``str`` (``BINSTRING``/``SHORT_BINSTRING``, the
raw bytes in the file): the parser places such data by the opcodes around it, so that the array
is itemized like a Python 3 one. (Protocol 0 escapes the bytes as text: those arrays stay part
of the pickle's bytes.) Python 3 at protocol 2 pickles them as ``_codecs.encode(<text>,
'latin1')``, the text UTF-8 in the file (up to twice the array's bytes): the call is parsed,
never run, and the text's bytes are the array's storage, decoded for ``slim`` by
:func:`~modelsize.formats._torch_tree.latin1_chunks`.

Uncompressed joblib files are pickles too, with one twist: after each
``joblib.numpy_pickle.NumpyArrayWrapper`` the array's bytes follow inline (after a one-byte
padding length and the padding, since joblib 1.2). The parser skips them and hands the array
to the classifier like any NumPy array. Compressed joblib files are not read.
"""

from __future__ import annotations

import math
import re

from modelsize._records import field, record
from modelsize.categories import Category
from modelsize.formats._limits import ParseBudget
from modelsize.formats._pickle import (
    Blob,
    Call,
    Data,
    Global,
    PickleError,
    looks_like_pickle,
    scan,
    scan_all,
)
from modelsize.formats._torch_tree import (
    add_pickle_region,
    classify,
    describe,
    global_name,
    latin1_chunks,
    numpy_dtype,
    numpy_itemsize,
    place_python2_array,
)
from modelsize.formats.base import Source
from modelsize.formats.torch_legacy import open_mapped
from modelsize.inventory import Inventory, InventoryBuilder

#: A protocol 0 pickle that opens with ``GLOBAL module\nname\n``: recognised without extension.
_GLOBAL_START = re.compile(rb"c[A-Za-z_][\w.]*\n[A-Za-z_][\w.]*\n")
_WRAPPER = "joblib.numpy_pickle.NumpyArrayWrapper"
_ARRAY_TYPES = frozenset({"numpy.ndarray", "numpy.matrix", "numpy.memmap"})
_RECONSTRUCT = Global("numpy.core.multiarray", "_reconstruct")


class PickleReader:
    """Generic pickles."""

    name = "pickle"
    extensions = (".pkl", ".pickle", ".joblib", ".pk", ".pck")
    #: The only encoded storages of a pickle: arrays pickled as latin-1 text.
    storage_chunks = staticmethod(latin1_chunks)

    def sniff(self, source: Source) -> bool:
        """``PROTO 2..5`` first; protocol 0/1 starts only with a pickle extension or a GLOBAL."""
        head = source.head
        if len(head) >= 2 and head[0] == 0x80:
            return 2 <= head[1] <= 5
        if source.suffix in self.extensions:
            return looks_like_pickle(head)
        return _GLOBAL_START.match(head) is not None

    def read(self, source: Source) -> Inventory:
        """Account for every byte of the file."""
        b = InventoryBuilder(self.name, [source.path])
        data = open_mapped(source.path)
        joblib = _Joblib(data)
        try:
            scans = scan_all(data, on_build=joblib.after_build,
                             budget=ParseBudget(source.path, source.path.name))
        except PickleError as exc:
            found = ""
            if exc.unsafe:
                found = f"; before that it calls {', '.join(exc.unsafe)}"
            elif exc.globals:
                found = f"; it references {', '.join(exc.globals)}"
            raise b.corrupt(f"{exc}{found}", exc.offset) from exc
        if scans[0].fails:
            raise b.corrupt(f"the pickle fails to load ({scans[0].fails}, which is not "
                            f"callable: TypeError)", 0)
        for name in joblib.unsafe:
            b.add_unsafe_global(name)
        many = len(scans) > 1
        for i, s in enumerate(scans):
            for name in s.unsafe:
                b.add_unsafe_global(name)
            if s.error is not None:
                b.notes.append(f"pickle {i} at byte {s.start} breaks off: {s.error}")
                b.add_region(s.start, s.end - s.start, Category.OTHER, f"broken pickle {i}")
                continue
            summary = classify(s.value, b, prefix=(f"pickle{i}",) if many else (), blob_base=0)
            category = Category.GRAPH if summary.has_modules else Category.METADATA
            holes = summary.blobs + [(o, n) for o, n in joblib.opaque if s.start <= o < s.end]
            add_pickle_region(b, s.start, s.end, category, f"pickle {i}", holes)
        for offset, nbytes in joblib.opaque:
            b.add_region(offset, nbytes, Category.OTHER, "joblib array data (non-numeric dtype)")
        if joblib.arrays:
            b.facts["joblib_arrays"] = str(joblib.arrays)
        if many:
            b.notes.append(f"file holds {len(scans)} consecutive pickles")
        end = scans[-1].end
        if end < b.files[0].nbytes:
            tail = b.files[0].nbytes - end
            b.add_region(end, tail, Category.OTHER, "bytes after the last pickle")
        return b.build()


@record
class _Joblib:
    """Follows joblib's inline array data while the pickle is parsed."""

    data: Data
    arrays: int = 0
    unsafe: list[str] = field(default_factory=list)
    #: (offset, bytes) of array data that cannot be itemized as a tensor (strings, records).
    opaque: list[tuple[int, int]] = field(default_factory=list)

    def after_build(self, obj: Call, pos: int) -> tuple[int, object] | None:
        """Skip the array bytes after a NumpyArrayWrapper; put the array in its place.

        A Python 2 array whose data is a ``str`` gets the data's place in the file instead.
        """
        if isinstance(obj.state, tuple):
            place_python2_array(self.data, obj, pos)
            return None
        if global_name(obj.func) != _WRAPPER or not isinstance(obj.state, dict):
            return None
        state = obj.state
        subclass = state.get("subclass")
        if global_name(subclass) not in _ARRAY_TYPES:
            self.unsafe.append(global_name(subclass) or "<array subclass>")
        shape = state.get("shape")
        if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
            raise PickleError(f"joblib array shape {describe(shape)} is not a tuple of sizes", pos)
        itemsize = numpy_itemsize(state.get("dtype"))
        self.arrays += 1
        if itemsize is None:  # object arrays follow as a pickle of their own
            nested = scan(self.data, offset=pos)
            self.unsafe.extend(nested.unsafe)
            return nested.end, obj
        if state.get("numpy_array_alignment_bytes") is not None:
            if pos >= len(self.data):
                raise PickleError("joblib array padding runs past the end of the file", pos)
            pos += 1 + self.data[pos]
        nbytes = math.prod(shape) * itemsize
        if pos + nbytes > len(self.data):
            raise PickleError(
                f"joblib array of {nbytes} bytes runs past the end of the file", pos
            )
        dtype = state.get("dtype")
        if numpy_dtype(dtype) is None:
            self.opaque.append((pos, nbytes))
            return pos + nbytes, obj
        fortran = state.get("order") == "F"
        array = Call(_RECONSTRUCT, (Global("numpy", "ndarray"), (0,), b"b"))
        array.state = (1, shape, dtype, fortran, Blob(pos, nbytes))
        return pos + nbytes, array
