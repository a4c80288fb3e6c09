"""``modelsize estimate hf://ORG/REPO``: config.json and the weights' headers over HTTP ranges.

A loopback server speaks the Hub's HTTP interface as huggingface_hub uses it: the listing
``/api/models/ORG/REPO/revision/REV`` (JSON ``siblings``) and downloads
``/ORG/REPO/resolve/REV/FILE`` with ``Range`` (206 and ``Content-Range``); a gated repository
answers 401 without ``Authorization: Bearer <token>``. The repository is a real model saved
by transformers' ``save_pretrained`` (sharded safetensors and their index), several MiB of
weights: the estimate must fetch under 1 MiB and equal the estimate of the same folder read
locally.
"""

from __future__ import annotations

import http.server
import json
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelsize.cli import main

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

TOKEN = "hf_test_token"
MIB = 2**20


class _Hub(http.server.BaseHTTPRequestHandler):
    root: Path
    log: list[dict[str, Any]]
    gated: set[str]

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, code: int, body: bytes, extra: dict[str, str] | None = None) -> None:
        # logged before the answer goes out: a client that has its answer finds it logged
        # (after, a test that clears the log as the client returns could catch it late)
        self.log.append({"path": self.path, "bytes": len(body), "code": code,
                         "auth": self.headers.get("Authorization"),
                         "range": self.headers.get("Range")})
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        listing = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        repo = (listing or resolve).group(1) if (listing or resolve) else ""
        if repo in self.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._send(401, b'{"error": "Access to model is restricted"}')
            return
        if listing:
            folder = self.root / repo / listing.group(2)
            if not folder.is_dir():
                self._send(404, b'{"error": "Revision Not Found"}')
                return
            names = sorted(p.name for p in folder.iterdir())
            self._send(200, json.dumps({"id": repo, "sha": "0" * 40,
                                        "siblings": [{"rfilename": n} for n in names]}).encode())
            return
        if not resolve:
            self._send(404, b"not found")
            return
        target = self.root / repo / resolve.group(2) / resolve.group(3)
        if not target.is_file():
            self._send(404, b"not found")
            return
        size = target.stat().st_size
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range") or "")
        if not m:
            self._send(200, target.read_bytes())
            return
        start, stop = int(m.group(1)), min(int(m.group(2)), size - 1)
        with open(target, "rb") as fh:
            fh.seek(start)
            body = fh.read(stop - start + 1)
        self._send(206, body, {"Content-Range": f"bytes {start}-{stop}/{size}"})


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tiny Llama saved by transformers in bfloat16, in 2 MiB shards with an index
    (about 9 MiB of weights), under ``<root>/org/tiny/main/``."""
    root = tmp_path_factory.mktemp("hub")
    folder = root / "org" / "tiny" / "main"
    torch.manual_seed(0)
    config = tf.LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                            num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
                            max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)
    model = tf.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="2MB")
    for extra in ("generation_config.json",):
        (folder / extra).unlink(missing_ok=True)
    shutil.copytree(folder, root / "org" / "tiny" / "v1")
    shutil.copytree(folder, root / "org" / "gated" / "main")
    return root


@pytest.fixture()
def hub(saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    log: list[dict[str, Any]] = []
    handler = type("H", (_Hub,), {"root": saved, "log": log, "gated": {"org/gated"}})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{httpd.server_address[1]}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield log
    httpd.shutdown()
    httpd.server_close()


def _json(capsys: Any, *args: str) -> dict[str, Any]:
    assert main(["estimate", *args, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


ARGS = ("--generate", "64", "--batch", "1", "--seq", "32", "--device", "cpu")
#: The other tests ask about fetching, not generation: two new tokens trace faster.
SHORT = ("--generate", "2", "--batch", "1", "--seq", "8", "--device", "cpu")


def test_hub_estimate_fetches_under_a_mib_and_equals_the_local_folder(
        saved: Path, hub: list[dict[str, Any]], capsys: Any) -> None:
    folder = saved / "org" / "tiny" / "main"
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert weights > 8 * MIB and len(list(folder.glob("*.safetensors"))) > 2
    remote = _json(capsys, "hf://org/tiny", *ARGS)
    served = sum(r["bytes"] for r in hub)
    assert remote["remote"]["fetched_bytes"] == served < MIB
    assert remote["remote"]["requests"] == len(hub)
    assert remote["remote"]["checkpoint_bytes"] == weights
    # only the listing, config.json, the index and each shard's header regions
    paths = [r["path"] for r in hub]
    assert paths[0] == "/api/models/org/tiny/revision/main"
    assert all(r["range"] for r in hub if r["path"].endswith(".safetensors"))
    local = _json(capsys, str(folder), *ARGS)
    for key in ("peak_bytes", "categories", "generation", "timeline", "parameter_count"):
        assert remote[key] == local[key], key
    assert remote["weights"]["dtype"] == local["weights"]["dtype"] == "bfloat16"
    assert remote["weights"]["checkpoint_bytes"] == local["weights"]["checkpoint_bytes"]
    # the parameters in memory: bfloat16, as from_pretrained loads them (independent count)
    params = sum(p.numel() for p in tf.LlamaForCausalLM.from_pretrained(folder).parameters())
    assert remote["categories"]["parameters"] == 2 * params


def test_hub_report_says_what_was_fetched(hub: list[dict[str, Any]], capsys: Any) -> None:
    assert main(["estimate", "hf://org/tiny", *SHORT]) == 0
    out = capsys.readouterr().out
    served = sum(r["bytes"] for r in hub)
    assert f"Read from the Hub: {served:,} bytes in {len(hub)} requests" in out
    assert "hf://org/tiny" in out and "modelsize-hub-" not in out


def test_org_repo_without_scheme_and_a_revision(hub: list[dict[str, Any]],
                                                capsys: Any) -> None:
    data = _json(capsys, "org/tiny@v1", *SHORT)
    assert data["remote"]["url"] == "hf://org/tiny@v1"
    assert hub[0]["path"] == "/api/models/org/tiny/revision/v1"
    assert all("/resolve/v1/" in r["path"] for r in hub[1:])


def test_gated_repository_needs_a_token(hub: list[dict[str, Any]], capsys: Any,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["estimate", "hf://org/gated", *SHORT]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "HF_TOKEN" in err and "401" in err
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.clear()
    data = _json(capsys, "hf://org/gated", *SHORT)
    assert data["peak_bytes"] > 0
    assert {r["auth"] for r in hub} == {f"Bearer {TOKEN}"}


def test_wrong_token_and_missing_revision_are_one_line(hub: list[dict[str, Any]], capsys: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "wrong")
    assert main(["estimate", "hf://org/gated", *SHORT]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refuses the token in HF_TOKEN" in err
    assert main(["estimate", "hf://org/tiny@nope", *SHORT]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "404" in err


def test_a_snapshot_in_the_hf_cache_is_read_in_place(saved: Path, hub: list[dict[str, Any]],
                                                     tmp_path: Path, capsys: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    commit = "a" * 40
    snap = cache / "models--org--tiny" / "snapshots" / commit
    shutil.copytree(saved / "org" / "tiny" / "main", snap)
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    data = _json(capsys, "hf://org/tiny", *SHORT)
    assert hub == []
    assert data["remote"]["hf_cache"] == str(snap) and data["remote"]["requests"] == 0
    local = _json(capsys, str(saved / "org" / "tiny" / "main"), *SHORT)
    assert data["peak_bytes"] == local["peak_bytes"]


def test_offline_without_a_cached_snapshot_is_one_line(hub: list[dict[str, Any]], capsys: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["estimate", "hf://org/tiny", *SHORT]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "HF_HUB_OFFLINE" in err and hub == []
