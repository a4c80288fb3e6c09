"""``modelsize inspect hf://ORG/REPO``: a whole repository as one report, over a loopback
server that speaks enough of the Hub's HTTP interface for huggingface_hub itself."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelsize.cli import main
from modelsize.remote import inspect_remote

TOKEN = "hf_test_token"
COMMIT = "c0ffee" + "0" * 34


class _Hub(http.server.BaseHTTPRequestHandler):
    """``/api/models/ORG/REPO/revision/REV`` (siblings with sizes) and
    ``/ORG/REPO/resolve/REV/PATH`` (HEAD, GET with Range) for the repos under ``root``."""

    root: Path
    log: list[tuple[str, int]]
    gated: set[str]

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, code: int, body: bytes, extra: dict[str, str] | None = None,
              head: bool = False) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)
        self.log.append((self.path, 0 if head else len(body)))

    def _route(self, head: bool) -> None:
        path = self.path.split("?", 1)[0]
        listing = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        match = listing or resolve
        if match is None:
            self._send(404, b"{}", head=head)
            return
        repo = match.group(1)
        if repo in self.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._send(401, b'{"error": "Access to model is restricted"}', head=head)
            return
        folder = self.root / repo
        if listing:
            files = sorted(p for p in folder.rglob("*") if p.is_file())
            siblings = [{"rfilename": p.relative_to(folder).as_posix(),
                         "size": p.stat().st_size} for p in files]
            self._send(200, json.dumps({"id": repo, "modelId": repo, "sha": COMMIT,
                                        "siblings": siblings}).encode(),
                       {"Content-Type": "application/json"}, head)
            return
        target = folder / resolve.group(3)  # type: ignore[union-attr]
        if not target.is_file():
            self._send(404, b"not found", {"X-Error-Code": "EntryNotFound"}, head)
            return
        size = target.stat().st_size
        etag = hashlib.sha256(target.read_bytes()).hexdigest()
        meta = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if head or not m:
            self.send_response(200)
            for k, v in meta.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            if not head:
                self.wfile.write(target.read_bytes())
            self.log.append((self.path, 0 if head else size))
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


def _shard(path: Path, names: list[str], numel: int) -> int:
    """A safetensors shard of float32 tensors, written sparsely; returns its header size."""
    header = {n: {"dtype": "F32", "shape": [numel],
                  "data_offsets": [i * numel * 4, (i + 1) * numel * 4]}
              for i, n in enumerate(names)}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + len(names) * numel * 4)
    return 8 + len(raw)


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """org/sharded: 8 shards of 64 MiB (sparse) with their index, a config, a tokenizer and a
    README; org/gated: the same files, behind a token."""
    root = tmp_path_factory.mktemp("hub")
    folder = root / "org" / "sharded"
    folder.mkdir(parents=True)
    weight_map = {}
    for s in range(8):
        shard = f"model-{s + 1:05d}-of-00008.safetensors"
        names = [f"model.layers.{s}.w{i}" for i in range(4)]
        _shard(folder / shard, names, 4 * 2**20)
        weight_map.update(dict.fromkeys(names, shard))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "tokenizer.json").write_bytes(b"{" + b" " * 3_000_000 + b"}")
    (folder / "README.md").write_text("# a model\n")
    gated = root / "org" / "gated"
    gated.mkdir()
    for p in folder.iterdir():
        (gated / p.name).symlink_to(p)
    return root


@pytest.fixture()
def hub(repos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    handler = type("H", (_Hub,), {"root": repos, "log": [], "gated": {"org/gated"}})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{httpd.server_address[1]}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield handler
    httpd.shutdown()
    httpd.server_close()


def test_huggingface_hub_itself_works_against_the_loopback_hub(hub: Any, tmp_path: Path,
                                                               repos: Path) -> None:
    hf = pytest.importorskip("huggingface_hub")
    api = hf.HfApi(endpoint=hub_endpoint())
    info = api.model_info("org/sharded", files_metadata=True)
    assert {s.rfilename for s in info.siblings} >= {"config.json", "README.md"}
    got = hf.hf_hub_download("org/sharded", "config.json", cache_dir=tmp_path / "c",
                             endpoint=hub_endpoint())
    assert Path(got).read_bytes() == (repos / "org/sharded/config.json").read_bytes()


def hub_endpoint() -> str:
    import os

    return os.environ["HF_ENDPOINT"]


def test_a_sharded_repository_is_one_report(hub: Any, repos: Path) -> None:
    from modelsize import formats

    folder = repos / "org" / "sharded"
    remote = inspect_remote("hf://org/sharded")
    local = formats.read(folder)
    got, want = remote.report.inventory, local
    assert len(got.tensors) == len(want.tensors) == 32
    assert got.bytes_by_category == want.bytes_by_category
    assert sorted(f.path.name for f in got.files) == sorted(f.path.name for f in want.files)
    others = {"tokenizer.json": 3_000_002, "README.md": 10}
    assert dict(remote.stats.others) == others
    assert remote.report.file_bytes + sum(others.values()) == sum(
        p.stat().st_size for p in folder.iterdir())
    # 512 MiB of weights and a 3 MB tokenizer: the headers only, in a few requests
    assert remote.stats.fetched < 1 * 2**20
    assert remote.stats.requests == len(hub.log) <= 1 + 2 + 8  # listing, 2 JSON, 8 shards


def test_the_report_lists_every_file_by_size(hub: Any, capsys: Any) -> None:
    assert main(["inspect", "hf://org/sharded", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["path"] == "hf://org/sharded"
    assert "model-00008-of-00008.safetensors" in json.dumps(data["files"])
    assert data["remote"]["other_files"] == [{"path": "tokenizer.json", "bytes": 3_000_002},
                                             {"path": "README.md", "bytes": 10}]
    assert data["remote"]["requests"] == len(hub.log)


def test_a_gated_repository_is_one_line_then_works_with_a_token(
        hub: Any, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["inspect", "hf://org/gated"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "HF_TOKEN" in err and "401" in err
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert main(["inspect", "hf://org/gated", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensor_count"] == 32


def test_files_in_the_hf_cache_are_not_fetched(hub: Any, repos: Path, tmp_path: Path) -> None:
    snapshot = tmp_path / "cache" / "models--org--sharded" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for p in (repos / "org" / "sharded").iterdir():
        if p.suffix == ".safetensors":
            (snapshot / p.name).symlink_to(p)
    remote = inspect_remote("hf://org/sharded")
    assert len(remote.report.inventory.tensors) == 32
    assert not [p for p, _ in hub.log if p.endswith(".safetensors")]


def test_one_file_and_a_revision(hub: Any) -> None:
    remote = inspect_remote("hf://org/sharded@main/model-00002-of-00008.safetensors")
    assert [t.name for t in remote.report.inventory.tensors] == [
        f"model.layers.1.w{i}" for i in range(4)]
    assert remote.stats.requests == 2  # the listing, the shard's first 64 KiB
