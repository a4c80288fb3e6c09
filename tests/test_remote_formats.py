"""Every format read remotely by its headers: the report equals the local one, in a few
requests; and the faults of a real server (dropped connections, no Range, 404, a slow server,
a lying Content-Range) are one line, exit 2, with bounded bytes."""

from __future__ import annotations

import http.server
import json
import pickle
import re
import shutil
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelsize import formats, remote
from modelsize.cli import main
from modelsize.inspection import report_for
from modelsize.remote import read_remote

FIXTURES = Path(__file__).parent / "fixtures"
MIB = 2**20


class _Server(http.server.BaseHTTPRequestHandler):
    """Files under ``root`` with Range support; ``faults[name]`` makes a file misbehave:
    ``drop`` (hang up once, then answer), ``drop-always``, ``no-range`` (200 with the whole
    file), ``slow`` (answer after 2 s), ``lie`` (a Content-Range of other bytes)."""

    root: Path
    log: list[tuple[str, int]]
    faults: dict[str, str]
    dropped: set[str]
    protocol_version = "HTTP/1.0"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        name = self.path.lstrip("/")
        target = self.root / name
        fault = self.faults.get(name, "")
        if not target.is_file():
            self.log.append((name, 0))  # (logged before the answer: see the 206 below)
            self.send_error(404)
            return
        size = target.stat().st_size
        if fault == "drop-always" or (fault == "drop" and name not in self.dropped):
            self.dropped.add(name)
            self.log.append((name, 0))
            self.connection.close()  # no status line: the client sees a dropped connection
            return
        if fault == "slow":
            time.sleep(2)
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range") or "")
        if fault == "no-range" or not m:
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            sent = 0
            with open(target, "rb") as fh:
                try:
                    while chunk := fh.read(1 << 16):
                        self.wfile.write(chunk)
                        sent += len(chunk)
                except OSError:
                    pass
            self.log.append((name, sent))
            return
        start, stop = int(m.group(1)), min(int(m.group(2)), size - 1)
        with open(target, "rb") as fh:
            fh.seek(start)
            body = fh.read(stop - start + 1)
        shown = f"bytes {start + 1}-{stop + 1}/{size}" if fault == "lie" else (
            f"bytes {start}-{stop}/{size}")
        # logged before the answer goes out: a client that has its answer finds it logged
        self.log.append((name, len(body)))
        self.send_response(206)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Range", shown)
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[Any]:
    root = tmp_path / "www"
    root.mkdir()
    handler = type("H", (_Server,), {"root": root, "log": [], "faults": {}, "dropped": set()})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    handler.url = f"http://127.0.0.1:{httpd.server_address[1]}"  # type: ignore[attr-defined]
    yield handler
    httpd.shutdown()
    httpd.server_close()


def _summary(inventory: Any) -> dict[str, Any]:
    d = report_for(inventory).to_dict()
    return {k: d[k] for k in ("format", "bytes_by_category", "tensor_count", "parameters",
                              "unsafe_globals")}


def _local(path: Path) -> dict[str, Any]:
    return _summary(formats.read(path))  # duplicates compared whole


def _remote(server: Any, name: str) -> tuple[dict[str, Any], remote.Stats]:
    inventory, stats, _ = read_remote(f"{server.url}/{name}")
    return _summary(inventory), stats


# -- every format: the report of the remote file is the local report ---------------------------

CASES = [
    # (fixture files to serve: the first is inspected; the most requests its headers may
    # take, the duplicate search's samples apart)
    (["gguf/tiny.gguf"], 1),
    (["gguf/big_endian.gguf"], 1),
    (["onnx/external.onnx", "onnx/external.onnx.data"], 2),
    (["onnx/shared_external.onnx", "onnx/shared_external.bin"], 2),
    (["onnx/typed.onnx"], 1),
    (["keras/model.keras"], 6),
    (["keras/model_deflated.keras"], 6),
    (["keras/legacy.h5"], 2),
    (["keras/model.weights.h5"], 2),
    (["legacy_torch/py3_torch03_state_dict.pt"], 2),
    (["legacy_torch/py2_torch04_module.pt"], 2),
    (["legacy_torch/py2_numpy_weights.pkl"], 2),
    (["tensorflow/tf1_sharded/model.ckpt.index",
      *(f"tensorflow/tf1_sharded/model.ckpt.data-0000{i}-of-00003" for i in range(3))], 5),
]


@pytest.mark.parametrize(("files", "most"), CASES, ids=[c[0][0] for c in CASES])
def test_remote_report_equals_the_local_one(server: Any, files: list[str], most: int) -> None:
    for f in files:
        (server.root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(FIXTURES / f, server.root / f)
    got, stats = _remote(server, files[0])
    assert got == _local(server.root / files[0])
    assert stats.requests == len(server.log) <= most + stats.duplicates.requests
    for f in files[1:]:  # data files: sized by one 1-byte request, then only samples read
        sizes = [n for name, n in server.log if name == f]
        assert sizes[0] == 1 and sum(sizes[1:]) <= stats.duplicates.fetched


def test_tflite_by_everything_but_its_buffers(server: Any) -> None:
    found = sorted(Path("/root/.cache/modelsize-realfiles/files").glob("*/*/*/*/nmp.tflite"))
    if not found:
        pytest.skip("the real TFLite file of basic-pitch is not in the real-files cache")
    shutil.copy(found[0], server.root / "nmp.tflite")
    got, stats = _remote(server, "nmp.tflite")
    assert got == _local(server.root / "nmp.tflite")
    assert stats.requests <= 12


def _big_gguf(path: Path, n_tokens: int = 3000, n_tensors: int = 200,
              numel: int = 4 * MIB) -> int:
    """A GGUF of ``n_tensors`` float32 tensors (3.2 GiB), written sparsely; its header
    holds a vocabulary of ``n_tokens`` strings, as a model's does. Returns the header size."""
    def s(text: str) -> bytes:
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw

    kv = s("general.architecture") + struct.pack("<I", 8) + s("llama")
    kv += s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, n_tokens)
    kv += b"".join(s(f"tok{i}") for i in range(n_tokens))
    kv += s("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, n_tokens)
    kv += struct.pack(f"<{n_tokens}f", *([0.5] * n_tokens))
    infos = b"".join(s(f"blk.{i}.w") + struct.pack("<IQIQ", 1, numel, 0, i * numel * 4)
                     for i in range(n_tensors))
    head = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, 3) + kv + infos
    head += b"\0" * (-len(head) % 32)
    with open(path, "wb") as fh:
        fh.write(head)
        fh.truncate(len(head) + n_tensors * numel * 4)
    return len(head)


def test_a_3_gib_gguf_by_its_header_in_two_requests(server: Any) -> None:
    header = _big_gguf(server.root / "big.gguf")
    got, stats = _remote(server, "big.gguf")
    assert got == _local(server.root / "big.gguf")
    assert got["tensor_count"] == 200
    assert stats.fetched < max(1 * MIB, header * 2)
    assert stats.requests <= 2


def test_a_gguf_header_of_many_blocks_is_read_whole(server: Any) -> None:
    # a vocabulary of 40,000 tokens: about 800 KB of header, far past the first request
    header = _big_gguf(server.root / "vocab.gguf", n_tokens=40_000, n_tensors=50)
    got, stats = _remote(server, "vocab.gguf")
    assert got == _local(server.root / "vocab.gguf")
    assert got["tensor_count"] == 50
    assert header > 10 * 64 * 1024
    assert stats.fetched < header * 2
    assert stats.requests <= 8  # the read-ahead doubles: 64 KiB, 32, 64, 128... KiB


def test_a_gguf_vocabulary_is_walked_from_the_fetched_bytes(server: Any,
                                                             monkeypatch: Any) -> None:
    """The header walk parses its 40,000 strings from the bytes fetched, asking the source
    again only past them (a ``read`` per string made Llama-3's vocabulary take 2.5 s)."""
    _big_gguf(server.root / "vocab.gguf", n_tokens=40_000, n_tensors=50)
    reads = []
    real = remote.RangeSource.read

    def counted(self: Any, start: int, stop: int) -> bytes:
        reads.append(stop - start)
        return real(self, start, stop)

    monkeypatch.setattr(remote.RangeSource, "read", counted)
    got, _ = _remote(server, "vocab.gguf")
    assert got == _local(server.root / "vocab.gguf")
    assert len(reads) < 200  # 40,000 strings, 50 tensor infos


def test_a_big_plain_pickle_skips_its_array_bytes(server: Any) -> None:
    arrays = {f"layer{i}": np.zeros((256, 1024), np.float32) for i in range(16)}  # 16 MiB
    with open(server.root / "weights.pkl", "wb") as fh:
        pickle.dump(arrays, fh, protocol=4)
    got, stats = _remote(server, "weights.pkl")
    assert got == _local(server.root / "weights.pkl")
    assert got["tensor_count"] == 16
    assert stats.fetched < 0.005 * 16 * MIB * 4 + 64 * 1024
    # the pickles; then the middle KiB of each array (equal zeros: their ends not fetched)
    assert stats.requests - stats.duplicates.requests <= 16 + 2
    assert stats.duplicates.requests <= 16 and stats.duplicates.found == 0


def test_a_legacy_torch_checkpoint_by_its_pickles_and_storage_sizes(server: Any) -> None:
    torch = pytest.importorskip("torch")
    state = {f"w{i}": torch.zeros(64 * 1024) for i in range(8)}  # 2 MiB of storages
    torch.save(state, server.root / "legacy.pt", _use_new_zipfile_serialization=False)
    got, stats = _remote(server, "legacy.pt")
    assert got == _local(server.root / "legacy.pt")
    assert got["tensor_count"] == 8
    assert stats.fetched < 128 * 1024
    # the pickles; then the middle KiB of each storage (equal zeros: their ends not fetched)
    assert stats.requests - stats.duplicates.requests <= 8 + 2
    assert stats.duplicates.requests <= 8 and stats.duplicates.found == 0


# -- faults: one line, exit 2, bounded bytes ---------------------------------------------------

@pytest.fixture()
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "TIMEOUT", 0.5)
    monkeypatch.setattr(remote, "BACKOFF", 0.01)


def _one_line(capsys: Any, *args: str) -> str:
    assert main(["inspect", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    return captured.err


def test_a_dropped_connection_is_retried(server: Any, quick: None) -> None:
    shutil.copy(FIXTURES / "gguf/tiny.gguf", server.root / "tiny.gguf")
    server.faults["tiny.gguf"] = "drop"
    got, _ = _remote(server, "tiny.gguf")
    assert got == _local(server.root / "tiny.gguf")
    assert len(server.log) == 2  # the dropped one, then the answer


def test_a_connection_dropped_every_time_is_one_line(server: Any, quick: None,
                                                     capsys: Any) -> None:
    shutil.copy(FIXTURES / "gguf/tiny.gguf", server.root / "tiny.gguf")
    server.faults["tiny.gguf"] = "drop-always"
    err = _one_line(capsys, f"{server.url}/tiny.gguf")
    assert "connection dropped" in err and f"tried {remote.RETRIES + 1} times" in err
    assert len(server.log) == remote.RETRIES + 1


def test_a_server_ignoring_range_is_stopped_and_named(server: Any, capsys: Any) -> None:
    _big_gguf(server.root / "big.gguf", n_tensors=16)  # 256 MiB
    server.faults["big.gguf"] = "no-range"
    err = _one_line(capsys, f"{server.url}/big.gguf")
    assert "ignores range requests" in err and "HTTP 200" in err
    time.sleep(0.2)
    assert sum(n for _, n in server.log) < 64 * MIB  # the client hung up


def test_a_missing_file_is_one_line(server: Any, capsys: Any) -> None:
    assert "HTTP 404" in _one_line(capsys, f"{server.url}/nothing.gguf")


def test_a_slow_server_times_out_in_one_line(server: Any, quick: None, capsys: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "RETRIES", 1)
    shutil.copy(FIXTURES / "gguf/tiny.gguf", server.root / "tiny.gguf")
    server.faults["tiny.gguf"] = "slow"
    err = _one_line(capsys, f"{server.url}/tiny.gguf")
    assert "no answer within 0.5 s" in err and "tried 2 times" in err


def test_a_lying_content_range_is_one_line(server: Any, capsys: Any) -> None:
    shutil.copy(FIXTURES / "gguf/tiny.gguf", server.root / "tiny.gguf")
    server.faults["tiny.gguf"] = "lie"
    err = _one_line(capsys, f"{server.url}/tiny.gguf")
    assert "Content-Range" in err and "cannot be trusted" in err
    assert len(server.log) == 1


def test_the_report_says_what_it_fetched(server: Any, capsys: Any) -> None:
    shutil.copy(FIXTURES / "gguf/tiny.gguf", server.root / "tiny.gguf")
    assert main(["inspect", f"{server.url}/tiny.gguf", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["remote"]["requests"] == len(server.log) == 1
    assert data["remote"]["fetched_bytes"] == sum(n for _, n in server.log)


def test_ranges_are_joined_smallest_gaps_first_within_a_budget() -> None:
    from modelsize.remote_regions import merge_ranges

    ranges = [(0, 10), (5, 20), (30, 40), (140, 150), (1150, 1160), (1161, 1170)]
    assert merge_ranges(ranges, gap=4096) == [[0, 1170]]
    # gaps 10, 100, 1000, 1: with 120 bytes to spend, the 1, 10 and 100 byte gaps are joined
    assert merge_ranges(ranges, gap=4096, waste=120) == [[0, 150], [1150, 1170]]
    assert merge_ranges(ranges, gap=50) == [[0, 40], [140, 150], [1150, 1170]]
    assert merge_ranges(ranges, gap=4096, waste=0) == [[0, 20], [30, 40], [140, 150],
                                                        [1150, 1160], [1161, 1170]]


def test_a_zip_of_many_small_tensors_costs_bounded_gap_bytes(server: Any) -> None:
    """Headers of a checkpoint whose small tensors lie between them: the gaps fetched to save
    requests stay within ZIP_GAPS (every gap under 4 KiB was fetched before: 1.6 MB here)."""
    import torch

    from modelsize.remote_regions import ZIP_GAPS

    torch.save({f"t{i}": torch.zeros(1000) for i in range(400)}, server.root / "many.pt")
    got, stats = _remote(server, "many.pt")
    assert got == _local(server.root / "many.pt")
    size = (server.root / "many.pt").stat().st_size
    headers_and_pickle = 400 * 256 + 64 * 1024 + 32 * 1024  # headers, first read, directory
    assert stats.fetched <= headers_and_pickle + ZIP_GAPS < size // 2
