"""A loopback server that speaks enough of the Hugging Face Hub's HTTP interface for
huggingface_hub itself (``model_info``, ``hf_hub_download``, ``get_safetensors_metadata``),
for modelsize's ``hf://`` reads and for hf-mem's way of reading a repository.

Shared by tests/test_remote_hub.py and benchmarks/remote.py. Repositories are folders
``root/ORG/REPO``; the server answers

* ``/api/models/ORG/REPO[/revision/REV]``: the model's info, ``siblings`` with sizes;
* ``/api/models/ORG/REPO/tree/REV[?recursive=true]``: the file list as hf-mem reads it;
* ``/ORG/REPO/resolve/REV/PATH``: HEAD, GET, GET with ``Range`` (206 and ``Content-Range``);
  with ``cdn`` set, the weights (the Hub's LFS files) answer 302 to
  ``http://localhost:PORT/cdn/ORG/REPO/PATH`` instead, another host name for the same server,
  as the Hub sends them to its CDN (``X-Linked-Size`` and ``X-Linked-Etag`` on the 302); the
  ``Authorization`` header each CDN request carried is appended to ``cdn_auth``.

A repository in ``gated`` answers 401 without ``Authorization: Bearer TOKEN``. ``latency``
seconds are waited before each answer, and once more when a connection opens (the TCP
handshake's round trip; a TLS handshake would add more): what a client pays per request and
per new connection on a real network. The server speaks HTTP/1.1, so a client may keep its
connections open. ``log`` holds ``(path, body bytes)`` per request; ``connections`` counts
the connections opened.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TOKEN = "hf_test_token"
#: Files the Hub stores in LFS: with ``cdn`` set, their downloads are redirected.
LFS = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".onnx", ".h5")
COMMIT = "c0ffee" + "0" * 34


class HubHandler(http.server.BaseHTTPRequestHandler):
    """The Hub's listing and download routes for the repositories under ``root``."""

    protocol_version = "HTTP/1.1"
    root: Path
    log: list[tuple[str, int]]
    gated: set[str]
    latency: float = 0.0
    cdn: bool = False
    cdn_auth: list[str | None]
    connections: list[int]

    def log_message(self, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        self.connections.append(1)
        time.sleep(self.latency)

    def _send(self, code: int, body: bytes, extra: dict[str, str] | None = None,
              head: bool = False) -> None:
        # logged before the answer goes out: a client that has its answer finds it logged
        self.log.append((self.path, 0 if head else len(body)))
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _route(self, head: bool) -> None:
        time.sleep(self.latency)
        path = self.path.split("?", 1)[0]
        listing = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        cdn = re.fullmatch(r"/cdn/([^/]+/[^/]+)/()(.+)", path)
        if cdn:
            self.cdn_auth.append(self.headers.get("Authorization"))
            resolve = cdn
        match = listing or tree or resolve
        if match is None:
            self._send(404, b"{}", head=head)
            return
        repo = match.group(1)
        if (repo in self.gated and not cdn
                and self.headers.get("Authorization") != f"Bearer {TOKEN}"):
            self._send(401, b'{"error": "Access to model is restricted"}', head=head)
            return
        folder = self.root / repo
        if listing or tree:
            files = sorted(p for p in folder.rglob("*") if p.is_file())
            if tree:
                doc: Any = [{"type": "file", "path": p.relative_to(folder).as_posix(),
                             "size": p.stat().st_size} for p in files]
            else:
                doc = {"id": repo, "modelId": repo, "sha": COMMIT, "siblings": [
                    {"rfilename": p.relative_to(folder).as_posix(), "size": p.stat().st_size}
                    for p in files]}
            self._send(200, json.dumps(doc).encode(), {"Content-Type": "application/json"},
                       head)
            return
        target = folder / match.group(3)
        if not target.is_file():
            self._send(404, b"not found", {"X-Error-Code": "EntryNotFound"}, head)
            return
        st = target.stat()
        size = st.st_size
        # a stable tag without hashing the whole file on every request
        etag = hashlib.sha256(f"{target}:{size}:{st.st_mtime_ns}".encode()).hexdigest()
        meta = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if self.cdn and not cdn and target.suffix in LFS:
            port = self.server.server_address[1]
            self._send(302, b"", {**meta, "X-Linked-Size": str(size), "X-Linked-Etag":
                                  f'"{etag}"', "Location": f"http://localhost:{port}/cdn/"
                                  f"{repo}/{match.group(3)}"}, head)
            return
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if head or not m:
            self.log.append((self.path, 0 if head else size))
            self.send_response(200)
            for k, v in meta.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            if not head:
                with open(target, "rb") as fh:
                    while chunk := fh.read(1 << 20):
                        self.wfile.write(chunk)
            return
        start = int(m.group(1))
        stop = min(int(m.group(2) or size - 1), size - 1)
        with open(target, "rb") as fh:
            fh.seek(start)
            body = fh.read(stop - start + 1)
        self._send(206, body, {**meta, "Content-Range": f"bytes {start}-{stop}/{size}"})

    def do_GET(self) -> None:
        self._route(head=False)

    def do_HEAD(self) -> None:
        self._route(head=True)


class _Server(http.server.ThreadingHTTPServer):
    request_queue_size = 128  # dozens of clients' connections at once: none refused


@contextmanager
def serve(root: Path, gated: set[str] | None = None, latency: float = 0.0,
          cdn: bool = False) -> Iterator[type[HubHandler]]:
    """Serve the repositories under ``root`` on a loopback port until the context ends; the
    handler class it yields carries ``endpoint`` (the base URL), ``log``, ``connections``
    and ``cdn_auth``."""
    handler = type("Hub", (HubHandler,), {"root": root, "log": [], "gated": set(gated or ()),
                                          "latency": latency, "cdn": cdn, "cdn_auth": [],
                                          "connections": []})
    httpd = _Server(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    handler.endpoint = f"http://127.0.0.1:{httpd.server_address[1]}"  # type: ignore[attr-defined]
    try:
        yield handler
    finally:
        httpd.shutdown()
        httpd.server_close()
