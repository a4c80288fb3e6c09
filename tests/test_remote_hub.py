"""``modelsize inspect hf://ORG/REPO``: a whole repository as one report, over a loopback
server that speaks enough of the Hub's HTTP interface for huggingface_hub itself."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelsize.cli import main
from modelsize.remote import inspect_remote
from tests.loopback_hub import COMMIT, TOKEN, serve


def _shard(path: Path, names: list[str], numel: int,
           metadata: dict[str, str] | None = None) -> int:
    """A safetensors shard of float32 tensors, written sparsely; returns its header size."""
    header: dict[str, Any] = {n: {"dtype": "F32", "shape": [numel],
                                  "data_offsets": [i * numel * 4, (i + 1) * numel * 4]}
                              for i, n in enumerate(names)}
    if metadata:
        header["__metadata__"] = metadata
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
    fat = root / "org" / "fat"  # a shard's header far longer than its names tell
    fat.mkdir()
    fat_map = {}
    for s in range(2):
        shard = f"model-{s + 1:05d}-of-00002.safetensors"
        _shard(fat / shard, [f"w{s}"], 2**16, metadata={"notes": "x" * 40_000 * s})
        fat_map[f"w{s}"] = shard
    (fat / "model.safetensors.index.json").write_text(json.dumps({"weight_map": fat_map}))
    gated = root / "org" / "gated"
    gated.mkdir()
    for p in folder.iterdir():
        (gated / p.name).symlink_to(p)
    return root


@pytest.fixture()
def hub(repos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    with serve(repos, gated={"org/gated"}) as handler:
        monkeypatch.setenv("HF_ENDPOINT", handler.endpoint)  # type: ignore[attr-defined]
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield handler


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
    # the index's 4 names per shard: a header of under 1 KiB, fetched in one block each
    assert [n for p, n in hub.log if p.endswith(".safetensors")] == [16 * 1024] * 8


def test_a_header_longer_than_the_index_tells_costs_one_more_request(
        hub: Any, repos: Path) -> None:
    from modelsize import formats

    remote = inspect_remote("hf://org/fat")
    local = formats.read(repos / "org" / "fat")
    assert remote.report.inventory.bytes_by_category == local.bytes_by_category
    shards = [(p.rsplit("/", 1)[-1], n) for p, n in hub.log if p.endswith(".safetensors")]
    # the header; then the duplicate search's middle KiB of w0 and w1 (one shape; zeros)
    assert [n for p, n in shards if p.startswith("model-00001")] == [16 * 1024, 1024]
    assert [n for p, n in shards if p.startswith("model-00002")] == [16 * 1024, 32 * 1024,
                                                                     1024]


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
    # the listing, the shard's first 64 KiB; the middle KiB of its 4 tensors of one shape
    # (the duplicate search; zeros: their ends are not fetched)
    assert remote.stats.requests == 2 + 4 == 2 + remote.stats.duplicates.requests


def test_a_repository_is_read_over_a_few_kept_connections(hub: Any) -> None:
    from modelsize import remote

    inspect_remote("hf://org/sharded")
    assert len(hub.log) == 1 + 2 + 8
    # one connection per worker at most (and the listing's), not one per request
    assert len(hub.connections) <= remote._FILE_WORKERS + 1


def test_weights_redirected_to_a_cdn_are_fetched_there_without_the_token(
        repos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with serve(repos, gated={"org/gated"}, cdn=True) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)  # type: ignore[attr-defined]
        remote = inspect_remote("hf://org/gated")
    assert len(remote.report.inventory.tensors) == 32
    assert hub.cdn_auth == [None] * 8  # the token stays with the Hub's host
    assert remote.stats.requests == 1 + 2 + 8  # a redirect is part of its request


@pytest.fixture(scope="module")
def gguf_repos(repos: Path) -> Path:
    """org/split: a GGUF split in 3 shards by gguf-py, and a README; org/one: one GGUF;
    org/quants: two GGUF models (a split one and a single file)."""
    from tests.formats.test_gguf_split import _split

    shards = _split(repos / "org" / "split")
    (repos / "org" / "split" / "README.md").write_text("# split\n")
    (repos / "org" / "one").mkdir()
    shutil.copy(shards[1], repos / "org" / "one" / "model-q4.gguf")
    (repos / "org" / "one" / "README.md").write_text("# one\n")
    _split(repos / "org" / "quants", "m-q4")
    shutil.copy(shards[2], repos / "org" / "quants" / "m-q8.gguf")
    return repos


def test_a_split_gguf_repository_is_one_model(hub: Any, gguf_repos: Path) -> None:
    from modelsize import formats

    folder = gguf_repos / "org" / "split"
    remote = inspect_remote("hf://org/split")
    local = formats.read(sorted(folder.glob("*.gguf"))[0])
    assert len(remote.report.inventory.tensors) == len(local.tensors) == 5
    assert remote.report.inventory.bytes_by_category == local.bytes_by_category
    assert dict(remote.stats.others) == {"README.md": 8}
    assert remote.stats.requests == 1 + 3  # the listing, each shard's header in one


def test_the_first_shard_by_url_brings_the_others(hub: Any, gguf_repos: Path) -> None:
    first = "m-00001-of-00003.gguf"
    for url in (f"hf://org/split/{first}", f"{hub.endpoint}/org/split/resolve/main/{first}"):
        remote = inspect_remote(url)
        assert len(remote.report.inventory.tensors) == 5
        assert len(remote.report.inventory.files) == 3


def test_a_repository_of_one_gguf_and_one_of_several(hub: Any, gguf_repos: Path,
                                                     capsys: Any) -> None:
    remote = inspect_remote("hf://org/one")
    assert [t.name for t in remote.report.inventory.tensors] == ["blk.2.w", "blk.3.w"]
    assert dict(remote.stats.others) == {"README.md": 6}
    del hub.log[:]
    assert main(["inspect", "hf://org/quants"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds 2 GGUF models" in err
    assert "hf://org/quants/m-q4-00001-of-00003.gguf" in err
    assert not [p for p, _ in hub.log if p.endswith(".gguf")]  # refused before fetching


def test_later_reads_of_a_redirected_file_go_to_the_cdn_directly(
        repos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    with serve(repos, cdn=True) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)  # type: ignore[attr-defined]
        remote = inspect_remote("hf://org/fat")
    assert len(remote.report.inventory.tensors) == 2
    second = ["cdn" if p.startswith("/cdn/") else "resolve" for p, _ in hub.log
              if "model-00002" in p]
    # its header took 2 reads, 1 redirect; the duplicate search's sample went to the CDN
    assert second == ["resolve", "cdn", "cdn", "cdn"]


def test_plain_org_repo_is_the_hub_unless_a_local_path_has_that_name(
        hub: Any, repos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: Any) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", "org/sharded", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["path"] == "hf://org/sharded" and data["tensor_count"] == 32
    local = tmp_path / "org" / "sharded"
    local.mkdir(parents=True)
    _shard(local / "model.safetensors", ["only"], 16)
    del hub.log[:]
    assert main(["inspect", "org/sharded", "--json"]) == 0  # the local folder
    data = json.loads(capsys.readouterr().out)
    assert data["path"] == "org/sharded" and data["tensor_count"] == 1
    assert hub.log == []  # nothing asked of the Hub


def test_a_local_folder_keeps_its_names_off_the_hub(
        hub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """``run1/model.ckpt`` (a TensorFlow checkpoint's prefix: no file has that exact name) and
    a typo inside a local folder are local paths, never the Hub's ``run1/model.ckpt``."""
    from modelsize.remote import hub_url

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run1").mkdir()
    (tmp_path / "run1" / "model.ckpt.index").write_bytes(b"")
    assert hub_url("run1/model.ckpt") is None and hub_url("run1/typo") is None
    assert hub_url("org/sharded") == "hf://org/sharded"
    del hub.log[:]
    assert main(["inspect", "run1/typo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run1/typo" in err[0] and "no such file" in err[0], err
    assert hub.log == []
