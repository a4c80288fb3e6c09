"""``s3://``, ``gs://`` and other fsspec URLs: the same range reads as HTTP, through fsspec.

fsspec's memory filesystem stands in for a bucket (its reads are counted here, on the
filesystem's side, as a server counts its requests); a real ``s3://`` bucket is tested against
moto's S3 server on loopback when moto and s3fs are installed (they are not in the ``dev``
extra: moto's server brings some fifty packages).
"""

from __future__ import annotations

import importlib.util
import io
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from safetensors.torch import save

from modelsize import formats
from modelsize.cli import main
from modelsize.inspection import report_for
from modelsize.remote import read_remote

FIXTURES = Path(__file__).parent / "fixtures"
BUCKET = "modelsize-fsspec-test"


def _summary(inventory: Any) -> dict[str, Any]:
    d = report_for(inventory).to_dict()
    return {k: d[k] for k in ("format", "bytes_by_category", "tensor_count", "parameters")}


def _local(path: Path) -> dict[str, Any]:
    return _summary(formats.read(path))  # duplicates compared whole


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Files in fsspec's memory filesystem under ``memory://BUCKET/``, and the same files on
    disk (the folder returned): a 16 MiB safetensors file made by safetensors, a torch.save
    zip, an ONNX model with its external data."""
    local = tmp_path_factory.mktemp("bucket")
    torch.manual_seed(0)
    (local / "model.safetensors").write_bytes(save({
        "embed.weight": torch.randn(2048, 2048), "norm.weight": torch.ones(2048)}))
    buf = io.BytesIO()
    torch.save({f"layer{i}.weight": torch.randn(64, 64) for i in range(8)}, buf)
    (local / "model.pt").write_bytes(buf.getvalue())
    for name in ("external.onnx", "external.onnx.data"):
        shutil.copy(FIXTURES / "onnx" / name, local / name)
    fs = fsspec.filesystem("memory")
    for p in local.iterdir():
        fs.pipe_file(f"/{BUCKET}/{p.name}", p.read_bytes())
    yield local
    fs.rm(f"/{BUCKET}", recursive=True)


@pytest.fixture()
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int]]:
    """Every size asked of, and every read from, the memory filesystem: (what, path,
    bytes), counted by the filesystem, not by modelsize."""
    log: list[tuple[str, str, int]] = []
    size, cat_file = MemoryFileSystem.size, MemoryFileSystem.cat_file

    def counted_size(self: Any, path: str) -> Any:
        log.append(("size", path.rsplit("/", 1)[-1], 0))
        return size(self, path)

    def counted_cat(self: Any, path: str, start: Any = None, end: Any = None,
                    **kw: Any) -> bytes:
        data: bytes = cat_file(self, path, start=start, end=end, **kw)
        log.append(("read", path.rsplit("/", 1)[-1], len(data)))
        return data

    monkeypatch.setattr(MemoryFileSystem, "size", counted_size)
    monkeypatch.setattr(MemoryFileSystem, "cat_file", counted_cat)
    return log


def test_a_safetensors_file_by_its_header(bucket: Path, reads: list[Any]) -> None:
    inventory, stats, _ = read_remote(f"memory://{BUCKET}/model.safetensors")
    assert _summary(inventory) == _local(bucket / "model.safetensors")
    size = (bucket / "model.safetensors").stat().st_size
    assert stats.size == size
    # one size, then the first 64 KiB (the header is inside): 65,536 bytes, 0.39% of 16 MiB
    assert reads == [("size", "model.safetensors", 0), ("read", "model.safetensors", 65536)]
    assert stats.requests == 2 and stats.fetched == 65536 < size // 200


def test_a_torch_zip_by_its_directory_and_pickle(bucket: Path, reads: list[Any]) -> None:
    inventory, stats, _ = read_remote(f"memory://{BUCKET}/model.pt")
    assert _summary(inventory) == _local(bucket / "model.pt")
    assert stats.requests == len(reads)
    assert stats.fetched == sum(n for _, _, n in reads)


def test_onnx_external_data_is_sized_never_read(bucket: Path, reads: list[Any]) -> None:
    inventory, stats, _ = read_remote(f"memory://{BUCKET}/external.onnx")
    assert _summary(inventory) == _local(bucket / "external.onnx")
    # the data file beside it, found at memory://BUCKET/external.onnx.data: sized, then only
    # the samples of its candidate duplicates read (their 256 bytes are duplicates locally)
    data = [r for r in reads if r[1] == "external.onnx.data"]
    assert data[0] == ("size", "external.onnx.data", 0)
    assert sum(n for _, _, n in data[1:]) == stats.duplicates.fetched
    assert len(data[1:]) == stats.duplicates.requests
    assert stats.requests == len(reads) <= 3 + stats.duplicates.requests


def _one_line(capsys: Any, url: str) -> str:
    assert main(["inspect", url]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "Traceback" not in captured.err
    return captured.err


def test_a_missing_file_is_one_line(bucket: Path, capsys: Any) -> None:
    err = _one_line(capsys, f"memory://{BUCKET}/nothere.safetensors")
    assert "no such file" in err


def test_a_missing_filesystem_package_names_it(capsys: Any) -> None:
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    err = _one_line(capsys, "gs://bucket/model.safetensors")
    assert "pip install gcsfs" in err


def test_fsspec_missing_names_the_extra(capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec: ImportError
    err = _one_line(capsys, "s3://bucket/model.safetensors")
    assert "fsspec" in err and "modelsize[remote]" in err


def test_an_unknown_protocol_is_one_line(capsys: Any) -> None:
    err = _one_line(capsys, "nosuchproto://bucket/model.safetensors")
    assert "nosuchproto:// is not a protocol" in err


# -- a real S3 bucket: moto's server on loopback, read by s3fs ---------------------------------

@pytest.fixture(scope="module")
def s3(bucket: Path) -> Iterator[str]:
    """``s3://models`` on moto's S3 server, holding the bucket's files (skipped without moto
    and s3fs)."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in (*env, "AWS_ENDPOINT_URL")}
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(env, AWS_ENDPOINT_URL=f"http://{host}:{port}")
    try:
        client = boto3.client("s3")
        client.create_bucket(Bucket="models")
        for p in bucket.iterdir():
            client.put_object(Bucket="models", Key=p.name, Body=p.read_bytes())
        yield "s3://models"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_a_real_s3_bucket(bucket: Path, s3: str, capsys: Any) -> None:
    inventory, stats, _ = read_remote(f"{s3}/model.safetensors")
    assert _summary(inventory) == _local(bucket / "model.safetensors")
    assert stats.requests == 2 and stats.fetched == 65536
    inventory, stats, _ = read_remote(f"{s3}/external.onnx")
    assert _summary(inventory) == _local(bucket / "external.onnx")
    assert "no such file" in _one_line(capsys, f"{s3}/nothere.safetensors")


# -- fsspec's HTTP filesystem (aiohttp) on loopback: a network store through the same path -------

@pytest.fixture(scope="module")
def http_store(bucket: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The bucket's files, a TF1 checkpoint with its .meta and a DCP checkpoint, served by
    the loopback Hub (HEAD, GET with Range) and reached as ``loophttp://HOST/...``: a protocol
    registered here for fsspec's own ``HTTPFileSystem``, so that modelsize reads them through
    fsspec (as it reads ``s3://``) and not through its own HTTP client."""
    pytest.importorskip("aiohttp")
    from fsspec.implementations.http import HTTPFileSystem
    from fsspec.registry import _registry  # (fsspec.registry is the registry's mapping)

    from tests.loopback_hub import serve

    class LoopHTTP(HTTPFileSystem):  # type: ignore[misc]
        protocol = ("loophttp",)

        @classmethod
        def _strip_protocol(cls, path: str) -> str:
            return "http://" + str(path).split("://", 1)[-1]

    root = tmp_path_factory.mktemp("store")
    files = root / "org" / "files"
    shutil.copytree(bucket, files)
    shutil.copytree(FIXTURES.parent / "fixtures/tensorflow/tf1", files / "tf1")
    shutil.copytree(FIXTURES.parent / "fixtures/torch_dcp/two_ranks", files / "dcp")
    with pytest.MonkeyPatch.context() as mp, serve(root) as hub:
        mp.setitem(_registry, "loophttp", LoopHTTP)
        hub.base = f"loophttp://{hub.endpoint.split('://', 1)[1]}/org/files/resolve/main"
        yield hub


@pytest.mark.parametrize(("name", "most"), [
    ("model.safetensors", 2),  # its size (a HEAD), its first 64 KiB
    # the size; the first 64 KiB; the end; the local headers past the first 64 KiB (16 KiB
    # tensors: one request each)
    ("model.pt", 3 + 3),
    # the index's size and read; the .meta's size, first block and collections; the data's size
    ("tf1/model.ckpt.index", 6),
    ("dcp/.metadata", 6),  # .metadata's size and read; each data file's size and first 16 KiB
])
def test_fsspec_http_filesystem(http_store: Any, bucket: Path, name: str, most: int) -> None:
    del http_store.log[:]
    inventory, stats, _ = read_remote(f"{http_store.base}/{name}")
    local = bucket / name if "/" not in name else FIXTURES / {
        "tf1": "tensorflow/tf1", "dcp": "torch_dcp/two_ranks"}[name.split("/")[0]] / (
        name.split("/", 1)[1])
    assert _summary(inventory) == _local(local)
    # every request counted as the server saw it, every byte it sent
    assert stats.requests == len(http_store.log) <= most + stats.duplicates.requests
    assert stats.fetched == sum(n for _, n in http_store.log)
    if name == "model.safetensors":
        assert stats.fetched == 65536 < (bucket / name).stat().st_size // 200
