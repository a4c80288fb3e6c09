"""Remote inspection over a real HTTP server on loopback, with and without Range support."""

from __future__ import annotations

import http.server
import json
import re
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import modelsize
from modelsize.cli import main
from modelsize.inventory import READ_DATA
from modelsize.remote import inspect_remote, is_remote


class _Handler(http.server.BaseHTTPRequestHandler):
    root: Path
    ranges = True
    served: list[int]

    def log_message(self, *args: Any) -> None:
        pass

    def _file(self) -> Path | None:
        path = self.path.split("?", 1)[0]
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)", path)
        if m:
            names = sorted(p.name for p in (self.root / m.group(1)).iterdir())
            self._send(200, json.dumps({"siblings": [{"rfilename": n} for n in names]}).encode())
            return None
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/main/(.+)", path)
        target = self.root / (f"{m.group(1)}/{m.group(2)}" if m else path.lstrip("/"))
        if not target.is_file():
            self._send(404, b"not found")
            return None
        return target

    def _send(self, code: int, body: bytes, extra: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)
        self.served.append(len(body))

    def do_GET(self) -> None:
        target = self._file()
        if target is None:
            return
        size = target.stat().st_size
        rng = self.headers.get("Range")
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", rng or "")
        if not self.ranges or not m:
            # a server without Range support sends the whole file: the client must hang up
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            with open(target, "rb") as fh:
                try:
                    while chunk := fh.read(1 << 20):
                        self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    pass
            return
        start, stop = int(m.group(1)), min(int(m.group(2)), size - 1)
        if start >= size:
            self._send(416, b"", {"Content-Range": f"bytes */{size}"})
            return
        with open(target, "rb") as fh:
            fh.seek(start)
            body = fh.read(stop - start + 1)
        self._send(206, body, {"Content-Range": f"bytes {start}-{stop}/{size}"})


@pytest.fixture()
def serve(tmp_path: Path) -> Iterator[Any]:
    servers = []

    def start(root: Path, ranges: bool = True) -> tuple[str, list[int]]:
        served: list[int] = []
        handler = type("H", (_Handler,), {"root": root, "ranges": ranges, "served": served})
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}", served

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def _sparse_safetensors(path: Path, n: int = 300, total: int = 10 * 10**9) -> None:
    """A ``total``-byte safetensors file of ``n`` float32 tensors, written sparsely."""
    per = (total // n) // 4 * 4
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for i in range(n):
        header[f"model.layers.{i // 4}.w{i % 4}"] = {
            "dtype": "F32", "shape": [per // 4], "data_offsets": [i * per, (i + 1) * per]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + n * per)


def test_is_remote() -> None:
    assert is_remote("https://x/y.safetensors") and is_remote("hf://org/repo")
    assert is_remote("s3://bucket/key")
    assert not is_remote("/tmp/x.pt") and not is_remote("file:///tmp/x.pt")
    assert not is_remote("C:/x.pt")


def test_ten_gb_safetensors_by_its_header(tmp_path: Path, serve: Any, capsys: Any) -> None:
    _sparse_safetensors(tmp_path / "big.safetensors")
    size = (tmp_path / "big.safetensors").stat().st_size
    assert size > 9.9e9
    base, served = serve(tmp_path)
    url = f"{base}/big.safetensors"
    remote = inspect_remote(url)
    # the same file read locally (its duplicate search, which reads tensor data, off: on 10 GB
    # of zeros it would read them all)
    token = READ_DATA.set(False)
    try:
        local = modelsize.inspect(tmp_path / "big.safetensors")
    finally:
        READ_DATA.reset(token)
    assert remote.report.inventory.bytes_by_category == local.inventory.bytes_by_category
    assert len(remote.report.inventory.tensors) == 300
    assert remote.stats.size == size
    assert remote.stats.fetched == sum(served) < 1_000_000
    assert main(["inspect", url, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["path"] == url and data["file_bytes"] == size
    assert data["remote"]["fetched_bytes"] < 1_000_000
    assert main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert url in out and "modelsize-remote-" not in out
    assert re.search(r"Read remotely: [\d,]+ bytes fetched", out)


def test_torch_checkpoint_by_its_zip_directory_and_pickle(tmp_path: Path, serve: Any) -> None:
    torch = pytest.importorskip("torch")
    sd = {f"layers.{i}.weight": torch.randn(64, 64) for i in range(300)}
    opt = {"state": {i: {"exp_avg": torch.zeros(64, 64)} for i in range(50)}}
    path = tmp_path / "ckpt.pt"
    torch.save({"model": sd, "optimizer": opt}, path)
    base, served = serve(tmp_path)
    remote = inspect_remote(f"{base}/ckpt.pt")
    local = modelsize.inspect(path)
    assert remote.report.inventory.bytes_by_category == local.inventory.bytes_by_category
    assert {t.name for t in remote.report.inventory.tensors} == {
        t.name for t in local.inventory.tensors}
    assert [f.kind for f in remote.report.findings] == [f.kind for f in local.findings]
    # the tensors' 5.7 MB are never fetched
    assert remote.stats.fetched == sum(served) < 1_000_000 < path.stat().st_size


def test_hf_repo_layout(tmp_path: Path, serve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "org" / "tiny"
    repo.mkdir(parents=True)
    _sparse_safetensors(repo / "model.safetensors", n=12, total=10**8)
    (repo / "config.json").write_text("{}")
    base, _served = serve(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", base)
    remote = inspect_remote("hf://org/tiny")
    assert len(remote.report.inventory.tensors) == 12
    assert remote.report.file_bytes == (repo / "model.safetensors").stat().st_size
    one = inspect_remote("hf://org/tiny/model.safetensors")
    assert one.report.inventory.bytes_by_category == remote.report.inventory.bytes_by_category


def test_a_server_without_range_support_is_one_line(tmp_path: Path, serve: Any,
                                                    capsys: Any) -> None:
    _sparse_safetensors(tmp_path / "big.safetensors", total=10**9)
    base, _served = serve(tmp_path, ranges=False)
    assert main(["inspect", f"{base}/big.safetensors"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "range requests" in err


@pytest.mark.parametrize("name", ["missing.safetensors", "notes.txt"])
def test_missing_or_unsupported_remote_files(tmp_path: Path, serve: Any, name: str,
                                             capsys: Any) -> None:
    (tmp_path / "notes.txt").write_text("hello, not a model " * 100)
    base, _ = serve(tmp_path)
    assert main(["inspect", f"{base}/{name}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("modelsize: ")


def test_nothing_listening_is_one_line(capsys: Any) -> None:
    assert main(["inspect", "http://127.0.0.1:9/x.safetensors"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
