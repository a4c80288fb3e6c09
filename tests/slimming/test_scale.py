"""slim of a checkpoint of many tensors: memory that grows with the tensors, not with copies
of them (issue 18: a 1.2M-tensor safetensors took 64 s and 1.8 GB to slim, 12 s and 721 MB
to inspect).

The file is the hostile-sizes reproducer at 200k tensors (each two float32 values of its
own), written streamed. Each command runs in a fresh process whose own peak RSS (``VmHWM``)
is measured; the limits are generous guards against blow-ups, never timings: a slim must stay
under 1 GiB and within 96 MiB of what ``inspect`` of the same file peaks at (the input's
inventory is the one thing both must hold; before, slim held a plan, a writer layout, a
second inventory and a report object per tensor on top of it: +150 to +200 MiB here). The
margin was 64 MiB until inspect itself got leaner (issue 22: its peak here fell while slim's
writer stayed what it was, leaving slim 63-64 MiB above it, at the margin).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.formats.hostile_sizes import Run, make_safetensors_many, measure

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(),
                                reason="peak RSS is read from /proc")

COUNT = 200_000
GiB, MiB = 1 << 30, 1 << 20
#: A guard against hangs only.
HANG = 600
#: What slim may hold beyond what inspect holds for the same file.
MARGIN = 96 * MiB


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 200k-tensor file, and what inspect of it peaks at."""
    folder = tmp_path_factory.mktemp("many")
    return make_safetensors_many(folder, COUNT / 1_200_000)


@pytest.fixture(scope="module")
def inspect_peak(many: Path) -> int:
    run = _run("inspect", str(many))
    return run.maxrss


def _run(*args: str) -> Run:
    run = measure(list(args), HANG)
    assert not run.timed_out, f"no answer in {HANG} s: {args}"
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Traceback" not in run.stderr, run.stderr
    return run


def _values(path: Path) -> tuple[list[str], np.ndarray]:
    """The names and float32 values of a safetensors file of float32 tensors, read with the
    safetensors library's own rules (header JSON, offsets into the data)."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    data = np.frombuffer(raw[8 + n :], dtype="<f4")
    names = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    return names, data


@pytest.mark.parametrize("to", ["same", "safetensors"])
def test_slim_of_200k_tensors_stays_near_inspect(many: Path, inspect_peak: int, tmp_path: Path,
                                                 to: str) -> None:
    out = tmp_path / "out.safetensors"
    run = _run("slim", str(many), "-o", str(out), "--to", to)
    assert run.maxrss < GiB, f"slim peaked at {run.maxrss / MiB:.0f} MiB"
    assert run.maxrss < inspect_peak + MARGIN, (
        f"slim peaked at {run.maxrss / MiB:.0f} MiB, inspect at {inspect_peak / MiB:.0f} MiB")
    assert "Verified" in run.stdout
    names, data = _values(out)
    # Tensor w.i holds 2i and 2i + 1 (the generator's values), in input order.
    assert names == [f"w.{i}" for i in range(COUNT)]
    assert np.array_equal(data, np.arange(2 * COUNT, dtype="<f4"))


def test_slim_json_of_200k_tensors_lists_them_all(many: Path, inspect_peak: int,
                                                  tmp_path: Path) -> None:
    """``--json`` lists every kept tensor, written as it is made."""
    out = tmp_path / "out.safetensors"
    run = _run("slim", str(many), "-o", str(out), "--to", "safetensors", "--json")
    assert run.maxrss < inspect_peak + MARGIN, f"slim --json peaked at {run.maxrss / MiB:.0f} MiB"
    doc = json.loads(run.stdout)
    assert len(doc["kept"]) == COUNT and doc["verified"]
    assert doc["kept"][7] == {
        "name": "w.7", "source_name": "w.7", "dtype": "float32", "source_dtype": "float32",
        "shape": [2], "nbytes": 8, "crc32": _crc(np.array([14, 15], dtype="<f4")),
        "alias_of": None, "max_abs_error": None, "max_rel_error": None, "overflow": 0}


def _crc(values: np.ndarray) -> int:
    import zlib

    return zlib.crc32(values.tobytes())


def test_inspect_json_of_200k_tensors_is_streamed(many: Path, inspect_peak: int) -> None:
    """``inspect --json`` lists 200k tensors without holding them as dicts and text: 1.8 GB
    for 1.65M tensors before."""
    run = _run("inspect", str(many), "--json")
    assert run.maxrss < inspect_peak + MARGIN, (
        f"inspect --json peaked at {run.maxrss / MiB:.0f} MiB, the text report at "
        f"{inspect_peak / MiB:.0f} MiB")
    doc = json.loads(run.stdout)
    assert doc["tensor_count"] == COUNT == len(doc["tensors"])
    assert doc["tensors"][-1]["name"] == f"w.{COUNT - 1}"
