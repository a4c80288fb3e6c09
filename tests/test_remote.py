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
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/main)?", path)
        if m:
            files = sorted((self.root / m.group(1)).iterdir())
            self._send(200, json.dumps({"siblings": [
                {"rfilename": p.name, "size": p.stat().st_size} for p in files]}).encode())
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
    # the whole repository: its config is listed beside the weights
    assert remote.report.file_bytes == sum(p.stat().st_size for p in repo.iterdir())
    one = inspect_remote("hf://org/tiny/model.safetensors")
    whole, alone = remote.report.inventory, one.report.inventory
    assert [t.name for t in whole.tensors] == [t.name for t in alone.tensors]
    assert whole.bytes_by_category["weights"] == alone.bytes_by_category["weights"]
    assert whole.bytes_by_category["graph"] == 2  # the config, which one file has not


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


# -- the printed fix of a remote file runs as printed (issue 18 #18) ----------------------------


@pytest.fixture()
def remote_ckpt(tmp_path: Path) -> tuple[Path, Any]:
    """``srv/ckpt.pt``: a training checkpoint (model + Adam state) to serve, and its state."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    (tmp_path / "srv").mkdir()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
               tmp_path / "srv" / "ckpt.pt")
    return tmp_path / "srv" / "ckpt.pt", model.state_dict()


def test_the_printed_fix_of_a_remote_file_runs_as_printed(
        tmp_path: Path, serve: Any, remote_ckpt: Any, capsys: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """It printed ``-o <a temp folder deleted on exit>/ckpt.slim.pt``, and slim turned the URL
    into ``http:/host/ckpt.pt`` and exited 2."""
    import shlex

    torch = pytest.importorskip("torch")
    path, state = remote_ckpt
    base, _served = serve(path.parent)
    url = f"{base}/ckpt.pt"
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["inspect", url, "--json"]) == 0
    (finding,) = json.loads(capsys.readouterr().out)["findings"]
    assert finding["action"] == f"modelsize slim {url} --drop optimizer_state -o ckpt.slim.pt"
    assert main(shlex.split(finding["action"])[1:]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{url} (pytorch, {path.stat().st_size:,} bytes) -> ckpt.slim.pt")
    assert "modelsize-download" not in out and "Verified" in out
    assert sorted(p.name for p in work.iterdir()) == ["ckpt.slim.pt"]
    slim = torch.load(work / "ckpt.slim.pt", weights_only=True)
    assert slim.keys() == state.keys()
    assert all(torch.equal(slim[k], state[k]) for k in state)
    # without -o: OUT in the current folder too; --json names the URL
    (work / "ckpt.slim.pt").unlink()
    assert main(["slim", url, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["input"] == url and data["output"] == "ckpt.slim.pt"
    assert sorted(p.name for p in work.iterdir()) == ["ckpt.slim.pt"]
    # diff URL local, and check URL
    assert main(["diff", url, "ckpt.slim.pt"]) == 0
    out = capsys.readouterr().out
    assert url in out and "modelsize-remote" not in out
    assert main(["check", url]) == 1
    (line, _summary) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"{url}: optimizer_state: ") and finding["action"] in line
    result = modelsize.check(url, forbid=["optimizer_state"])
    assert str(result.path) == url and not result.ok


def test_slim_url_downloads_in_bounded_chunks_beside_the_output(
        tmp_path: Path, serve: Any, remote_ckpt: Any, capsys: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from modelsize import remote

    path, _state = remote_ckpt
    base, served = serve(path.parent)
    monkeypatch.setattr(remote, "CHUNK", 4096)
    seen: list[Path] = []
    real = remote.download

    def spy(url: str, dest: Path, stats: Any) -> None:
        seen.append(dest)
        real(url, dest, stats)

    monkeypatch.setattr(remote, "download", spy)
    out = tmp_path / "out" / "small.pt"
    out.parent.mkdir()
    assert main(["slim", f"{base}/ckpt.pt", "-o", str(out)]) == 0
    capsys.readouterr()
    (dest,) = seen
    assert dest.parent.parent == out.parent and dest.parent.name.startswith(".modelsize-download")
    assert max(served) <= 4096  # no request asked for more than one chunk
    assert sum(served) >= path.stat().st_size
    assert sorted(p.name for p in out.parent.iterdir()) == ["small.pt"]


def test_slim_url_without_room_for_the_download_is_one_line(
        tmp_path: Path, serve: Any, remote_ckpt: Any, capsys: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    from collections import namedtuple

    path, _state = remote_ckpt
    base, _served = serve(path.parent)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(10**6, 10**6 - 1000, 1000))
    monkeypatch.chdir(tmp_path)
    assert main(["slim", f"{base}/ckpt.pt"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"needs {path.stat().st_size:,} bytes" in err and "has 1,000 free" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["srv"]


def test_slim_url_from_a_server_without_ranges_is_one_line(
        tmp_path: Path, serve: Any, remote_ckpt: Any, capsys: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    path, _state = remote_ckpt
    base, _served = serve(path.parent, ranges=False)
    monkeypatch.chdir(tmp_path)
    assert main(["slim", f"{base}/ckpt.pt"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["srv"]


def test_an_hf_repo_slims_into_a_folder_named_like_the_repo(
        tmp_path: Path, serve: Any, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    repo = tmp_path / "org" / "tiny"
    repo.mkdir(parents=True)
    save_file({"a": torch.randn(32, 16, dtype=torch.float64), "b": torch.randn(16)},
              str(repo / "model-00001-of-00001.safetensors"))
    (repo / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "model-00001-of-00001.safetensors",
                                        "b": "model-00001-of-00001.safetensors"}}))
    base, _served = serve(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", base)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["inspect", "hf://org/tiny", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    actions = [f["action"] for f in out["findings"]]
    assert actions == ["modelsize slim hf://org/tiny --cast float32 -o tiny.slim"]
    assert main(["slim", "hf://org/tiny", "--cast", "float32", "-o", "tiny.slim"]) == 0
    capsys.readouterr()
    assert (work / "tiny.slim").is_dir() and sorted(p.name for p in work.iterdir()) == [
        "tiny.slim"]


def test_the_library_says_a_url_is_one(tmp_path: Path) -> None:
    from modelsize.errors import UsageError

    with pytest.raises(UsageError, match=r"^http://host/x.pt: a URL"):
        modelsize.inspect("http://host/x.pt")
