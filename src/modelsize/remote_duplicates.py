"""Duplicate tensors of a remote checkpoint, found by sampled ranges of their bytes.

Locally, ``inspect`` takes as candidates the storages of one size, dtype, shape (and recorded
CRC-32), prunes them by a digest of their first, middle and last 4 KiB and compares the rest
whole (:meth:`modelsize.inventory.InventoryBuilder._find_duplicates`). A remote checkpoint
cannot be compared whole without downloading it, so its candidates are compared by samples
only, fetched by range requests:

1. the middle :data:`PROBE` bytes of every candidate (weights that differ, differ there:
   nearly every group ends here, one request per candidate);
2. for the candidates still equal, their first and last :data:`PROBE` bytes.

A storage of at most ``3 * PROBE`` bytes is fetched whole, and so compared exactly; equal
middles that are one value repeated (zero-initialised tensors) are left alone, as locally,
their ends not fetched. Ranges of one file that lie within :data:`NEAR` bytes of each other
are fetched in one request; :data:`WORKERS` requests run at once.

The samples are bounded per file, :data:`MAX_BYTES` bytes and :func:`max_requests` requests,
and for the whole inspection: :data:`MAX_BYTES` bytes and as many requests as its headers
took, or the largest file's :func:`max_requests` if that is more (so a repository's duplicate
search at most doubles its requests). Groups are taken smallest first (tied embeddings are a
pair; eighty same-shaped projections are unlikely to hold a copy) and a group that would pass
a budget is left uncompared, and counted. Two tensors whose samples are equal but whose other
bytes differ are reported as duplicates: the report says the comparison was by samples.
Files that are on this disk (a Hub file in the local cache) are read, not fetched.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from modelsize.dtypes import DTYPES
from modelsize.errors import InputError, printable
from modelsize.formats.base import real_path

#: Bytes of one sample (the local search's probes are 4 KiB: remote ones cost the network).
PROBE = 1024
#: Sampled ranges of one file closer than this are fetched in one request.
NEAR = 4096
#: The most one file's samples may fetch, bytes (gaps merged into requests included).
MAX_BYTES = 1 * 2**20
#: Requests at once.
WORKERS = 8


def max_requests(file_bytes: int) -> int:
    """The most requests the samples of a file of ``file_bytes`` may take: 16, and one more
    per 256 MiB (a 14 GB checkpoint: 68)."""
    return 16 + file_bytes // (256 * 2**20)


@dataclass
class _Budget:
    bytes_left: int
    requests_left: int


@dataclass
class SampledDuplicates:
    """The duplicate search of a remote inspection (set as
    :data:`modelsize.inventory.SAMPLED_DUPLICATES`); it keeps what it compared and fetched.

    ``origins`` maps a file's real local path (its sparse mirror) to its
    :class:`~modelsize.remote.Origin`; a file not in it holds its real bytes (read locally),
    and so do the ranges of a mirror fetched already (a proto's embedded tensors, a pickle's
    small arrays). ``open_source(origin)`` gives the :class:`~modelsize.remote.RangeSource`
    samples are fetched through.
    """

    origins: Mapping[str, Any]
    open_source: Any
    #: The requests the inspection made so far (its headers': read at the first search).
    header_requests: Any = None
    #: Candidate tensors (storages) compared by samples, and their groups.
    compared: int = 0
    groups: int = 0
    #: Candidates (and groups) left uncompared: a file's budget was spent.
    skipped: int = 0
    skipped_groups: int = 0
    #: Storages found to be copies of an earlier one.
    found: int = 0
    #: Bytes and requests the samples fetched (bytes read from local files not counted).
    fetched: int = 0
    requests: int = 0
    #: Why the search stopped, when a fetch failed (the report is the headers' then).
    failed: str = ""
    _budgets: dict[str, _Budget] = field(default_factory=dict, repr=False)
    #: The whole inspection's budget (set at the first search) and its request cap.
    _total: _Budget | None = field(default=None, repr=False)
    cap: int = 0
    _sources: dict[str, Any] = field(default_factory=dict, repr=False)
    _have: dict[str, list[tuple[int, int]]] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"method": "samples", "sample_bytes": PROBE, "compared": self.compared,
                "groups": self.groups, "not_compared": self.skipped,
                "groups_not_compared": self.skipped_groups, "found": self.found,
                "fetched_bytes": self.fetched, "requests": self.requests,
                "failed": self.failed or None}

    def summary(self) -> str:
        """One sentence for the report: how duplicates were compared, at what cost."""
        if self.failed:
            return f"duplicate tensors not compared: {self.failed}"
        if not self.compared and not self.skipped:
            return ("duplicate tensors: none possible (no two tensors of one size, dtype and "
                    "shape)")
        out = (f"duplicate tensors compared by samples (the first, middle and last "
               f"{PROBE:,} bytes of each, not their whole bytes): {_n(self.compared, 'candidate')} "
               f"in {_n(self.groups, 'group')}, {self.found} found, {self.fetched:,} bytes in "
               f"{_n(self.requests, 'request')}")
        if self.skipped:
            out += (f"; {_n(self.skipped, 'candidate')} in {_n(self.skipped_groups, 'group')} "
                    f"not compared (past the samples' budget: {MAX_BYTES:,} bytes and "
                    f"{self.cap} requests)")
        return out

    # -- the search --------------------------------------------------------------------------
    def __call__(self, builder: Any, candidates: list[tuple[str, list[str]]],
                 storages: Mapping[str, Any]) -> dict[str, str]:
        """``{key: original key}`` for the candidate groups ``(dtype, keys)`` of ``builder``
        whose samples are equal (see the module docstring)."""
        if self.failed:
            return {}
        paths = [str(real_path(f.path, must_exist=False)) for f in builder.files]
        for info, path in zip(builder.files, paths, strict=True):
            self._budgets.setdefault(path, _Budget(MAX_BYTES, max_requests(info.nbytes)))
        if self._total is None:
            self.cap = max(int(self.header_requests()) if self.header_requests else 0,
                           max_requests(max(f.nbytes for f in builder.files)))
            self._total = _Budget(MAX_BYTES, self.cap)

        def place(key: str) -> tuple[int, int, int]:
            st = storages[key]
            return st.file, st.offset, st.nbytes

        def first(key: str) -> list[tuple[int, int, int]]:
            return _first_ranges(*place(key))

        def second(key: str) -> list[tuple[int, int, int]]:
            return _second_ranges(*place(key))

        ordered = sorted(candidates, key=lambda g: (len(g[1]), -storages[g[1][0]].nbytes))
        try:
            chosen = self._plan(ordered, first, paths)
            self.compared += sum(len(keys) for _, keys in chosen)
            self.groups += len(chosen)
            got = self._fetch([r for _, keys in chosen for k in keys for r in first(k)], paths)
            equal = [(dtype, same) for dtype, keys in chosen
                     for same in _split(keys, lambda k: _sample(got, first(k)))]
            small = [(dtype, keys) for dtype, keys in equal if place(keys[0])[2] <= 3 * PROBE]
            # equal middles that are one value repeated (zero-initialised tensors; a sparse
            # file's holes): left alone, their ends not fetched, as locally
            large = [(dtype, keys) for dtype, keys in equal if place(keys[0])[2] > 3 * PROBE
                     and not _constant(_sample(got, first(keys[0])), dtype)]
            rest = self._plan(large, second, paths)
            # equal middles, no budget left for their ends: counted as not compared by _plan
            self.compared -= sum(len(keys) for _, keys in large) - sum(
                len(keys) for _, keys in rest)
            got.update(self._fetch([r for _, keys in rest for k in keys for r in second(k)],
                                   paths))
        except (InputError, OSError) as exc:  # a failed fetch stops the search, not the report
            self.failed = f"fetching samples failed ({printable(str(exc), 200)})"
            return {}
        final = small + [(dtype, same) for dtype, keys in rest
                         for same in _split(keys, lambda k: _sample(got, _all_ranges(*place(k))))]
        result: dict[str, str] = {}
        for dtype, keys in final:
            if _constant(_sample(got, _all_ranges(*place(keys[0]))), dtype):
                continue  # one value repeated (zeros): equal by construction, left alone
            for key in keys[1:]:
                result[key] = keys[0]
        self.found += len(result)
        if result:
            builder.notes.append(
                f"duplicates found by comparing samples (the first, middle and last {PROBE:,} "
                "bytes of each tensor), not whole tensors: the file was read remotely")
        return result

    def _plan(self, groups: list[tuple[str, list[str]]],
              ranges: Any, paths: list[str]) -> list[tuple[str, list[str]]]:
        """The groups, in order, whose ``ranges(key)`` of every key, fetched together (ranges
        within :data:`NEAR` merged into one request), stay within each file's budget; the
        others are counted as not compared."""
        planned: dict[int, list[tuple[int, int]]] = {}  # per file: merged spans
        total = self._total
        assert total is not None
        used_requests = used_bytes = 0  # by the planned spans, all files together
        chosen: list[tuple[str, list[str]]] = []
        for dtype, keys in groups:
            trial: dict[int, list[tuple[int, int]]] = {}
            fits = True
            for file, start, stop in (r for k in keys for r in ranges(k)):
                if self._local(paths[file], start, stop):
                    continue  # on this disk: read, not fetched
                spans = trial.get(file)
                if spans is None:
                    spans = trial[file] = list(planned.get(file, ()))
                _insert(spans, start, stop)
                budget = self._budgets[paths[file]]
                if len(spans) > budget.requests_left or _span_bytes(spans) > budget.bytes_left:
                    fits = False
                    break
            more_requests = used_requests + sum(
                len(spans) - len(planned.get(f, ())) for f, spans in trial.items())
            more_bytes = used_bytes + sum(
                _span_bytes(spans) - _span_bytes(planned.get(f, [])) for f, spans in trial.items())
            if fits and more_requests <= total.requests_left and more_bytes <= total.bytes_left:
                planned.update(trial)
                used_requests, used_bytes = more_requests, more_bytes
                chosen.append((dtype, keys))
            else:
                self.skipped += len(keys)
                self.skipped_groups += 1
        return chosen

    def _fetch(self, ranges: list[tuple[int, int, int]], paths: list[str]
               ) -> dict[tuple[int, int], bytes]:
        """The bytes of each ``(file, start, stop)``, keyed ``(file, start)``: ranges of one
        file within :data:`NEAR` bytes fetched in one request, :data:`WORKERS` at once."""
        out: dict[tuple[int, int], bytes] = {}
        remote: list[tuple[int, int, int]] = []
        handles: dict[int, Any] = {}
        try:
            for file, start, stop in sorted(set(ranges)):
                if not self._local(paths[file], start, stop):
                    remote.append((file, start, stop))
                    continue
                fh = handles.get(file)
                if fh is None:
                    fh = handles[file] = open(paths[file], "rb")  # noqa: SIM115 (closed below)
                out[(file, start)] = os.pread(fh.fileno(), stop - start, start)
        finally:
            for fh in handles.values():
                fh.close()
        spans: list[tuple[int, int, int]] = []  # (file, start, stop), merged
        members: list[list[tuple[int, int, int]]] = []  # the ranges each span covers
        for file, start, stop in remote:
            if spans and spans[-1][0] == file and start - spans[-1][2] <= NEAR:
                spans[-1] = (file, spans[-1][1], max(spans[-1][2], stop))
                members[-1].append((file, start, stop))
            else:
                spans.append((file, start, stop))
                members.append([(file, start, stop)])
        for file, start, stop in spans:
            for budget in (self._budgets[paths[file]], self._total):
                assert budget is not None
                budget.requests_left -= 1
                budget.bytes_left -= stop - start

        def fetch(span: tuple[int, int, int]) -> bytes:
            file, start, stop = span
            data: bytes = self._source(paths[file], self.origins[paths[file]]).fetch(start,
                                                                                     stop)
            with self._lock:
                self.fetched += len(data)
                self.requests += 1
            return data

        with ThreadPoolExecutor(max_workers=WORKERS) as pool:
            datas = list(pool.map(fetch, spans))
        for (_file, lo, _hi), covered, data in zip(spans, members, datas, strict=True):
            for file, start, stop in covered:
                out[(file, start)] = data[start - lo:stop - lo]
        return out

    def _source(self, path: str, origin: Any) -> Any:
        with self._lock:
            src = self._sources.get(path)
            if src is None:
                src = self._sources[path] = self.open_source(origin)
        return src

    def _local(self, path: str, start: int, stop: int) -> bool:
        """Whether bytes ``[start, stop)`` of ``path`` are on this disk: a real file, or a
        mirror's range fetched already."""
        origin = self.origins.get(path)
        if origin is None:
            return True
        have = self._have.get(path)
        if have is None:  # the fetched ranges, merged (once: nothing is added any more)
            have = self._have[path] = []
            for a, b in sorted(origin.fetched):
                if have and a <= have[-1][1]:
                    have[-1] = (have[-1][0], max(have[-1][1], b))
                else:
                    have.append((a, b))
        i = bisect.bisect_right(have, (start, float("inf"))) - 1
        return i >= 0 and have[i][0] <= start and stop <= have[i][1]


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _insert(spans: list[tuple[int, int]], start: int, stop: int) -> None:
    """Add ``[start, stop)`` to the sorted, merged ``spans`` (ranges within :data:`NEAR`
    bytes of each other merge, as :meth:`SampledDuplicates._fetch` merges them)."""
    i = bisect.bisect_left(spans, (start, stop))
    lo = i
    while lo > 0 and start - spans[lo - 1][1] <= NEAR:
        lo -= 1
    hi = i
    while hi < len(spans) and spans[hi][0] - stop <= NEAR:
        hi += 1
    if lo < hi:
        start, stop = min(start, spans[lo][0]), max(stop, spans[hi - 1][1])
    spans[lo:hi] = [(start, stop)]


def _span_bytes(spans: list[tuple[int, int]]) -> int:
    return sum(stop - start for start, stop in spans)


def _first_ranges(file: int, offset: int, nbytes: int) -> list[tuple[int, int, int]]:
    """A small storage whole; else its middle :data:`PROBE` bytes."""
    if nbytes <= 3 * PROBE:
        return [(file, offset, offset + nbytes)]
    mid = offset + nbytes // 2
    return [(file, mid, mid + PROBE)]


def _second_ranges(file: int, offset: int, nbytes: int) -> list[tuple[int, int, int]]:
    """A large storage's first and last :data:`PROBE` bytes."""
    return [(file, offset, offset + PROBE), (file, offset + nbytes - PROBE, offset + nbytes)]


def _all_ranges(file: int, offset: int, nbytes: int) -> list[tuple[int, int, int]]:
    if nbytes <= 3 * PROBE:
        return _first_ranges(file, offset, nbytes)
    first, last = _second_ranges(file, offset, nbytes)
    return [first, *_first_ranges(file, offset, nbytes), last]


def _sample(got: Mapping[tuple[int, int], bytes], ranges: list[tuple[int, int, int]]) -> bytes:
    return b"".join(got[(file, start)] for file, start, _stop in ranges)


def _split(keys: list[str], sample: Any) -> list[list[str]]:
    """The groups (of two or more, in order) of ``keys`` whose samples are equal."""
    by: dict[bytes, list[str]] = {}
    for key in keys:
        by.setdefault(sample(key), []).append(key)
    return [same for same in by.values() if len(same) > 1]


def _constant(sample: bytes, dtype: str) -> bool:
    """Whether ``sample`` is one value of ``dtype`` repeated."""
    itemsize = max(1, int(DTYPES[dtype].itemsize)) if dtype in DTYPES else 1
    value = sample[:itemsize]
    return bool(value) and sample == value * (len(sample) // len(value))
