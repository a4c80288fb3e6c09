"""Inspect files that are not on this disk: HTTP(S) range requests, ``hf://``, fsspec URLs.

A checkpoint's accounting needs its headers, never its tensors. For a remote file modelsize
fetches only the byte ranges its reader needs, per format:

* safetensors: the 8-byte length and the JSON header;
* PyTorch zip (``torch.save``): the end-of-central-directory records, the central directory,
  every member's local header (to place its data exactly) and the members that are not tensor
  payloads (the pickle, ``version``, ``byteorder``...);
* NumPy ``.npy``: the magic, the version and the header (``.npz``: each member's);
* GGUF, pickles and legacy ``torch.save`` files, ONNX (its external data sized only), HDF5
  (Keras ``.h5``, and the weights inside a ``.keras``), TFLite and TensorFlow checkpoints (the
  ``.index``, the ``.meta``'s collections; data shards sized, a TF2 object graph read from
  one), a SavedModel by its ``saved_model.pb`` (the graph sized; ``variables/`` as a
  checkpoint), a ``torch.distributed.checkpoint`` by its ``.metadata`` (each item's archive
  headers in its data file): what the walkers of :mod:`modelsize.remote_regions` read, every
  byte fetched reaching the mirror (the files beside one through :class:`Beside`);

and writes them at their offsets into a *sparse* local file of the remote file's size, which
the ordinary reader then reads. Holes are never read as data: the duplicate search (the one
place ``inspect`` reads tensor bytes) compares sampled ranges of the candidates fetched by
range requests within a budget (:mod:`modelsize.remote_duplicates`), and the report says so. The
:class:`RangeSource` counts every byte fetched; reads go through a block cache of bounded size.

``hf://org/repo`` lists the repo's files through the hub's API (``$HF_ENDPOINT``, default
``https://huggingface.co``) and inspects its weight files (``*.safetensors`` with their index,
else ``pytorch_model*.bin``...), or the checkpoint folder it is (a SavedModel, a DCP or
DeepSpeed checkpoint: :func:`_folder_model`); ``hf://org/repo/path/file`` one file.
``s3://``, ``gs://`` and any other protocol go through fsspec when the user has it and the
filesystem installed.

``slim`` needs every byte: :func:`downloaded` copies the remote files through the same range
requests, in chunks of :data:`CHUNK` bytes (memory stays bounded whatever the file's size),
into a hidden temporary folder beside the output, after checking that the folder's disk has
room for the size the server announced; the folder is removed on the way out. The findings of
a remote file name the URL as the input of their fix and put its output in the current folder
(``modelsize slim URL ... -o x.slim.pt``): a fix runs as printed.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import http.client
import json
import os
import re
import shutil
import struct
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelsize import __version__
from modelsize.errors import InputError, MissingDependencyError, printable
from modelsize.formats.base import real_path

#: Block size of the read cache (a read is rounded out to blocks) and its capacity.
BLOCK = 16 * 1024
CACHE_BLOCKS = 1024
#: Bytes the first request fetches (it learns the size too): most headers fit.
FIRST = 64 * 1024
#: The most one read-ahead fetches (a header read forward doubles its fetch up to this).
MAX_AHEAD = 8 * 2**20
#: Tries after the first for a dropped connection, a timeout or a 429/5xx; the first pause.
RETRIES = 3
BACKOFF = 0.25
#: The most one remote inspection fetches (headers only: far above any real header).
FETCH_BUDGET = 512 * 2**20
#: The most any one region (a header, a central directory, a pickle) may take.
MAX_REGION = 256 * 2**20
TIMEOUT = 30.0
_SAFETENSORS_MAX_HEADER = 100_000_000
#: Bytes fetched per request when downloading a whole file (the most held in memory at once).
CHUNK = 16 * 2**20
#: Facts key of an inventory read from a URL (the findings' fixes name the URL).
URL_FACT = "remote_url"


#: ``ORG/REPO[@REVISION]``: how the Hub names a repository (``estimate`` reads it too).
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")


def hub_url(text: str) -> str | None:
    """``hf://ORG/REPO`` for a plain ``ORG/REPO[@REVISION]`` that names nothing on this
    disk; else None. A local file or folder of that name wins, and so does a local folder
    ``ORG``: ``run1/model.ckpt`` is a TensorFlow checkpoint's prefix (its files are
    ``model.ckpt.index`` and ``model.ckpt.data-*``), and a typo in a local path must say the
    path is not there, not send the name to the Hub."""
    if ("://" in text or not _HUB_NAME.fullmatch(text) or os.path.lexists(text)
            or os.path.isdir(text.split("/", 1)[0])):
        return None
    return "hf://" + text


def is_remote(path: str | os.PathLike[str]) -> bool:
    """True for ``http(s)://``, ``hf://`` and other ``scheme://`` paths (not ``file://``)."""
    text = os.fspath(path)
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    return bool(scheme) and scheme != "file" and scheme.isalnum()


_STATS_LOCK = threading.Lock()


class RemoteError(InputError):
    """A remote file that cannot be inspected (one line, exit 2)."""


class RemoteNotFound(RemoteError):
    """A remote file that is not there (HTTP 404, or no such object in an fsspec store): a
    file looked for beside a checkpoint (a TF1 ``.meta``) may be absent."""


#: Redirects followed for one request (the Hub sends weights to its CDN: one).
_MAX_REDIRECTS = 10


class Reply:
    """One HTTP answer: its status, reason and headers, its body read on demand;
    :meth:`release` gives its connection back when the body was read whole, else closes
    it (an answer not read, such as a whole file sent for a range, is hung up on)."""

    def __init__(self, status: int, reason: str, headers: Any, body: Any,
                 release: Callable[[], None], url: str = "") -> None:
        self.status, self.reason, self.headers = status, reason, headers
        self._body = body
        self.release = release
        #: The URL that answered (after redirects).
        self.url = url

    def read(self, n: int) -> bytes:
        """At most ``n`` bytes of the body."""
        return bytes(self._body.read(n))


def _close_all(idle: dict[tuple[str, str], list[http.client.HTTPConnection]],
               lock: threading.Lock) -> None:
    with lock:
        conns = [c for group in idle.values() for c in group]
        idle.clear()
    for conn in conns:
        conn.close()


class Connections:
    """Keep-alive HTTP(S) connections shared by the threads of one remote inspection.

    A request takes an idle connection to its host or opens one, and gives it back once its
    answer has been read whole: a repository's hundred header reads cost a few connections
    (a TCP and a TLS handshake each, round trips a header read does not need to pay again).
    Redirects are followed, ``Authorization`` not sent to another host (the Hub sends weights
    to its CDN). With a proxy set in the environment requests go through urllib, which
    honours it, one connection each."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, str], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        weakref.finalize(self, _close_all, self._idle, self._lock)

    def close(self) -> None:
        """Close the idle connections (those in use close when their answer is done)."""
        _close_all(self._idle, self._lock)

    def open(self, url: str, headers: dict[str, str]) -> Reply:
        """GET ``url`` with ``headers``: the final answer, redirects followed. A refused
        connection or an unknown host is ``urllib.error.URLError`` (as urllib raises it);
        a dropped connection, a timeout, a malformed answer the ``OSError`` or
        ``http.client.HTTPException`` the socket gives."""
        headers = dict(headers)
        for _hop in range(_MAX_REDIRECTS + 1):
            parts = urllib.parse.urlsplit(url)
            scheme = parts.scheme.lower()
            if scheme not in ("http", "https"):
                raise urllib.error.URLError(f"a redirect to {scheme}://, not HTTP")
            if _proxied(scheme, parts.hostname or ""):
                return _urllib_reply(url, headers)
            key = (scheme, parts.netloc)
            target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
            resp, conn = self._send(key, target, headers)
            location = resp.getheader("Location")
            if resp.status in (301, 302, 303, 307, 308) and location:
                resp.read(64 * 1024)
                self._give(key, conn, resp)
                nxt = urllib.parse.urljoin(url, location)
                if urllib.parse.urlsplit(nxt).netloc != parts.netloc:
                    headers = {k: v for k, v in headers.items()
                               if k.lower() != "authorization"}
                url = nxt
                continue
            return Reply(resp.status, resp.reason, resp.headers, resp,
                         functools.partial(self._give, key, conn, resp), url)
        raise urllib.error.URLError(f"more than {_MAX_REDIRECTS} redirects")

    def _send(self, key: tuple[str, str], target: str, headers: dict[str, str]
              ) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection]:
        with self._lock:
            idle = self._idle.get(key)
            conn = idle.pop() if idle else None
        if conn is not None:
            try:
                conn.request("GET", target, headers=headers)
                return conn.getresponse(), conn
            except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine):
                conn.close()  # the server closed it while idle: once more, on a new one
        conn = self._connect(key)
        try:
            conn.request("GET", target, headers=headers)
            return conn.getresponse(), conn
        except BaseException:
            conn.close()
            raise

    def _connect(self, key: tuple[str, str]) -> http.client.HTTPConnection:
        scheme, netloc = key
        conn: http.client.HTTPConnection
        if scheme == "https":
            import ssl

            conn = http.client.HTTPSConnection(netloc, timeout=TIMEOUT,
                                               context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(netloc, timeout=TIMEOUT)
        try:
            conn.connect()
        except OSError as exc:
            conn.close()
            raise urllib.error.URLError(exc) from None
        return conn

    def _give(self, key: tuple[str, str], conn: http.client.HTTPConnection,
              resp: http.client.HTTPResponse) -> None:
        if resp.isclosed() and not resp.will_close:
            with self._lock:
                self._idle.setdefault(key, []).append(conn)
        else:
            conn.close()


def _host(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc.lower()


def _proxied(scheme: str, host: str) -> bool:
    """Whether the environment sends requests for ``host`` through a proxy."""
    return scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(host)


def _urllib_reply(url: str, headers: dict[str, str]) -> Reply:
    """``url`` fetched by urllib (through the environment's proxy)."""
    req = urllib.request.Request(url, headers=headers)
    try:
        resp = urllib.request.urlopen(req, timeout=TIMEOUT)
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, str(exc.reason), exc.headers, exc, exc.close, url)
    return Reply(resp.status, resp.reason, resp.headers, resp, resp.close, resp.geturl())


@dataclass
class Origin:
    """The remote file a sparse local file mirrors: its URL, the headers its requests carry,
    its size, and the ``(start, stop)`` ranges of it fetched (and so in the mirror)."""

    url: str
    headers: dict[str, str]
    size: int
    fetched: list[tuple[int, int]] = field(default_factory=list)
    #: Where its reads were redirected (the Hub's CDN): later reads go there directly.
    location: str | None = None

    def source(self, stats: Stats) -> RangeSource:
        """A :class:`RangeSource` of the file that makes no request until a read."""
        src = RangeSource(self.url, stats, self.headers, size=self.size)
        src._location = self.location
        return src


@dataclass
class Stats:
    """What reading a remote checkpoint cost."""

    url: str
    size: int = 0
    fetched: int = 0
    requests: int = 0
    budget: int = FETCH_BUDGET
    #: Files of a repository that the report's reader did not read (name, bytes): listed.
    others: list[tuple[str, int]] = field(default_factory=list)
    #: Where each mirrored or sized file came from, by its real local path; the duplicate
    #: search fetches its samples there.
    origins: dict[str, Origin] = field(default_factory=dict, repr=False, compare=False)
    #: What the duplicate search by samples compared and fetched (None: it did not run).
    duplicates: Any = field(default=None, repr=False, compare=False)
    #: The keep-alive connections the inspection's requests share.
    connections: Connections = field(default_factory=lambda: Connections(), repr=False,
                                     compare=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"url": self.url, "bytes": self.size, "fetched_bytes": self.fetched,
                "requests": self.requests,
                "other_files": [{"path": n, "bytes": b} for n, b in self.others],
                "duplicates": None if self.duplicates is None else self.duplicates.to_dict()}


class RangeSource:
    """Random access to a remote file through range requests, with a block cache.

    Reads are rounded out to :data:`BLOCK`-byte blocks and each run of missing blocks is
    fetched in one request; a read that continues the last fetch (a reader walking a header
    forward) fetches ahead, twice as far each time up to :data:`MAX_AHEAD`, so a header read
    in thousands of small pieces costs a few requests. The first request (which also learns
    the file's size) fetches the first :data:`FIRST` bytes. ``sink(offset, data)``, when set,
    sees every byte fetched (the sparse mirror writes it at its offset). A dropped connection,
    a timeout or a 429/5xx is retried :data:`RETRIES` times with a doubling pause; a reply
    whose ``Content-Range`` is not the range asked for, or a 200 with the whole file, stops
    the read (one line), having read none of its body. Given the file's ``size`` (known
    already), it makes no request until a read.
    """

    def __init__(self, url: str, stats: Stats | None = None,
                 headers: dict[str, str] | None = None,
                 sink: Callable[[int, bytes], None] | None = None, first: int = FIRST,
                 size: int | None = None) -> None:
        self.url = url
        self.first = first
        #: Files beside this one that its reader only sizes (found by the walker).
        self.siblings: list[str] = []
        #: Opens a file beside this one whose reader reads parts of it (set by :func:`mirror`).
        self.beside: Beside | None = None
        self.stats = stats or Stats(url)
        self.headers = dict(headers or {})
        self.sink = sink
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._fs: Any = None
        self._lock = _STATS_LOCK  # one lock: sources of one inspection share their Stats
        self._next = -1  # the block after the last one fetched (sequential read-ahead)
        self._location: str | None = None  # the URL a redirect led to
        self._ahead = 1
        self.size = -1
        if size is not None:
            scheme = url.split("://", 1)[0].lower()
            if scheme not in ("http", "https"):
                self._fs, self._fs_path = _fsspec_open(url, scheme)
            self.size = size
            self._next = 0  # nothing fetched: a read from the start reads ahead
            return
        self.size = self._open()
        self.stats.size += self.size

    # -- transport ---------------------------------------------------------------------------
    def _open(self) -> int:
        scheme = self.url.split("://", 1)[0].lower()
        if scheme in ("http", "https"):
            data, total = self._http(0, self.first)
            self._keep(0, data, total)
            self._next = len(data) // BLOCK
            return total
        self._fs, self._fs_path = _fsspec_open(self.url, scheme)
        with self._lock:
            self.stats.requests += 1  # the size: a HEAD or a listing on a real store
        try:
            total = int(self._fs.size(self._fs_path))
        except Exception as exc:  # any filesystem's own errors: one line
            raise _fsspec_error(self.url, exc) from None
        self.size = total
        if self.first > 1:  # first=1 asks for the size (HTTP learns it from a 1-byte range)
            data = self.fetch(0, min(self.first, total))
            self._keep(0, data, total)
            self._next = len(data) // BLOCK
        else:
            self._next = 0
        return total

    def _keep(self, start: int, data: bytes, total: int) -> None:
        """Cache the whole blocks of ``data`` fetched at ``start`` (block-aligned)."""
        first = start // BLOCK
        for k in range(0, len(data), BLOCK):
            piece = data[k:k + BLOCK]
            if len(piece) == BLOCK or start + k + len(piece) == total:
                self._cache[first + k // BLOCK] = piece

    def _http(self, start: int, stop: int) -> tuple[bytes, int]:
        """Bytes ``[start, stop)`` (clipped to the file) and the file's total size, in one
        range request, retried on a dropped connection, a timeout or a 429/5xx."""
        pause = BACKOFF
        for attempt in range(RETRIES + 1):
            try:
                return self._http_once(start, stop)
            except _Retry as exc:
                if attempt == RETRIES:
                    raise RemoteError(f"{printable(self.url)}: {exc} (tried {RETRIES + 1} "
                                      "times)") from None
                time.sleep(pause)
                pause *= 2
        raise AssertionError("unreachable")

    def _http_once(self, start: int, stop: int) -> tuple[bytes, int]:
        headers = {**self.headers, "Range": f"bytes={start}-{stop - 1}",
                   "User-Agent": f"modelsize/{__version__}", "Accept-Encoding": "identity"}
        # Where the first answer came from (the Hub's CDN): later reads go there directly,
        # without the token when it is another host.
        target = self._location or self.url
        if target != self.url and _host(target) != _host(self.url):
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        try:
            reply = self.stats.connections.open(target, headers)
            with self._lock:
                self.stats.requests += 1
            try:
                if reply.status >= 400 and target != self.url:
                    self._location = None  # an expired CDN link: ask the first URL again
                    raise _Retry(f"HTTP {reply.status} {reply.reason} from {_host(target)}")
                if reply.url and reply.url != self.url:
                    self._location = reply.url
                if reply.status >= 400:
                    code = reply.status
                    if code == 416 and start == 0:
                        return b"", 0  # an empty file
                    if code in (401, 403) and self.url.startswith(hf_endpoint() + "/"):
                        raise RemoteError(token_needed(self.url, code))
                    if code == 429 or code >= 500:
                        raise _Retry(f"HTTP {code} {reply.reason}")
                    raise (RemoteNotFound if code == 404 else RemoteError)(
                        f"{printable(self.url)}: HTTP {code} {reply.reason}")
                if reply.status != 206:
                    raise RemoteError(
                        f"{printable(self.url)}: the server ignores range requests (HTTP "
                        f"{reply.status} instead of 206 for bytes {start}-{stop - 1}; none of "
                        "its body was read), so inspecting it would mean downloading all of "
                        "it: download it, then run modelsize on the file")
                content_range = reply.headers.get("Content-Range", "")
                total = self._check_range(content_range, start, stop)
                data = reply.read(min(stop, total) - start + 1)
            finally:
                reply.release()
        except TimeoutError as exc:
            raise _Retry(f"no answer within {TIMEOUT:g} s ({exc})") from None
        except (ConnectionError, http.client.HTTPException) as exc:
            raise _Retry(f"connection dropped ({type(exc).__name__})") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise _Retry(f"no answer within {TIMEOUT:g} s") from None
            if isinstance(exc.reason, ConnectionResetError):
                raise _Retry("connection dropped") from None
            raise RemoteError(f"{printable(self.url)}: cannot fetch: "
                              f"{printable(str(exc.reason))}") from None
        except (OSError, ValueError) as exc:
            raise RemoteError(f"{printable(self.url)}: cannot fetch: {printable(str(exc))}"
                              ) from None
        want = min(stop, total) - start
        if len(data) != want:
            if len(data) < want:
                raise _Retry(f"the server sent {len(data)} of the {want} bytes of range "
                             f"{start}-{stop - 1}")
            raise RemoteError(f"{printable(self.url)}: the server sent more than the "
                              f"{want} bytes of range {start}-{stop - 1}")
        self._arrived(start, data)
        return data, total

    def _arrived(self, start: int, data: bytes, requests: int = 0) -> None:
        """``data``, read at ``start`` in ``requests`` more requests, counted against the
        inspection's budget (over it: one line) and given to the sink."""
        with self._lock:
            self.stats.requests += requests
            self.stats.fetched += len(data)
            over = self.stats.fetched > self.stats.budget
        if over:
            raise RemoteError(f"{printable(self.url)}: stopped after fetching "
                              f"{self.stats.fetched:,} bytes, above the "
                              f"{self.stats.budget:,}-byte budget of a remote inspection")
        if self.sink is not None and data:
            self.sink(start, data)

    def _check_range(self, content_range: str, start: int, stop: int) -> int:
        """The total size a 206's ``Content-Range`` announces, checked against the request
        and the size seen first; a lie is one line."""
        m = re.fullmatch(r"\s*bytes\s+(\d+)-(\d+)/(\d+)\s*", content_range)
        if m is None:
            raise RemoteError(f"{printable(self.url)}: the server's range reply has no "
                              f"usable Content-Range ({printable(content_range, 80)!r})")
        first, last, total = (int(g) for g in m.groups())
        if (first != start or last != min(stop, total) - 1 or last < first
                or (self.size >= 0 and total != self.size)):
            raise RemoteError(
                f"{printable(self.url)}: the server's Content-Range "
                f"{printable(content_range, 80)!r} is not the range asked for (bytes "
                f"{start}-{stop - 1} of {self.size if self.size >= 0 else 'a'}-byte file): "
                "its answers cannot be trusted")
        return total

    def fetch(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` in one request, past the cache (scattered small reads)."""
        if self._fs is None:
            return self._http(start, stop)[0]
        stop = min(stop, self.size)
        if start >= stop:
            return b""
        try:  # one ranged read (s3fs, gcsfs: a GET with Range)
            data = bytes(self._fs.cat_file(self._fs_path, start=start, end=stop))
        except Exception as exc:  # any filesystem's own errors: one line
            raise _fsspec_error(self.url, exc) from None
        if len(data) != stop - start:
            raise RemoteError(f"{printable(self.url)}: asked for bytes {start}-{stop - 1} and "
                              f"got {len(data)} bytes (the file changed, or its store lies)")
        self._arrived(start, data, requests=1)
        return data

    # -- reads -------------------------------------------------------------------------------
    def cached(self, start: int, stop: int) -> bool:
        """Whether bytes ``[start, stop)`` are all in the block cache (fetched already)."""
        with self._lock:
            return all(b in self._cache for b in range(start // BLOCK, (stop - 1) // BLOCK + 1))

    def cached_from(self, start: int, limit: int) -> bytes:
        """The bytes from ``start`` that the block cache holds without a break, at most
        ``limit`` of them (a parse walks them without a ``read`` per field)."""
        out: list[bytes] = []
        b = start // BLOCK
        last = (start + limit - 1) // BLOCK
        with self._lock:
            while b <= last and b in self._cache:
                out.append(self._cache[b])
                b += 1
        data = b"".join(out)[start % BLOCK:]
        return data[:limit]

    def _has_any(self, first: int, stop: int) -> bool:
        with self._lock:
            return any(b in self._cache for b in range(first, stop))

    def read(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` (clipped to the file), from the cache or fetched."""
        stop = min(stop, self.size)
        if start >= stop:
            return b""
        if stop - start > MAX_REGION:
            raise RemoteError(f"{printable(self.url)}: a header region of {stop - start} bytes "
                              f"is above the {MAX_REGION}-byte limit")
        first, last = start // BLOCK, (stop - 1) // BLOCK
        with self._lock:
            missing = [b for b in range(first, last + 1) if b not in self._cache]
        # fetch each run of missing blocks in one request
        n_blocks = -(-self.size // BLOCK)
        i = 0
        while i < len(missing):
            j = i
            while j + 1 < len(missing) and missing[j + 1] == missing[j] + 1:
                j += 1
            lo_b, hi_b = missing[i], missing[j] + 1
            if (self._next < lo_b <= self._next + self._ahead
                    and not self._has_any(self._next, lo_b)):
                lo_b = self._next  # a skip shorter than the read-ahead: read through it
            if lo_b == self._next:  # reading on from the last fetch: read ahead
                self._ahead = min(self._ahead * 2, MAX_AHEAD // BLOCK)
                hi_b = max(hi_b, lo_b + self._ahead)
                while hi_b > missing[j] + 1 and any(
                        b in self._cache for b in range(missing[j] + 1, hi_b)):
                    hi_b -= 1
            else:
                self._ahead = 1
            hi_b = min(hi_b, n_blocks)
            lo, hi = lo_b * BLOCK, min(hi_b * BLOCK, self.size)
            data = self.fetch(lo, hi)
            with self._lock:
                for k, b in enumerate(range(lo_b, hi_b)):
                    self._cache[b] = data[k * BLOCK:(k + 1) * BLOCK]
                self._next = hi_b
            i = j + 1
        with self._lock:
            out = b"".join(self._cache[b] for b in range(first, last + 1))
            for b in range(first, last + 1):
                self._cache.move_to_end(b)
            while len(self._cache) > CACHE_BLOCKS:
                self._cache.popitem(last=False)
        return out[start - first * BLOCK: stop - first * BLOCK]


def _fsspec_open(url: str, scheme: str) -> tuple[Any, str]:
    """fsspec's filesystem for ``url`` and the path in it; a missing fsspec, or a missing
    filesystem package (gcsfs for ``gs://``, s3fs for ``s3://``), is one line naming what to
    install."""
    try:
        import fsspec
    except ImportError as exc:
        raise MissingDependencyError("fsspec", f"reading {scheme}:// paths",
                                     extra="remote") from exc
    from fsspec.registry import known_implementations

    known = known_implementations.get(scheme)
    try:
        return fsspec.core.url_to_fs(url)  # type: ignore[no-any-return]
    except ImportError as exc:
        # the package fsspec's registry names for the protocol ("gcsfs.GCSFileSystem")
        package = (str((known or {}).get("class", "")).split(".", 1)[0]
                   or f"a {scheme}:// filesystem")
        raise MissingDependencyError(package, f"reading {scheme}:// paths") from exc
    except ValueError as exc:
        if known is None:
            raise RemoteError(f"{printable(url)}: {scheme}:// is not a protocol modelsize "
                              "reads (http://, https://, hf://, or an fsspec protocol such as "
                              "s3:// or gs://)") from None
        raise _fsspec_error(url, exc) from None
    except Exception as exc:  # any filesystem's own errors: one line
        raise _fsspec_error(url, exc) from None


def _fsspec_error(url: str, exc: BaseException) -> RemoteError:
    """One line for what an fsspec filesystem raised (no such file, no credentials...)."""
    if isinstance(exc, FileNotFoundError):
        return RemoteNotFound(f"{printable(url)}: no such file")
    if isinstance(exc, PermissionError):
        return RemoteError(f"{printable(url)}: access denied ({printable(str(exc), 200)})")
    return RemoteError(f"{printable(url)}: cannot read: {type(exc).__name__}: "
                       f"{printable(str(exc), 200)}")


class _Retry(Exception):
    """A failure worth another try (a dropped connection, a timeout, a 5xx)."""


def _total(content_range: str) -> int | None:
    # "bytes 0-0/12345"
    if "/" not in content_range:
        return None
    total = content_range.rsplit("/", 1)[1].strip()
    return int(total) if total.isdigit() else None


# -- what each format needs -------------------------------------------------------------------

def _regions(src: RangeSource, name: str = "") -> Iterator[tuple[int, bytes]]:
    """The ``(offset, bytes)`` regions the reader of this file will read (every byte a walker
    of :mod:`modelsize.remote_regions` reads also reaches the mirror through the source's
    sink). The names of the files beside it that the reader only sizes are appended to
    ``src.siblings``."""
    from modelsize import remote_regions as rr

    head = src.read(0, min(src.size, 4096))
    yield 0, head
    lower = name.lower()
    if name == ".metadata" and head[:1] == b"\x80":  # torch.distributed.checkpoint
        src.siblings.extend(rr.walk_dcp(src))
    elif lower.endswith(".meta") and not head.startswith(b"\x80"):  # a TF1 MetaGraphDef
        rr.walk_tf_meta(src)
    elif head[:4] == b"PK\x03\x04":
        yield from _zip_regions(src)
    elif head[:6] == b"\x93NUMPY":
        yield 0, src.read(0, _npy_header_end(head))
    elif len(head) >= 9 and head[8:9] == b"{":
        (n,) = struct.unpack_from("<Q", head, 0)
        if n > _SAFETENSORS_MAX_HEADER:
            raise RemoteError(f"{printable(src.url)}: safetensors header length {n} is above "
                              "the format's limit")
        yield 0, src.read(0, 8 + n)
    elif head[:4] == rr.GGUF_MAGIC:
        rr.walk_gguf(src)
    elif head[:8] == rr.HDF5_MAGIC:
        rr.walk_hdf5(src)
    elif head[4:8] == b"TFL3":
        rr.walk_tflite(src)
    elif head.startswith(rr.LEGACY_TORCH_MAGIC):
        rr.walk_legacy_torch(src)
    elif lower.endswith(".onnx"):
        src.siblings.extend(rr.walk_onnx(src, name))
    elif lower.endswith(".index"):
        src.siblings.extend(rr.walk_tf_index(src, name))
    elif head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:
        rr.walk_pickles(src)
    else:
        raise RemoteError(
            f"{printable(src.url)}: remote inspection reads safetensors, GGUF, ONNX, PyTorch "
            "(zip and legacy), pickle, NumPy, Keras/HDF5, TFLite files, TensorFlow "
            "checkpoints (their .index), SavedModels (their saved_model.pb) and DCP "
            "checkpoints (their .metadata) by their headers; this one is none of them: "
            "download it and inspect the file")


def _npy_header_end(head: bytes) -> int:
    """Where a ``.npy`` header (magic, version, length, dict) ends."""
    if head[6] == 1:
        return 10 + int(struct.unpack_from("<H", head, 8)[0])
    return 12 + int(struct.unpack_from("<I", head, 8)[0])


_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"


def _zip_regions(src: RangeSource) -> Iterator[tuple[int, bytes]]:
    size = src.size
    # the end record (22 bytes, and a comment of up to 64 KiB): its last block first
    tail_start = max(0, size - BLOCK)
    tail = src.read(tail_start, size)
    at = tail.rfind(_EOCD)
    if at < 0 and tail_start:
        tail_start = max(0, size - (65536 + 22 + 20))
        tail = src.read(tail_start, size)
        at = tail.rfind(_EOCD)
    if at < 0:
        raise RemoteError(f"{printable(src.url)}: a zip file without its end record")
    yield tail_start, tail
    cd_size, cd_offset = struct.unpack_from("<II", tail, at + 12)
    loc = at - 20
    if loc >= 0 and tail[loc:loc + 4] == _EOCD64_LOCATOR:
        (eocd64,) = struct.unpack_from("<Q", tail, loc + 8)
        rec = src.read(eocd64, eocd64 + 56)
        yield eocd64, rec
        cd_size, cd_offset = struct.unpack_from("<QQ", rec, 40)
    cd = src.read(cd_offset, cd_offset + cd_size)
    yield cd_offset, cd
    pos = 0
    members: list[tuple[str, int, int]] = []
    stored: set[str] = set()
    while pos + 46 <= len(cd) and cd[pos:pos + 4] == b"PK\x01\x02":
        (method,) = struct.unpack_from("<H", cd, pos + 10)
        csize, usize = struct.unpack_from("<II", cd, pos + 20)
        n_name, n_extra, n_comment = struct.unpack_from("<HHH", cd, pos + 28)
        (offset,) = struct.unpack_from("<I", cd, pos + 42)
        name = cd[pos + 46:pos + 46 + n_name].decode("utf-8", "replace")
        extra = cd[pos + 46 + n_name:pos + 46 + n_name + n_extra]
        if 0xFFFFFFFF in (csize, usize, offset):
            csize, offset = _zip64(extra, usize, csize, offset)
        members.append((name, offset, csize))
        if method == 0:
            stored.add(name)
        pos += 46 + n_name + n_extra + n_comment
    # Local headers: name and extra field (PyTorch pads data to 64 bytes there) as in the
    # central directory plus slack; fetched exactly, a few at a time (latency, not bytes).
    slack = 128
    wanted = [(name, offset, csize, 30 + len(name.encode()) + slack)
              for name, offset, csize in members]
    heads = _fetch_exact(src, [(w[1], min(w[1] + w[3], src.size)) for w in wanted])
    for (name, offset, csize, _n), header in zip(wanted, heads, strict=True):
        if header[:4] != b"PK\x03\x04" or len(header) < 30:
            yield offset, header
            continue  # the reader reports the broken member
        n_name, n_extra = struct.unpack_from("<HH", header, 26)
        data_at = offset + 30 + n_name + n_extra
        if data_at - offset > len(header):
            header = src.fetch(offset, data_at)
        yield offset, header[:data_at - offset]
        if _is_payload(name):
            continue
        if name in stored and name.endswith(".h5"):  # Keras weights: their HDF5 metadata
            from modelsize.remote_regions import walk_hdf5

            walk_hdf5(src, data_at, csize)
        elif name in stored and name.endswith(".npy") and csize >= 10:  # .npz: the header
            head = src.read(data_at, data_at + min(csize, 4096))
            yield data_at, src.read(data_at, data_at + min(csize, _npy_header_end(head)))
        else:
            yield data_at, src.read(data_at, data_at + csize)


def _fetch_exact(src: RangeSource, ranges: list[tuple[int, int]]) -> list[bytes]:
    """The bytes of each range ``[start, stop)``: from the block cache when fetched already,
    else ranges within :data:`~modelsize.remote_regions.NEAR` of each other fetched in one
    request (small tensors' headers; gaps of :data:`~modelsize.remote_regions.ZIP_GAPS` at
    most in all, the smallest first), a few at a time."""
    from modelsize.remote_regions import HEADER_WORKERS, NEAR, ZIP_GAPS, merge_ranges

    merged = merge_ranges((r for r in ranges if not src.cached(*r)), NEAR, ZIP_GAPS)
    with ThreadPoolExecutor(max_workers=HEADER_WORKERS) as pool:
        got = list(pool.map(lambda r: src.fetch(r[0], r[1]), merged))
    starts = [m[0] for m in merged]
    out = []
    for start, stop in ranges:
        if src.cached(start, stop):  # in the first bytes fetched, or the end's
            out.append(src.read(start, stop))
            continue
        i = bisect.bisect_right(starts, start) - 1
        out.append(got[i][start - starts[i]:stop - starts[i]])
    return out


def _zip64(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            vals = list(struct.unpack_from(f"<{n // 8}Q", extra, pos + 4))
            if usize == 0xFFFFFFFF and vals:
                vals.pop(0)
            if csize == 0xFFFFFFFF and vals:
                csize = vals.pop(0)
            if offset == 0xFFFFFFFF and vals:
                offset = vals.pop(0)
        pos += 4 + n
    return csize, offset


def _is_payload(name: str) -> bool:
    """A tensor storage of a torch zip (``archive/data/12``): its bytes are never read."""
    parts = name.split("/")
    return len(parts) >= 3 and parts[-2] == "data" and parts[-1].isdigit()


# -- sparse mirrors ---------------------------------------------------------------------------

def mirror(url: str, dest: Path, stats: Stats, headers: dict[str, str] | None = None,
           first: int = FIRST, listed: Mapping[str, int | None] | None = None,
           prefix: str = "") -> list[str]:
    """Write every byte the reader of ``url`` needs into the sparse file ``dest`` of the same
    size; return the names of the files beside it that the reader only sizes. The first
    request fetches ``first`` bytes (a multiple of :data:`BLOCK`). The files beside it whose
    reader reads parts of them (a checkpoint's object graph in its data shard, the archive
    headers of a DCP file) are mirrored through :class:`Beside`; ``listed`` (the sizes of a
    repository's files, by their paths relative to ``dest``'s folder less ``prefix``, which
    is ``dest``'s own folder there) says which exist without asking."""
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    have: list[tuple[int, int]] = []

    def sink(at: int, data: bytes) -> None:
        _pwrite(fd, data, at)
        have.append((at, at + len(data)))

    try:
        src = RangeSource(url, stats, headers, sink=sink, first=first)
        origin = Origin(url, dict(headers or {}), src.size, have)
        stats.origins[str(real_path(dest, must_exist=False))] = origin
        os.ftruncate(fd, src.size)
        src.beside = Beside(url, dest.parent, stats, headers, listed, prefix)
        for offset, data in _regions(src, dest.name):
            _pwrite(fd, data, offset)
        origin.location = src._location
    finally:
        os.close(fd)
    return src.siblings


def _pwrite(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def sized(url: str, dest: Path, stats: Stats, headers: dict[str, str] | None = None,
          size: int | None = None) -> None:
    """A sparse ``dest`` of the remote file's size, no byte of it fetched (a data file the
    reader only sizes); ``size`` when a listing gave it already (no request)."""
    if size is None:
        size = RangeSource(url, stats, headers, first=1).size
    with open(dest, "wb") as fh:
        fh.truncate(size)
    stats.origins[str(real_path(dest, must_exist=False))] = Origin(url, dict(headers or {}),
                                                                  size)


class Beside:
    """Opens the files beside a mirrored one (by their names relative to its folder) whose
    reader reads parts of them: each becomes a sparse file of its remote size, as
    :func:`sized` makes it, and a :class:`RangeSource` whose fetched bytes are written into
    it at their offsets (and recorded in its :class:`Origin`, so the duplicate search knows
    them for real bytes). A file already on this disk (the HF cache's) is read there: no
    source. ``listed`` (a repository's files and sizes, by path relative to ``folder``'s
    root; ``prefix`` is ``folder`` there) says which files exist without a request; without
    it, a file not there is a 404."""

    def __init__(self, url: str, folder: Path, stats: Stats, headers: dict[str, str] | None,
                 listed: Mapping[str, int | None] | None = None, prefix: str = "") -> None:
        self.url, self.folder, self.stats = url, folder, stats
        self.headers = dict(headers or {})
        self.listed, self.prefix = listed, prefix
        self._opened: dict[str, RangeSource | None] = {}

    def __call__(self, name: str, optional: bool = False, first: int = 1
                 ) -> RangeSource | None:
        """The source of file ``name`` beside the mirrored one; None when ``optional`` and
        the file is not there, or when it is on this disk. A file that must be there and is
        not is one line. Where its size is not listed, the request that learns it fetches
        its ``first`` bytes (a file to be read from its start: one round trip saved)."""
        if name not in self._opened:
            self._opened[name] = self._open(name, optional, first)
        return self._opened[name]

    def _open(self, name: str, optional: bool, first: int) -> RangeSource | None:
        dest = _beside(self.folder, name, self.url)
        rel = self.prefix + name
        url = beside_url(self.url, name)
        key = str(real_path(dest, must_exist=False))
        origin = self.stats.origins.get(key)
        probe: RangeSource | None = None
        if origin is None:
            if os.path.lexists(dest):
                return None  # its real bytes (a file of the local HF cache): read there
            size = None
            if self.listed is not None:
                if rel not in self.listed:
                    if optional:
                        return None
                    raise RemoteError(f"{printable(self.url)}: names {printable(name, 80)!r} "
                                      "beside it, which the repository does not hold")
                listed = self.listed[rel]
                size = listed if isinstance(listed, int) and listed >= 0 else None
            try:
                if size is None and first > 1:
                    probe = RangeSource(url, self.stats, self.headers, first=first)
                    size = probe.size
                sized(url, dest, self.stats, self.headers, size)
            except RemoteNotFound:
                if optional:
                    return None
                raise
            origin = self.stats.origins[key]
            if probe is not None:  # its first bytes: in its cache and, now, in the mirror
                head = probe.read(0, min(first, probe.size))
                with open(dest, "r+b") as fh:
                    fh.write(head)
                origin.fetched.append((0, len(head)))
                origin.location = probe._location
        have = origin.fetched

        def sink(at: int, data: bytes) -> None:
            fd = os.open(dest, os.O_WRONLY)
            try:
                _pwrite(fd, data, at)
            finally:
                os.close(fd)
            have.append((at, at + len(data)))

        src = probe if probe is not None else origin.source(self.stats)
        src.sink = sink
        folder = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
        src.beside = Beside(url, dest.parent, self.stats, self.headers, self.listed,
                            self.prefix + folder)
        return src


@dataclass
class Remote:
    """A remote checkpoint mirrored sparsely into ``local``."""

    url: str
    local: Path
    stats: Stats
    files: list[str] = field(default_factory=list)
    #: The repository's folder when ``local`` is its one model file: its other files are
    #: listed by size.
    folder: Path | None = None


@contextmanager
def mirrored(url: str) -> Iterator[Remote]:
    """Mirror the header regions of a remote checkpoint into a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="modelsize-remote-") as tmp:
        yield _fill(url, Path(tmp), mirror)


def _fill(url: str, root: Path, fetch: Any) -> Remote:
    """The remote checkpoint's files in ``root``, each written by ``fetch(url, dest,
    stats)`` (:func:`mirror` or :func:`download`), under the names it has remotely: the
    reports and the default output names follow them. The files a mirrored file's reader
    only sizes (external data, data shards) are created beside it, sparse."""
    stats = Stats(url)
    try:
        return _fill_with(url, root, fetch, stats)
    finally:
        stats.connections.close()


def _fill_with(url: str, root: Path, fetch: Any, stats: Stats) -> Remote:
    if url.lower().startswith("hf://"):
        return _hf(url, root, stats, fetch)
    name = _safe_name(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1] or "model")
    local = root / name
    urls = [url]
    if fetch is mirror and name == SAVED_MODEL:
        return Remote(url, local, stats, [url, *mirror_saved_model(url, local, stats)])
    for shard in split_gguf_rest(name):  # the first shard of a split GGUF: the others too
        urls.append(beside_url(url, shard))
        fetch(urls[-1], root / shard, stats)
    for sibling in fetch(url, local, stats) or ():
        dest = _beside(root, sibling, url)
        urls.append(beside_url(url, sibling))
        if not _is_mirrored(dest, stats):  # (the walker may have opened it: its graph)
            sized(urls[-1], dest, stats)
    return Remote(url, local, stats, urls)


#: A SavedModel's graph: the name its folder is reached by over a plain URL.
SAVED_MODEL = "saved_model.pb"
#: Files a SavedModel folder may hold beside its graph that its reader counts by name.
_SAVED_MODEL_FILES = ("fingerprint.pb", "keras_metadata.pb")


def mirror_saved_model(url: str, local: Path, stats: Stats,
                       headers: dict[str, str] | None = None,
                       listed: Mapping[str, int | None] | None = None,
                       prefix: str = "") -> list[str]:
    """A SavedModel reached by its ``saved_model.pb`` at ``url``, mirrored as its reader
    reads the folder: the graph, ``fingerprint.pb`` and ``keras_metadata.pb`` sized (when
    there), ``variables/variables.index`` read whole (and what it needs of its data shards)
    and the shards sized. Without ``listed`` (a plain URL: no listing) each file beside it is
    asked for, and a folder's other files (``assets/``) cannot be found. Returns the URLs of
    the files found beside the graph."""
    size = None if listed is None else listed.get(prefix + SAVED_MODEL)
    sized(url, local, stats, headers, size if isinstance(size, int) and size >= 0 else None)
    beside = Beside(url, local.parent, stats, headers, listed, prefix)
    found = [name for name in _SAVED_MODEL_FILES if beside(name, optional=True) is not None]
    index = beside("variables/variables.index", optional=True, first=FIRST)
    if index is not None:
        found.append("variables/variables.index")
        for _ in _regions(index, "variables.index"):
            pass  # every byte fetched reached the mirror through its sink
        for shard in index.siblings:
            assert index.beside is not None
            index.beside(shard)
            found.append("variables/" + shard)
    return [beside_url(url, name) for name in found]


def _is_mirrored(dest: Path, stats: Stats) -> bool:
    return str(real_path(dest, must_exist=False)) in stats.origins


def beside_url(url: str, name: str) -> str:
    """The URL of the file ``name`` beside the one at ``url`` (relative to its folder). HTTP
    URLs are joined and quoted as URLs; any other scheme (``s3://``, ``gs://``: fsspec paths,
    which urljoin leaves alone and which are not quoted) by replacing the last part."""
    if url.split("://", 1)[0].lower() in ("http", "https"):
        return urllib.parse.urljoin(url, urllib.parse.quote(name))
    return url.rsplit("/", 1)[0] + "/" + name


def _beside(root: Path, name: str, url: str) -> Path:
    """``root / name`` for a file a checkpoint names beside itself, refusing a name that
    leaves the folder (the reader would refuse it too)."""
    parts = name.replace("\\", "/").split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise RemoteError(f"{printable(url)}: names a file outside its folder "
                          f"({printable(name, 80)!r})")
    dest = root.joinpath(*parts)
    dest.parent.mkdir(parents=True, exist_ok=True)
    return dest


def download(url: str, dest: Path, stats: Stats) -> None:
    """Copy the whole file at ``url`` into ``dest``, :data:`CHUNK` bytes per request, after
    checking that ``dest``'s disk has room for the size the server announced."""
    src = RangeSource(url, stats, first=1)
    check_space(dest.parent, src.size, url)
    with open(dest, "wb") as fh:
        for start in range(0, src.size, CHUNK):
            data = src.fetch(start, min(start + CHUNK, src.size))
            if not data:
                raise RemoteError(f"{printable(url)}: the server sent nothing at byte {start} "
                                  f"of {src.size}")
            fh.write(data)
        if fh.tell() != src.size:
            raise RemoteError(f"{printable(url)}: got {fh.tell()} bytes of {src.size}")


def check_space(folder: Path, nbytes: int, url: str) -> None:
    """Refuse (one line) a download of ``nbytes`` into ``folder`` that its disk cannot hold."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return  # unknown: the write itself says so
    if nbytes > free:
        raise RemoteError(f"{printable(url)}: downloading it needs {nbytes:,} bytes and "
                          f"{printable(str(folder))} has {free:,} free")


@contextmanager
def downloaded(url: str, near: str | os.PathLike[str] = ".") -> Iterator[Remote]:
    """The whole remote checkpoint, downloaded into a hidden temporary folder in ``near``
    (the output's folder: the same disk, never a RAM-backed ``/tmp``), removed on exit."""
    try:
        tmp = tempfile.mkdtemp(prefix=".modelsize-download-", dir=near)
    except OSError as exc:
        raise RemoteError(f"{printable(url)}: cannot download into "
                          f"{printable(os.fspath(near))}: {exc.strerror or exc}") from None
    try:
        yield _fill(url, Path(tmp), download)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _safe_name(name: str) -> str:
    name = urllib.parse.unquote(name)
    if name == ".metadata":  # a DCP checkpoint's: its reader finds it by that name
        return name
    keep = "".join(c if c.isalnum() or c in "._-" else "_" for c in name).lstrip(".")
    return keep[:200] or "model"


def hf_endpoint() -> str:
    """The hub's base URL (``$HF_ENDPOINT`` as huggingface_hub reads it)."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _hf(url: str, root: Path, stats: Stats, fetch: Any) -> Remote:
    if fetch is mirror:
        return _hf_repository(url, root, stats)
    rest = url[len("hf://"):].strip("/")
    parts = rest.split("/")
    if len(parts) < 2 or not all(parts[:2]):
        raise RemoteError(f"{printable(url)}: expected hf://ORG/REPO or hf://ORG/REPO/FILE")
    repo, revision = "/".join(parts[:2]), "main"
    if "@" in repo:
        repo, revision = repo.split("@", 1)
    base = f"{hf_endpoint()}/{repo}/resolve/{urllib.parse.quote(revision)}/"
    files = ["/".join(parts[2:])] if len(parts) > 2 else _hf_weight_files(url, repo, stats)
    if len(files) > 1:  # a folder named like the repo: "tiny.slim" for its output
        root = root / _safe_name(repo.split("/")[-1])
        root.mkdir()
    for f in files:
        dest = root / _safe_name(f)
        if f.endswith(".json"):
            dest.write_bytes(_get(base + f, stats, limit=MAX_REGION))
        else:
            fetch(base + urllib.parse.quote(f), dest, stats)
    local = root / _safe_name(files[0]) if len(files) == 1 else root
    return Remote(url, local, stats, [base + f for f in files])


# -- a whole Hub repository, inspected as one model ----------------------------------------------

#: Weight files of a repository, most preferred first: the files of the first kind present
#: (in the folder asked for) are read by their headers; every other file is listed by size.
_MODEL_KINDS: tuple[tuple[str, ...], ...] = (
    (".safetensors",), (".bin",), (".pt", ".pth", ".ckpt"), (".gguf",), (".onnx",),
    (".keras", ".h5"), (".tflite",), (".index",), (".pkl", ".pickle", ".joblib"),
    (".npz", ".npy"))
#: JSON files up to this size are fetched whole (configs, indexes): readers read them.
_SMALL_JSON = 1 * 2**20
#: Concurrent requests across a repository's files.
_FILE_WORKERS = 8


@dataclass(frozen=True)
class HubPath:
    """``hf://[datasets/|spaces/]ORG/REPO[@REVISION][/PATH]``."""

    kind: str  # "models", "datasets" or "spaces"
    repo: str
    revision: str
    path: str

    @classmethod
    def parse(cls, url: str) -> HubPath:
        """Split an ``hf://`` name (``ORG/REPO`` alone is a model repository)."""
        rest = url[len("hf://"):] if url.lower().startswith("hf://") else url
        parts = [p for p in rest.split("/") if p]
        kind = "models"
        if parts and parts[0] in ("datasets", "spaces", "models") and len(parts) >= 3:
            kind = parts.pop(0)
        if len(parts) < 2:
            raise RemoteError(f"{printable(url)}: expected hf://ORG/REPO[@REVISION][/PATH] "
                              "(hf://datasets/ORG/REPO for a dataset)")
        name, _, revision = parts[1].partition("@")
        return cls(kind, f"{parts[0]}/{name}", urllib.parse.unquote(revision or "main"),
                   "/".join(parts[2:]))

    def resolve_url(self, name: str) -> str:
        """The Hub's download URL of file ``name``."""
        prefix = "" if self.kind == "models" else f"{self.kind}/"
        return (f"{hf_endpoint()}/{prefix}{self.repo}/resolve/"
                f"{urllib.parse.quote(self.revision, safe='')}/{urllib.parse.quote(name)}")

    def listing_url(self) -> str:
        """The API URL listing the repository's files, with their sizes (``blobs=true``)."""
        return (f"{hf_endpoint()}/api/{self.kind}/{self.repo}/revision/"
                f"{urllib.parse.quote(self.revision, safe='')}?blobs=true")

    def cached(self, commit: str, name: str) -> Path | None:
        """The file in the local Hugging Face cache's snapshot of ``commit``, if there."""
        folder = hf_cache_dir() / f"{self.kind}--{self.repo.replace('/', '--')}"
        found = folder / "snapshots" / commit / name
        try:
            return found if commit and is_regular(found) else None
        except OSError:
            return None


def is_regular(path: Path) -> bool:
    """A regular file (a cache's symlink to its blob followed)."""
    import stat

    return stat.S_ISREG(os.stat(path).st_mode)


def _hf_repository(url: str, root: Path, stats: Stats) -> Remote:
    """The repository (or the folder or file of it ``url`` names) in ``root``: the weight
    files of the preferred kind mirrored by their headers, small JSON files whole, every
    other file sparse at its listed size; files in the local HF cache linked, not fetched."""
    hub = HubPath.parse(url)
    raw = hub_get(hub.listing_url(), stats, limit=64 * 2**20)
    try:
        doc = json.loads(raw)
        listed = {s["rfilename"]: s.get("size") for s in doc.get("siblings", [])
                  if isinstance(s.get("rfilename"), str)}
        commit = str(doc.get("sha") or "")
    except (ValueError, TypeError, KeyError, AttributeError):
        raise RemoteError(f"{printable(url)}: the Hub's listing is not JSON with siblings"
                          ) from None
    headers = hub_headers()
    if hub.path and hub.path in listed:  # one file
        name = hub.path.rsplit("/", 1)[-1]
        local = root / _safe_name(name)
        cached = hub.cached(commit, hub.path)
        remote_url = hub.resolve_url(hub.path)
        if cached is not None:
            local.symlink_to(cached)
            return Remote(url, local, stats, [remote_url])
        folder = hub.path.rsplit("/", 1)[0] + "/" if "/" in hub.path else ""
        urls = [remote_url]
        for shard in split_gguf_rest(name):  # the first shard of a split GGUF: the others
            urls.append(hub.resolve_url(folder + shard))
            mirror(urls[-1], root / _safe_name(shard), stats, headers)
        if name == SAVED_MODEL:
            urls += mirror_saved_model(remote_url, local, stats, headers, listed, folder)
            return Remote(url, local, stats, urls)
        for sibling in mirror(remote_url, local, stats, headers, listed=listed, prefix=folder):
            dest = _beside(root, sibling, url)
            urls.append(hub.resolve_url(folder + sibling))
            if not _is_mirrored(dest, stats):
                sized(urls[-1], dest, stats, headers, listed.get(folder + sibling))
        return Remote(url, local, stats, urls)
    prefix = hub.path.strip("/") + "/" if hub.path else ""
    names = sorted(n for n in listed if n.startswith(prefix))
    if not names:
        raise RemoteError(f"{printable(url)}: no file under {printable(hub.path)!r} in "
                          f"{hub.repo}@{hub.revision}")
    top = [n for n in names if "/" not in n[len(prefix):]]
    weights: list[str] = []
    for suffixes in _MODEL_KINDS:
        weights = [n for n in top if n.lower().endswith(suffixes)
                   and (suffixes != (".bin",) or "model" in n.rsplit("/", 1)[-1])]
        if weights:
            break
    if len(weights) > 1 and weights[0].lower().endswith(".gguf"):
        models = gguf_models(weights)
        if len(models) > 1:  # quantizations of one model, each a model of its own
            shown = ", ".join(printable(m[len(prefix):], 60) for m in models[:4])
            raise RemoteError(
                f"{printable(url)}: holds {len(models)} GGUF models ({shown}"
                f"{', ...' if len(models) > 4 else ''}): name one: "
                f"{_hf_name(hub, models[0])}")
    local = root / _safe_name(hub.path.rsplit("/", 1)[-1] if hub.path
                              else hub.repo.split("/")[-1])
    local.mkdir()
    whole: dict[str, bytes] = {}
    if not weights:  # a checkpoint folder: what its reader reads first
        weights = _folder_model(hub, names, prefix, listed, stats, whole)
    jobs: list[tuple[str, Path, str]] = []  # (name, destination, how)
    for name in names:
        dest = _beside(local, name[len(prefix):], url)
        cached = hub.cached(commit, name)
        if cached is not None:
            dest.symlink_to(cached)
        elif name in whole:
            dest.write_bytes(whole[name])
        elif name in weights:
            jobs.append((name, dest, "mirror"))
        elif ((name.endswith(".json") or name[len(prefix):] in _SMALL_NAMES)
              and (listed[name] or 0) <= _SMALL_JSON):
            jobs.append((name, dest, "whole"))
        else:
            jobs.append((name, dest, "sized"))

    # The safetensors index first: the names it gives each shard size the shard's first
    # request to its header (a few KiB each, where a blind first read takes 64 KiB).
    firsts: dict[str, int] = {}
    index = next((j for j in jobs if j[2] == "whole"
                  and j[0].endswith(".safetensors.index.json")), None)
    if index is not None and len(weights) > 1:
        jobs.remove(index)
        raw = hub_get(hub.resolve_url(index[0]), stats, limit=_SMALL_JSON)
        index[1].write_bytes(raw)
        folder = index[0].rsplit("/", 1)[0] + "/" if "/" in index[0] else ""
        firsts = {folder + shard: n for shard, n in header_sizes(raw).items()}

    relative = {n[len(prefix):]: listed[n] for n in names}

    def run(job: tuple[str, Path, str]) -> None:
        name, dest, how = job
        rel = name[len(prefix):]
        if how == "mirror":  # siblings: listed (and sized) already
            mirror(hub.resolve_url(name), dest, stats, headers, firsts.get(name, FIRST),
                   listed=relative, prefix=rel.rsplit("/", 1)[0] + "/" if "/" in rel else "")
        elif how == "whole":
            dest.write_bytes(hub_get(hub.resolve_url(name), stats, limit=_SMALL_JSON))
        else:
            size = listed[name]
            sized(hub.resolve_url(name), dest, stats, headers,
                  size if isinstance(size, int) and size >= 0 else None)

    with ThreadPoolExecutor(max_workers=_FILE_WORKERS) as pool:
        # the sized files first: a walker may read parts of one (a TF2 checkpoint's object
        # graph in its data shard, the archives of a DCP checkpoint's items)
        list(pool.map(run, [j for j in jobs if j[2] == "sized"]))
        list(pool.map(run, [j for j in jobs if j[2] != "sized"]))
    urls = [hub.resolve_url(n) for n in names]
    if len(weights) == 1 and not _is_model_folder(local):  # one model file, listed files
        return Remote(url, local / weights[0][len(prefix):], stats, urls, folder=local)
    return Remote(url, local, stats, urls)


#: Small files without a suffix that readers read whole: a TensorFlow checkpoint's state
#: file, the tag file of a DeepSpeed checkpoint.
_SMALL_NAMES = ("checkpoint", "latest")


def _folder_model(hub: HubPath, names: list[str], prefix: str,
                  listed: Mapping[str, int | None], stats: Stats,
                  whole: dict[str, bytes]) -> list[str]:
    """The files to mirror of a repository folder without weight files of its own kind:
    a SavedModel (``variables/variables.index``), a ``torch.distributed.checkpoint``
    (``.metadata``: its walker reads its data files' archive headers) or a DeepSpeed
    checkpoint (the states files of the tag ``latest`` names, fetched into ``whole``; of
    every tag without one); none for anything else."""
    from modelsize.formats.deepspeed import LATEST, MAX_LATEST, parse_name

    rel = {n[len(prefix):]: n for n in names}
    if SAVED_MODEL in rel:
        return [rel[n] for n in ("variables/variables.index",) if n in rel]
    if ".metadata" in rel:
        return [rel[".metadata"]]
    states = [n for r, n in rel.items() if r.count("/") == 1
              and parse_name(Path(r)) is not None]
    if LATEST in rel and (listed[rel[LATEST]] or 0) <= MAX_LATEST:
        raw = hub_get(hub.resolve_url(rel[LATEST]), stats, limit=MAX_LATEST)
        whole[rel[LATEST]] = raw
        tag = raw.decode("utf-8", "replace").strip()
        return [n for n in states if n[len(prefix):].split("/", 1)[0] == tag]
    return states


def _hf_name(hub: HubPath, name: str) -> str:
    kind = "" if hub.kind == "models" else f"{hub.kind}/"
    rev = "" if hub.revision == "main" else f"@{hub.revision}"
    return f"hf://{kind}{hub.repo}{rev}/{printable(name, 120)}"


def _is_model_folder(folder: Path) -> bool:
    """Whether a reader reads ``folder`` as one model (an index, a config, a split GGUF)."""
    from modelsize import formats
    from modelsize.errors import UnknownFormatError
    from modelsize.formats.base import Source

    try:
        formats.registry().for_source(Source.open(folder))
    except UnknownFormatError:
        return False
    return True


def split_gguf_rest(name: str) -> list[str]:
    """The names of the other shards of the split GGUF whose first shard is ``name``."""
    from modelsize.formats.gguf import shard_names

    return [p.name for p in shard_names(Path(name))[1:]]


def gguf_models(names: list[str]) -> list[str]:
    """The GGUF models among ``names``: each file, a split model once (by its first shard)
    when every shard is among the names."""
    listed = set(names)
    shards: set[str] = set()
    for name in names:
        folder = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
        rest = [folder + r for r in split_gguf_rest(name.rsplit("/", 1)[-1])]
        if rest and all(r in listed for r in rest):
            shards.update(rest)
    return sorted(n for n in names if n not in shards)


#: Bytes a safetensors header spends on one tensor besides its name (dtype, shape, offsets:
#: ``"x":{"dtype":"BF16","shape":[128256,8192],"data_offsets":[0,2101346304]},`` is 78),
#: with room for spaces; and on its ``__metadata__``.
_HEADER_PER_TENSOR = 128
_HEADER_METADATA = 1024


def header_sizes(index: bytes) -> dict[str, int]:
    """The first request for each shard a safetensors index names: a whole number of
    :data:`BLOCK` s over the header its tensor names imply, within [BLOCK, MAX_AHEAD] (an
    index that is not one gives nothing: each shard is read as any file is)."""
    try:
        weight_map = json.loads(index)["weight_map"]
        per: dict[str, int] = {}
        for name, shard in weight_map.items():
            per[shard] = per.get(shard, 8 + _HEADER_METADATA) + len(str(name).encode()) + (
                _HEADER_PER_TENSOR)
    except (ValueError, TypeError, KeyError, AttributeError):
        return {}
    return {shard: min(MAX_AHEAD, max(BLOCK, -(-n // BLOCK) * BLOCK))
            for shard, n in per.items() if isinstance(shard, str)}


def _get(url: str, stats: Stats, limit: int, headers: dict[str, str] | None = None,
         http_error: Callable[[int], None] | None = None) -> bytes:
    """GET ``url`` whole, at most ``limit`` bytes, counted in ``stats``. ``http_error`` may
    raise its own error for an HTTP error status first (the Hub's 401/403/404)."""
    try:
        reply = stats.connections.open(url, {**(headers or {}),
                                             "User-Agent": f"modelsize/{__version__}",
                                             "Accept-Encoding": "identity"})
        try:
            if reply.status >= 400:
                if http_error is not None:
                    http_error(reply.status)
                raise RemoteError(f"{printable(url)}: HTTP {reply.status} {reply.reason}")
            data = reply.read(limit + 1)
        finally:
            reply.release()
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        raise RemoteError(f"{printable(url)}: cannot fetch: {printable(str(reason))}") from None
    with _STATS_LOCK:
        stats.requests += 1
        stats.fetched += len(data)
    if len(data) > limit:
        raise RemoteError(f"{printable(url)}: more than {limit} bytes")
    return data


def _hf_weight_files(url: str, repo: str, stats: Stats) -> list[str]:
    raw = _get(f"{hf_endpoint()}/api/models/{repo}", stats, limit=16 * 2**20)
    try:
        names = [s["rfilename"] for s in json.loads(raw).get("siblings", [])]
    except (ValueError, TypeError, KeyError, AttributeError):
        raise RemoteError(f"{printable(url)}: the hub's listing of {repo} is not JSON with "
                          "siblings") from None
    top = [n for n in names if "/" not in n]
    for pattern in (".safetensors", ".bin", ".pt", ".pth", ".gguf"):
        chosen = sorted(n for n in top if n.endswith(pattern))
        if pattern == ".bin":
            chosen = [n for n in chosen if n.startswith("pytorch_model")]
        if chosen:
            index = [n for n in top if n.endswith(pattern + ".index.json")]
            return index + chosen
    raise RemoteError(f"{printable(url)}: no weight file (*.safetensors, pytorch_model*.bin) "
                      f"at the top of {repo}; name one: hf://{repo}/FILE")


@dataclass(frozen=True)
class RemoteReport:
    """The report of a remote checkpoint, with what reading it fetched."""

    url: str
    report: Any  # modelsize.inspection.Report
    stats: Stats
    local: str  # the sparse mirror's path while it existed (replaced by the URL in output)

    def text(self, top: int = 10) -> str:
        """The text report, the URL in place of the mirror's path, and the bytes fetched."""
        from modelsize.report.text import render_inspect

        out = render_inspect(self.report, top=top).replace(self.local, self.url)
        s = self.stats
        if s.others:
            out += (f"\nOther files ({len(s.others)}, not part of the model, by size): "
                    + ", ".join(f"{printable(n, 80)} {b:,} bytes" for n, b in s.others[:20])
                    + (", ..." if len(s.others) > 20 else "") + "\n")
        return out + (f"\nRead remotely: {s.fetched:,} bytes fetched in {s.requests} requests "
                      f"for a {s.size:,}-byte checkpoint ({100 * s.fetched / max(s.size, 1):.4f}%"
                      f"); {duplicates_line(s)}.\n")

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        """The inspect JSON with ``path`` the URL and a ``remote`` object."""
        data = json.loads(json.dumps(self.report.to_dict(top=top)).replace(
            json.dumps(self.local)[1:-1], json.dumps(self.url)[1:-1]))
        data["path"] = self.url
        data["remote"] = self.stats.to_dict()
        return data


def duplicates_line(stats: Stats) -> str:
    """How the duplicate search of a remote inspection went, in one clause."""
    if stats.duplicates is None:
        return "duplicate tensors not searched (that reads tensor data)"
    return str(stats.duplicates.summary())


def inspect_remote(url: str) -> RemoteReport:
    """:func:`modelsize.inspect` for a URL: only header regions are fetched. The findings'
    fixes name the URL, and write into the current folder."""
    from modelsize.inspection import report_for

    with remote_inventory(url) as (inventory, stats, local):
        # while the mirror is there: a fix's output name depends on what the input is
        return RemoteReport(url, report_for(inventory), stats, local)


def read_remote(url: str) -> tuple[Any, Stats, str]:
    """:func:`remote_inventory`, returned once the mirror is gone."""
    with remote_inventory(url) as found:
        return found


@contextmanager
def remote_inventory(url: str) -> Iterator[tuple[Any, Stats, str]]:
    """The :class:`~modelsize.inventory.Inventory` of a URL (header regions, and duplicates
    compared by sampled ranges: :mod:`modelsize.remote_duplicates`), what reading it cost,
    and the path of its temporary mirror, which exists
    until the context ends (the inventory's paths name it: reports put the URL in its
    place). ``facts[URL_FACT]`` is the URL."""
    from modelsize import formats
    from modelsize.inventory import READ_DATA, SAMPLED_DUPLICATES
    from modelsize.remote_duplicates import SampledDuplicates

    with mirrored(url) as remote:
        stats = remote.stats
        stats.duplicates = SampledDuplicates(
            stats.origins,
            lambda origin: origin.source(stats),
            header_requests=lambda: stats.requests)
        token = READ_DATA.set(False)
        sampled = SAMPLED_DUPLICATES.set(stats.duplicates)
        try:
            inventory = formats.read(remote.local)
        finally:
            SAMPLED_DUPLICATES.reset(sampled)
            READ_DATA.reset(token)
            stats.connections.close()
        inventory.facts[URL_FACT] = url
        if remote.local.name == SAVED_MODEL and not url.lower().startswith("hf://"):
            inventory = dataclasses.replace(inventory, notes=(
                *inventory.notes, "a SavedModel over a plain URL: its folder cannot be listed, "
                "so only saved_model.pb, fingerprint.pb, keras_metadata.pb and variables/ are "
                "counted (not assets/ or other files)"))
        folder = remote.folder or (remote.local if remote.local.is_dir() else None)
        if folder is not None:
            used = {os.path.abspath(f.path) for f in inventory.files}
            remote.stats.others = sorted(
                ((p.relative_to(folder).as_posix(), p.stat().st_size)
                 for p in folder.rglob("*")
                 if p.is_file() and os.path.abspath(p) not in used),
                key=lambda item: (-item[1], item[0]))
        yield inventory, remote.stats, str(remote.local)


# -- a Hub repository as a model: config.json and the weights' headers -----------------------
#
# ``modelsize estimate hf://ORG/REPO[@REVISION]`` needs the config and, of the weights, only
# what their headers say (names, dtypes, shapes). The files are listed through the Hub's API
# at the revision, config.json and the safetensors index are fetched whole (they are small),
# and each weights file is mirrored sparsely (:func:`mirror`): its header regions at their
# offsets, holes elsewhere. A snapshot already in the Hugging Face cache is used in place.

#: Weight files a model folder holds, most preferred first (safetensors, then PyTorch bins).
_WEIGHT_PATTERNS = ((".safetensors", "model.safetensors.index.json"),
                    (".bin", "pytorch_model.bin.index.json"))


def token_needed(url: str, code: int) -> str:
    """The one line for a 401/403 from the Hub: what to do about it."""
    if os.environ.get("HF_TOKEN"):
        return (f"{printable(url)}: HTTP {code}: the Hub refuses the token in HF_TOKEN for this "
                "repository (gated or private: accept its terms, or use a token that can read "
                "it)")
    return (f"{printable(url)}: HTTP {code}: this repository needs a Hugging Face token: set "
            "HF_TOKEN (a gated or private repository)")


def hub_headers() -> dict[str, str]:
    """``Authorization`` from ``$HF_TOKEN`` when it is set (as huggingface_hub sends it)."""
    token = os.environ.get("HF_TOKEN", "").strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def hub_get(url: str, stats: Stats, limit: int = MAX_REGION) -> bytes:
    """GET ``url`` whole (a listing, config.json, an index) with the Hub's headers, counted in
    ``stats``; a 401/403 says a token is needed, in one line."""

    def refused(code: int) -> None:
        stats.requests += 1
        if code in (401, 403):
            raise RemoteError(token_needed(url, code)) from None
        if code == 404:
            raise RemoteError(f"{printable(url)}: HTTP 404: no such repository, revision or "
                              "file on the Hub (a private repository answers 404 without a "
                              "token: set HF_TOKEN)") from None

    return _get(url, stats, limit, headers=hub_headers(), http_error=refused)


@dataclass(frozen=True)
class HubRepo:
    """``ORG/REPO`` at ``revision`` (``main`` unless ``@REVISION`` is given)."""

    repo: str
    revision: str = "main"

    @classmethod
    def parse(cls, spec: str) -> HubRepo:
        """``hf://ORG/REPO[@REVISION]`` or ``ORG/REPO[@REVISION]``."""
        rest = spec[len("hf://"):] if spec.lower().startswith("hf://") else spec
        rest = rest.strip("/")
        repo, _, revision = rest.partition("@")
        parts = repo.split("/")
        if len(parts) != 2 or not all(parts):
            raise RemoteError(f"{printable(spec)}: expected hf://ORG/REPO or "
                              "hf://ORG/REPO@REVISION (a model repository, not a file in it)")
        return cls(repo, revision or "main")

    @property
    def url(self) -> str:
        """``hf://ORG/REPO@REVISION`` (the revision left out when it is main)."""
        return f"hf://{self.repo}" + (f"@{self.revision}" if self.revision != "main" else "")

    def resolve_url(self, name: str) -> str:
        """The Hub's download URL of file ``name`` at the revision."""
        return (f"{hf_endpoint()}/{self.repo}/resolve/"
                f"{urllib.parse.quote(self.revision, safe='')}/{urllib.parse.quote(name)}")

    def listing_url(self) -> str:
        """The Hub's API URL listing the repository's files at the revision."""
        return (f"{hf_endpoint()}/api/models/{self.repo}/revision/"
                f"{urllib.parse.quote(self.revision, safe='')}")


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it: ``$HF_HUB_CACHE``, else
    ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def cached_snapshot(hub: HubRepo) -> Path | None:
    """The repository's snapshot folder in the Hugging Face cache when it holds config.json
    and every weights file (the index's shards, or a weights file), else None."""
    root = hf_cache_dir() / ("models--" + hub.repo.replace("/", "--"))
    commit = hub.revision
    ref = root / "refs" / hub.revision
    if ref.is_file():
        try:
            commit = ref.read_text().strip()
        except OSError:
            return None
    folder = root / "snapshots" / commit
    if not (folder / "config.json").is_file():
        return None
    for suffix, index in _WEIGHT_PATTERNS:
        if (folder / index).is_file():
            try:
                shards = set(json.loads((folder / index).read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return None
            return folder if all((folder / s).is_file() for s in shards) else None
        if any(p.name.endswith(suffix) and p.is_file() for p in folder.iterdir()):
            return folder
    return None


def hub_model_files(hub: HubRepo, stats: Stats) -> list[str]:
    """config.json and the weights files (with their index) at the top of the repository."""
    raw = hub_get(hub.listing_url(), stats, limit=16 * 2**20)
    try:
        names = [s["rfilename"] for s in json.loads(raw).get("siblings", [])]
    except (ValueError, TypeError, KeyError, AttributeError):
        raise RemoteError(f"{hub.url}: the Hub's listing is not JSON with siblings") from None
    top = {n for n in names if isinstance(n, str) and "/" not in n}
    if "config.json" not in top:
        raise RemoteError(f"{hub.url}: the repository has no config.json at its top (a GGUF "
                          "repository: download the .gguf file and give its path)")
    for suffix, index in _WEIGHT_PATTERNS:
        weights = sorted(n for n in top if n.endswith(suffix)
                         and (suffix != ".bin" or n.startswith("pytorch_model")))
        if weights:
            return ["config.json", *([index] if index in top else []), *weights]
    raise RemoteError(f"{hub.url}: no weights file (*.safetensors, pytorch_model*.bin) at the "
                      "top of the repository")


def hub_snapshot_headers(hub: HubRepo, dest: Path, stats: Stats) -> list[str]:
    """Fill ``dest`` with the repository's config.json, its index and a sparse mirror of each
    weights file (header regions only; the index's shards only); return the file names."""
    try:
        return _snapshot_headers(hub, dest, stats)
    finally:
        stats.connections.close()


def _snapshot_headers(hub: HubRepo, dest: Path, stats: Stats) -> list[str]:
    headers = hub_headers()
    files = hub_model_files(hub, stats)
    wanted = list(files)
    index = next((f for f in files if f.endswith(".index.json")), None)
    for name in files[:2 if index else 1]:
        (dest / name).write_bytes(hub_get(hub.resolve_url(name), stats))
    if index is not None:
        try:
            shards = set(json.loads((dest / index).read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise RemoteError(f"{hub.url}: {index} is not an index with a weight_map") from None
        wanted = ["config.json", index, *sorted(s for s in shards if "/" not in s)]
    firsts = header_sizes((dest / index).read_bytes()) if index is not None else {}
    to_mirror = [n for n in wanted if n != "config.json" and not n.endswith(".index.json")]
    with ThreadPoolExecutor(max_workers=_FILE_WORKERS) as pool:
        list(pool.map(lambda name: mirror(hub.resolve_url(name), dest / name, stats, headers,
                                          firsts.get(name, FIRST)), to_mirror))
    return wanted
