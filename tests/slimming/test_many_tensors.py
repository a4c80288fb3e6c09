"""slim and inspect of a safetensors file of many tiny tensors: what the columnar plan, the
windowed writes, the streamed verification and the streamed JSON must still get right.

The checkpoint is 20k tensors of a few elements each (five dtypes, empty and scalar shapes,
optimizer slots, copies), written by the safetensors library itself; the outputs are loaded
back with the same library and compared tensor by tensor with the arrays that were saved.
Numbers asserted on ``inspect --json`` are computed from the file's own header and the
arrays, never from modelsize.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import modelsize
from modelsize import cli
from tests.conftest import run_cli

safetensors_numpy = pytest.importorskip("safetensors.numpy")
safetensors = pytest.importorskip("safetensors")

COUNT = 20_000
DTYPES = (np.float32, np.float16, np.float64, np.int16, np.int64)
SHAPES: tuple[tuple[int, ...], ...] = ((), (1,), (3,), (2, 2), (0,), (5,))
ALIASES_KEY = "modelsize.aliases"
Many = tuple[Path, dict[str, np.ndarray], dict[str, str]]


def _tensors() -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The arrays (random: no two alike but the copies) and ``{copy: its original}``."""
    rng = np.random.default_rng(18)
    tensors: dict[str, np.ndarray] = {}
    for i in range(COUNT):
        shape = SHAPES[i % len(SHAPES)]
        dtype = np.dtype(DTYPES[i % len(DTYPES)])
        name = f"layers.{i}.exp_avg" if i % 97 == 0 else f"layers.{i}.weight"
        values = (rng.standard_normal(shape) if dtype.kind == "f"
                  else rng.integers(-1000, 1000, shape))
        tensors[name] = np.asarray(values).astype(dtype)
    copies = {}
    for i in range(0, COUNT, 1000):  # a copy of a tensor of 5 elements
        j = i + (5 - i) % len(SHAPES)
        copies[f"copy.{i}"] = f"layers.{j}.weight"
        tensors[f"copy.{i}"] = tensors[copies[f"copy.{i}"]].copy()
    return tensors, copies


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Many:
    """The checkpoint, the arrays it was saved from and its copies."""
    path = tmp_path_factory.mktemp("many") / "many.safetensors"
    tensors, copies = _tensors()
    safetensors_numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    return path, tensors, copies


def _same(got: np.ndarray, want: np.ndarray, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got, want)
    assert got.tobytes() == want.tobytes(), name


@pytest.mark.parametrize("options", [
    {"drop": ["optimizer_state"]}, {"dedupe": True}, {"to": "safetensors"},
    {"cast": "float16"},
], ids=["drop", "dedupe", "to-safetensors", "cast"])
def test_slim_of_many_tiny_tensors_loads_with_every_tensor_as_saved(
        many: Many, tmp_path: Path, options: dict[str, Any]) -> None:
    path, tensors, copies = many
    out = tmp_path / "out.safetensors"
    report = modelsize.slim(path, out, **options)
    assert report.verified and not report.copied
    got = safetensors_numpy.load_file(str(out))
    with safetensors.safe_open(str(out), "np") as fh:
        meta = fh.metadata() or {}
    aliases: dict[str, str] = json.loads(meta.get(ALIASES_KEY, "{}"))
    dropped = {d.name for d in report.dropped}
    # Every input tensor is in the output, an alias of an output tensor, or dropped: once.
    assert len(got) + len(aliases) + len(dropped) == len(tensors)
    assert set(got) | set(aliases) | dropped == set(tensors)
    assert all(name.endswith(".exp_avg") for name in dropped)
    if "drop" in options:
        assert dropped == {n for n in tensors if n.endswith(".exp_avg")}
    cast = options.get("cast")
    for name, array in got.items():
        want = tensors[name]
        if cast and want.dtype.kind == "f" and want.dtype.itemsize > 2:
            want = want.astype(cast)
        _same(array, want, name)
    for alias, original in aliases.items():
        assert original in got
        _same(tensors[alias], tensors[original], alias)  # the bytes it stands for
    if options.get("dedupe") or options.get("to"):
        # Each copy or its original is an alias of the other; nothing else is alike.
        assert len(aliases) == len(copies)
        assert all(aliases.get(c) == o or aliases.get(o) == c for c, o in copies.items())
    else:
        assert aliases == {}


def test_slim_with_nothing_to_drop_is_a_verified_byte_copy(many: Many, tmp_path: Path) -> None:
    """Nothing to drop: a byte copy, verified against the input's header, whose report holds
    the output's totals (its records read from OUT when asked for)."""
    weights = {k: v for k, v in many[1].items() if k.endswith(".weight")}
    path = tmp_path / "weights.safetensors"
    safetensors_numpy.save_file(weights, str(path), metadata={"format": "pt"})
    out = tmp_path / "out.safetensors"
    report = modelsize.slim(path, out)
    assert report.copied and report.verified
    assert out.read_bytes() == path.read_bytes()
    assert report.output is not None
    full = modelsize.formats.read(out)
    assert report.output.bytes_by_category == full.bytes_by_category
    assert report.output.file_bytes == full.file_bytes == path.stat().st_size
    assert report.output.tensors == full.tensors and len(full.tensors) == len(weights)


def test_streamed_verification_catches_a_flipped_byte(
        many: Many, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A byte flipped in the middle of the tensor data (the writer's windowed copy) fails
    the streamed verification: one line, the exit code of a verification failure, nothing
    written and nothing left in OUT's folder."""
    from modelsize.slimming import verify
    from modelsize.slimming.writers import base

    real_write = base.write_tensors

    def flipping(fh: Any, plan: Any, order: Any, meter: Any, written: Any) -> int:
        start = fh.tell()
        n = real_write(fh, plan, order, meter, written)
        fh.seek(start + n // 2)
        byte = fh.read(1)
        fh.seek(start + n // 2)
        fh.write(bytes([byte[0] ^ 0x10]))
        fh.seek(start + n)
        return n

    streamed: list[Path] = []
    real_verify = verify._verify_streamed

    def spy(plan: Any, order: Any, written: Any, staged: Path, *early: Any) -> Any:
        streamed.append(staged)
        return real_verify(plan, order, written, staged, *early)

    monkeypatch.setattr("modelsize.slimming.writers.safetensors.write_tensors", flipping)
    monkeypatch.setattr(verify, "_verify_streamed", spy)
    path = many[0]
    folder = tmp_path / "out"
    folder.mkdir()
    out = folder / "out.safetensors"
    rc = cli.main(["slim", str(path), "-o", str(out), "--to", "safetensors"])
    captured = capsys.readouterr()
    assert rc == modelsize.errors.VerificationError.exit_code == 1
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith("modelsize: ") and "failed verification" in lines[0]
    assert "read back differ" in lines[0]
    assert len(streamed) == 1  # the streamed verification, not a full read, caught it
    assert list(folder.iterdir()) == []


def _small(path: Path) -> dict[str, np.ndarray]:
    tensors = {
        "b.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
        "a.bias": np.ones(3, np.float16),
        "c.copy": np.arange(6, dtype=np.float32).reshape(2, 3),
        "z.exp_avg": np.zeros(4, np.float32),
        "step": np.array(3, np.int64),
    }
    safetensors_numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    return tensors


def _data_order(path: Path) -> list[str]:
    """The tensor names of a safetensors file in the order of their bytes (its header)."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return sorted(header, key=lambda k: header[k]["data_offsets"][0])


def test_inspect_json_keys_and_values(tmp_path: Path) -> None:
    """The document ``inspect --json`` prints (streamed now) has the keys, in order, and the
    values it had when it was one ``json.dumps``."""
    path = tmp_path / "small.safetensors"
    tensors = _small(path)
    proc = run_cli("inspect", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("}\n") and proc.stdout.count("\n") == 1
    doc = json.loads(proc.stdout)
    assert list(doc) == ["path", "format", "file_bytes", "files", "bytes_by_category",
                         "summary", "parameters", "bits_per_weight", "quantization",
                         "findings", "unsafe_globals", "tensor_count", "tensors",
                         "facts", "notes"]
    size = path.stat().st_size
    data = sum(a.nbytes for a in tensors.values())
    assert doc["path"] == str(path) and doc["format"] == "safetensors"
    assert doc["file_bytes"] == size and doc["files"] == [{"path": str(path), "bytes": size}]
    assert doc["bytes_by_category"] == {
        "weights": 24 + 6, "buffers": 8, "optimizer_state": 16, "gradients": 0,
        "activations": 0, "unused_storage": 0, "duplicates": 24, "graph": 0,
        "metadata": size - data, "other": 0}
    assert [(f["kind"], f["bytes"]) for f in doc["findings"]] == [
        ("fix_all", 40), ("duplicates", 24), ("optimizer_state", 16)]
    assert doc["unsafe_globals"] == [] and doc["notes"] == []
    assert doc["facts"] == {"path": str(path), "safetensors_format": "pt"}
    category = {"b.weight": "weights", "a.bias": "weights", "c.copy": "duplicates",
                "z.exp_avg": "optimizer_state", "step": "buffers"}
    assert doc["tensor_count"] == len(tensors)
    assert doc["tensors"] == [
        {"name": name, "dtype": str(tensors[name].dtype), "shape": list(tensors[name].shape),
         "nbytes": tensors[name].nbytes, "stored_nbytes": tensors[name].nbytes,
         "category": category[name], "storage": name, "tags": [],
         "duplicate_of": "b.weight" if name == "c.copy" else None}
        for name in _data_order(path)]


@pytest.mark.parametrize("top", [0, 1, 3, 4, 10])
def test_inspect_json_top_is_the_largest_ties_in_file_order(tmp_path: Path, top: int) -> None:
    path = tmp_path / "ties.safetensors"
    sizes = [3, 7, 7, 1, 7, 3, 5]
    safetensors_numpy.save_file({f"t{i}": np.zeros(n, np.float32) + i
                                 for i, n in enumerate(sizes)}, str(path))
    order = _data_order(path)
    expected = sorted(order, key=lambda name: -sizes[int(name[1:])])  # stable: file order
    proc = run_cli("inspect", str(path), "--json", "--top", str(top))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["tensor_count"] == len(sizes)
    assert [t["name"] for t in doc["tensors"]] == expected[:top]
    assert [t["nbytes"] for t in doc["tensors"]] == [
        4 * sizes[int(name[1:])] for name in expected[:top]]


def test_streamed_verification_refuses_bytes_no_tensor_claims(
        many: Many, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes after the last tensor's (the safetensors library: 'file not fully covered') fail
    the streamed verification by the loader's rules, read from the output's totals: the
    records of a verified output are never read (they were not kept: reading them failed)."""
    from modelsize.slimming.writers import base

    real_write = base.write_tensors

    def trailing(fh: Any, plan: Any, order: Any, meter: Any, written: Any) -> int:
        n = real_write(fh, plan, order, meter, written)
        fh.write(bytes(8))
        return n

    monkeypatch.setattr("modelsize.slimming.writers.safetensors.write_tensors", trailing)
    out = tmp_path / "out.safetensors"
    with pytest.raises(modelsize.errors.VerificationError, match="belong to no tensor"):
        modelsize.slim(many[0], out, to="safetensors")
    assert not out.exists()
