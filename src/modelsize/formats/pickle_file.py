"""Plain pickle files (``.pkl``, ``.pickle``, ``.joblib``...), read without loading them.

Every consecutive pickle in the file is parsed (a loader that calls ``load`` twice runs a
second, hidden one). The pickles' bytes are metadata, or graph when they hold module objects;
NumPy arrays whose data is a bytes payload inside the pickle (protocol 3 and later) are
tensors whose data is accounted as a storage of its own; bytes after the last pickle are
``other``. Every callable a load would import and call and that is not known to be safe is
listed in ``unsafe_globals``.
"""

from __future__ import annotations

import re

from modelsize.categories import Category
from modelsize.formats._pickle import PickleError, looks_like_pickle, scan_all
from modelsize.formats._torch_tree import add_pickle_region, classify
from modelsize.formats.base import Source
from modelsize.formats.torch_legacy import open_mapped
from modelsize.inventory import Inventory, InventoryBuilder

#: A protocol 0 pickle that opens with ``GLOBAL module\nname\n``: recognised without extension.
_GLOBAL_START = re.compile(rb"c[A-Za-z_][\w.]*\n[A-Za-z_][\w.]*\n")


class PickleReader:
    """Generic pickles."""

    name = "pickle"
    extensions = (".pkl", ".pickle", ".joblib", ".pk", ".pck")

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
        try:
            scans = scan_all(data)
        except PickleError as exc:
            found = ""
            if exc.unsafe:
                found = f"; before that it calls {', '.join(exc.unsafe)}"
            elif exc.globals:
                found = f"; it references {', '.join(exc.globals)}"
            raise b.corrupt(f"{exc}{found}", exc.offset) from exc
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
            add_pickle_region(b, s.start, s.end, category, f"pickle {i}", summary.blobs)
        if many:
            b.notes.append(f"file holds {len(scans)} consecutive pickles")
        end = scans[-1].end
        if end < b.files[0].nbytes:
            tail = b.files[0].nbytes - end
            b.add_region(end, tail, Category.OTHER, "bytes after the last pickle")
        return b.build()
