"""Resource bounds (issue 18 items 6, 7 and 27): hostile sizes answered within 1 GiB, inputs
their framework refuses refused in one line, outputs verified by the format's loading rules.

The hostile files are the reproducers of ``hostile_sizes.py``, written sparse or streamed (a
4 GiB deflate bomb costs a few MB); each is run through the CLI in a fresh process whose peak
RSS (its own ``VmHWM``) must stay under 1 GiB, with a generous timeout that only guards against
a hang (no timing is asserted: speed is ``benchmarks/hostile.py``'s business). The damaged
files of items 6 and 27 are made by the real framework (NumPy, Keras through the committed
fixtures or the TensorFlow venv) and then mutated.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import struct
import sys
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from modelsize.categories import Category
from modelsize.errors import CorruptFileError, LimitError, UsageError
from modelsize.formats import _limits, read
from modelsize.inventory import Charges, InventoryBuilder, StorageRecord, TensorRecord
from modelsize.slimming.loadable import problems_loading
from tests.conftest import REPO, assert_one_line_error, run_cli, run_in_tf
from tests.formats.hostile_sizes import (
    Run,
    make_keras_bomb_member,
    make_keras_bomb_metadata,
    make_keras_bomb_weights,
    make_keras_config_lists,
    make_npz_members,
    make_safetensors_header,
    make_safetensors_header_lists,
    make_safetensors_index,
    make_safetensors_many,
    make_torch_pickle_blob,
    make_torch_pickle_ops,
    measure,
)

GiB = 1 << 30
#: Only a hang fails on time: the slowest run here takes seconds.
HANG = 600
KERAS_FIXTURE = REPO / "tests" / "fixtures" / "keras" / "model.keras"

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(),
                                reason="peak RSS is read from /proc")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Make a reproducer once per module: ``hostile(make, scale)``."""
    folder = tmp_path_factory.mktemp("hostile")
    made: dict[tuple[str, float], Path] = {}

    def get(make: Callable[[Path, float], Path], scale: float = 1.0) -> Path:
        key = (make.__name__, scale)
        if key not in made:
            sub = folder / f"{make.__name__}-{scale}"
            sub.mkdir()
            made[key] = make(sub, scale)
        return made[key]

    return get


def _cli(*args: str, env: dict[str, str] | None = None) -> Run:
    run = measure(list(args), HANG, env=None if env is None else {**os.environ, **env})
    assert not run.timed_out, f"no answer in {HANG} s: {args}"
    assert run.maxrss < GiB, f"{args[0]} peaked at {run.maxrss / 2**20:.0f} MiB"
    assert "Traceback" not in run.stderr and "internal error" not in run.stderr, run.stderr
    return run


def _refused(run: Run, path: Path, *words: str) -> None:
    """Exit 2 with one line naming the file and each of ``words``."""
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert path.name in lines[0]
    for word in words:
        assert word in lines[0], lines[0]


# -- item 7: hostile sizes -----------------------------------------------------------------------


def test_keras_config_of_nested_lists(hostile: Callable[..., Path], tmp_path: Path) -> None:
    """63 MiB of ``[[],[],...]``: 1.7 GB before. Inspect notes the limit, slim refuses."""
    path = hostile(make_keras_config_lists)
    run = _cli("inspect", str(path), "--json")
    assert run.returncode == 0, run.stderr
    notes = json.loads(run.stdout)["notes"]
    assert any("MODELSIZE_MAX_JSON_BYTES" in n for n in notes), notes
    _refused(_cli("slim", str(path), "-o", str(tmp_path / "out.keras")), path,
             "MODELSIZE_MAX_JSON_BYTES")
    assert not (tmp_path / "out.keras").exists()


def test_data_pkl_of_opcodes_is_refused_by_its_budget(hostile: Callable[..., Path]) -> None:
    """A data.pkl of 96 MiB of opcodes and no tensor (1.4 GB and 30 s at 960 MiB before)."""
    path = hostile(make_torch_pickle_ops, 0.1)
    _refused(_cli("inspect", str(path)), path, "MODELSIZE_MAX_PICKLE_OPS")


def test_data_pkl_holding_a_large_bytes_object(hostile: Callable[..., Path]) -> None:
    """A stored data.pkl of 1.15 GiB, one bytes object: parsed in place (refused as more than
    modelsize reads whole before, and held in memory below that)."""
    path = hostile(make_torch_pickle_blob, 1.2)
    run = _cli("inspect", str(path))
    assert run.returncode == 0, run.stderr
    assert run.maxrss < GiB // 4


@pytest.mark.slow
def test_safetensors_header_of_660k_empty_tensors(hostile: Callable[..., Path]) -> None:
    """A legal 40 MB header (1.4 GB before; 99 MB: 3.4 GB and no answer in 60 s)."""
    path = hostile(make_safetensors_header, 0.4)
    run = _cli("inspect", str(path))
    assert run.returncode == 0, run.stderr
    assert re.search(r"of 660,?000\b", run.stdout), run.stdout[:1500]


def test_safetensors_header_of_nested_lists(hostile: Callable[..., Path]) -> None:
    """99 MB of nested lists in a tensor's shape: 2.5 GB before, refused unparsed now."""
    path = hostile(make_safetensors_header_lists)
    _refused(_cli("inspect", str(path)), path, "arrays and objects")


@pytest.mark.slow
def test_index_larger_than_the_json_limit(hostile: Callable[..., Path]) -> None:
    """A 99 MB index of 2.2M names: refused at its size; read within 1 GiB when allowed."""
    path = hostile(make_safetensors_index)
    _refused(_cli("inspect", str(path)), path, "MODELSIZE_MAX_JSON_BYTES")
    run = _cli("inspect", str(path), env={"MODELSIZE_MAX_JSON_BYTES": "200MB"})
    _refused(run, path, "holds no such tensor")


@pytest.mark.slow
def test_600k_tensor_safetensors_inspects_within_bounds(hostile: Callable[..., Path]) -> None:
    """A legal file of 600k tensors (55 s and 2.8 GB for 1.2M before)."""
    path = hostile(make_safetensors_many, 0.5)
    run = _cli("inspect", str(path))
    assert run.returncode == 0, run.stderr
    assert re.search(r"of 600,?000\b", run.stdout), run.stdout[:1500]


@pytest.mark.slow
def test_npz_of_200k_members(hostile: Callable[..., Path], tmp_path: Path) -> None:
    """200k members: no answer in 60 s (and 1.2 GB for slim) before. A quarter of them here
    (the suite's time); the whole 200k are measured by benchmarks/hostile.py."""
    path = hostile(make_npz_members, 0.25)
    run = _cli("inspect", str(path))
    assert run.returncode == 0, run.stderr
    out = tmp_path / "out.npz"
    run = _cli("slim", str(path), "-o", str(out), "--dedupe")
    assert run.returncode == 0, run.stderr
    with np.load(out) as z:
        assert len(z.files) == 50_000
        assert z["a49999"].tolist() == [49999.0, -49999.0]


def test_keras_deflate_bomb_member_is_copied_not_inflated(hostile: Callable[..., Path],
                                                          tmp_path: Path) -> None:
    """An asset deflated from 2 GiB: slim copies it as it is (it wrote 2 GiB before)."""
    path = hostile(make_keras_bomb_member, 0.5)
    out = tmp_path / "out.keras"
    run = _cli("slim", str(path), "-o", str(out))
    assert run.returncode == 0, run.stderr
    assert out.stat().st_size < 2 * path.stat().st_size
    with zipfile.ZipFile(out) as zf:
        info = zf.getinfo("assets/zeros.bin")
        assert (info.compress_type, info.file_size) == (zipfile.ZIP_DEFLATED, 1 << 31)


@pytest.mark.parametrize("make", [make_keras_bomb_metadata, make_keras_bomb_weights],
                         ids=["metadata", "weights"])
def test_keras_deflate_bombs_read_by_modelsize_are_refused(
        hostile: Callable[..., Path], make: Callable[[Path, float], Path]) -> None:
    """metadata.json or model.weights.h5 deflated from 2 GiB: modelsize would have to inflate
    them (it did: 23 s, or 47 s and an internal error): refused by the inflate limit."""
    path = hostile(make, 0.5)
    _refused(_cli("inspect", str(path)), path, "MODELSIZE_MAX_INFLATE_BYTES")


# -- limits and their variables ------------------------------------------------------------------


def test_limits_are_raised_by_their_variables(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "w.safetensors"
    header = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    monkeypatch.setenv("MODELSIZE_MAX_HEADER_BYTES", "16")
    with pytest.raises(LimitError, match="MODELSIZE_MAX_HEADER_BYTES") as err:
        read(path)
    assert err.value.env == "MODELSIZE_MAX_HEADER_BYTES"
    monkeypatch.setenv("MODELSIZE_MAX_HEADER_BYTES", "1KiB")
    assert len(read(path).tensors) == 1
    monkeypatch.setenv("MODELSIZE_MAX_HEADER_BYTES", "lots")
    with pytest.raises(UsageError, match="MODELSIZE_MAX_HEADER_BYTES"):
        read(path)
    assert {limit.env for limit in _limits.LIMITS} >= {
        "MODELSIZE_MAX_HEADER_BYTES", "MODELSIZE_MAX_JSON_BYTES", "MODELSIZE_MAX_INFLATE_BYTES",
        "MODELSIZE_MAX_READ_BYTES", "MODELSIZE_MAX_MEMORY_BYTES", "MODELSIZE_MAX_PICKLE_OPS"}


def _list_pickle(path: Path, items: int) -> Path:
    """A pickle of one list of ``items`` empty lists (two opcodes each): nothing real in it."""
    path.write_bytes(b"\x80\x02]" + b"]a" * items + b".")
    return path


@pytest.mark.parametrize(("env", "value"), [("MODELSIZE_MAX_PICKLE_OPS", "1000"),
                                            ("MODELSIZE_MAX_MEMORY_BYTES", "1MB")])
def test_pickle_parse_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: str,
                             value: str) -> None:
    """A pickle's opcodes and the memory they build are bounded, each by its variable."""
    path = _list_pickle(tmp_path / "lists.pkl", 600_000)
    assert len(read(path).tensors) == 0  # within the defaults
    monkeypatch.setenv(env, value)
    with pytest.raises(LimitError, match=env):
        read(path)


def test_header_length_past_the_file_is_corrupt_not_a_limit(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 2**62) + b'{"w": 1}')
    with pytest.raises(CorruptFileError, match="claims bytes"):
        read(path)


# -- compact records ---------------------------------------------------------------------------


def test_records_are_slotted_and_frozen(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(16))
    b = InventoryBuilder("test", [path])
    b.add_storage("s", 0, 16, dtype="float32")
    b.add_tensor("t", "float32", [2, 2], Category.WEIGHTS, storage="s")
    inv = b.build()
    t, st = inv.tensors[0], inv.storages[0]
    assert type(t) is TensorRecord and type(st) is StorageRecord
    assert not hasattr(t, "__dict__") and not hasattr(st, "__dict__")
    with pytest.raises(AttributeError):
        t.name = "u"  # type: ignore[misc]
    assert (t.stored_nbytes, t.shape) == (16, (2, 2))
    assert isinstance(st.bytes_by_category, Charges)
    assert dict(st.bytes_by_category) == {t.category: 16} == st.bytes_by_category
    assert t == TensorRecord("t", "float32", (2, 2), t.category, 16, 16, "s")


# -- item 6: a dtype NumPy cannot make ------------------------------------------------------------


def _npy_with_descr(descr: str) -> bytes:
    """An empty ``<U1`` array saved by NumPy, its header then given ``descr`` (the header's
    padding absorbs the longer text, as a hand edit would)."""
    buf = io.BytesIO()
    np.save(buf, np.array([], dtype="<U1"))
    raw = buf.getvalue()
    (length,) = struct.unpack_from("<H", raw, 8)
    text = raw[10 : 10 + length].decode("latin1").replace("'<U1'", repr(descr))
    text = text.rstrip(" \n")
    text = text + " " * (length - 1 - len(text)) + "\n"
    assert len(text) == length
    return raw[:10] + text.encode("latin1") + raw[10 + length :]


@pytest.mark.parametrize("deflate", [False, True], ids=["stored", "deflated"])
def test_npz_member_of_an_impossible_dtype_is_refused(tmp_path: Path, deflate: bool) -> None:
    """``<U99999999999`` with 0 elements: NumPy cannot make the dtype; it was "Verified"."""
    member = _npy_with_descr("<U99999999999")
    with pytest.raises((TypeError, ValueError)):
        np.load(io.BytesIO(member))
    path = tmp_path / "bad.npz"
    method = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", method) as zf:
        buf = io.BytesIO()
        np.save(buf, np.arange(4, dtype="<f4"))
        zf.writestr("ok.npy", buf.getvalue())
        zf.writestr("w.npy", member)
    proc = run_cli("inspect", str(path))
    assert_one_line_error(proc, path)
    assert "item size" in proc.stderr
    proc = run_cli("slim", str(path), "-o", str(tmp_path / "out.npz"))
    assert_one_line_error(proc, path)
    assert not (tmp_path / "out.npz").exists()


# -- item 27: what the mutation fuzz of slim found -------------------------------------------------


def _keras_copy(tmp_path: Path) -> Path:
    path = tmp_path / "model.keras"
    shutil.copy(KERAS_FIXTURE, path)
    path.chmod(0o644)
    return path


def _slim_refused(path: Path, tmp_path: Path, *words: str, cast: str = "") -> None:
    out = tmp_path / f"out{path.suffix}"
    proc = run_cli("slim", str(path), "-o", str(out), *(["--cast", cast] if cast else []))
    assert_one_line_error(proc, path)
    for word in words:
        assert word in proc.stderr, proc.stderr
    assert not out.exists()


def test_keras_with_two_metadata_members(tmp_path: Path) -> None:
    """Keras wrote it; a second, longer metadata.json appended: an internal error before."""
    path = _keras_copy(tmp_path)
    with zipfile.ZipFile(path, "a") as zf, pytest.warns(UserWarning, match="Duplicate name"):
        zf.writestr("metadata.json", b'{"keras_version": "3.15.1", "note": "a second one"}')
    _slim_refused(path, tmp_path, "metadata.json", "twice")


def _patch_weights(path: Path, at: int, old: int, new: int) -> None:
    """Set byte ``at`` of the archive's (stored) model.weights.h5 member from ``old``."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("model.weights.h5")
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    pos = info.header_offset + 30 + name_len + extra_len + at
    assert raw[pos] == old
    raw[pos] = new
    path.write_bytes(bytes(raw))
    _fix_crc(path, "model.weights.h5")


def _fix_crc(path: Path, member: str) -> None:
    """Record the member's CRC-32 as it now is (the damage is inside the HDF5 file, not in
    the archive)."""
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member)
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    crc = zlib.crc32(raw[start : start + info.compress_size])
    struct.pack_into("<I", raw, info.header_offset + 14, crc)
    at = raw.find(b"PK\x01\x02")
    while at >= 0:
        n = struct.unpack_from("<H", raw, at + 28)[0]
        if raw[at + 46 : at + 46 + n] == member.encode():
            struct.pack_into("<I", raw, at + 16, crc)
        at = raw.find(b"PK\x01\x02", at + 4)
    path.write_bytes(bytes(raw))


def _h5_offset(path: Path, needle: bytes) -> int:
    with zipfile.ZipFile(path) as zf:
        data = zf.read("model.weights.h5")
    at = data.find(needle)
    assert at >= 0
    return at


def test_keras_weights_with_a_damaged_global_heap(tmp_path: Path) -> None:
    """The heap's version byte damaged: h5py's "Can't synchronously read data" escaped from
    the writer as an internal error. Keras itself loads the file (it never reads the attribute
    the heap holds), and so does inspect; slim, which copies every attribute, cannot."""
    path = _keras_copy(tmp_path)
    at = _h5_offset(path, b"GCOL") + 4
    _patch_weights(path, at, 1, 0x41)
    _slim_refused(path, tmp_path, "h5py cannot read it", "global heap")
    assert run_cli("inspect", str(path)).returncode == 0


def test_keras_weights_h5py_cannot_read(tmp_path: Path) -> None:
    """An undefined address made defined (found by the fuzz): h5py's RuntimeError escaped."""
    path = _keras_copy(tmp_path)
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("model.weights.h5")
    raw = path.read_bytes()
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    # Byte 11312 of the committed fixture (6086 of its HDF5 member), as the fuzz hit it.
    _patch_weights(path, 11312 - (info.header_offset + 30 + name_len + extra_len), 0xFF, 0x28)
    _slim_refused(path, tmp_path, "h5py cannot read it")


def _moved_group(tmp_path: Path) -> Path:
    """Keras's file with one layer's group renamed by h5py (``layers/dense_1`` to
    ``layers/dense_7``): no layer of the config accounts for it any more."""
    import h5py

    path = tmp_path / "moved.keras"
    with zipfile.ZipFile(KERAS_FIXTURE) as zf:
        items = [(i.filename, zf.read(i)) for i in zf.infolist()]
    weights = io.BytesIO(dict(items)["model.weights.h5"])
    with h5py.File(weights, "a") as f:
        f.move("layers/dense_1", "layers/dense_7")
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in items:
            zf.writestr(name, weights.getvalue() if name == "model.weights.h5" else data)
    return path


def test_keras_weights_of_layers_the_config_lacks(tmp_path: Path) -> None:
    """Keras cannot load it ("1 objects could not be loaded"); slim "Verified" a copy."""
    path = _moved_group(tmp_path)
    _slim_refused(path, tmp_path, "dense_7", "config.json")
    run = run_cli("inspect", str(path), "--json")
    assert run.returncode == 0
    assert any("dense_7" in n for n in json.loads(run.stdout)["notes"])


def test_keras_refuses_the_input_slim_refuses(tmp_path: Path) -> None:
    """The renamed group, loaded by Keras itself (TensorFlow venv): it refuses the file."""
    path = _moved_group(tmp_path)
    code = (
        "import sys, keras\n"
        "try:\n"
        "    keras.saving.load_model(sys.argv[1], compile=False)\n"
        "    print('loaded')\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    out = run_in_tf(code, str(path)).stdout
    assert "refused:" in out and "could not be loaded" in out, out


def test_deflated_npz_member_shorter_than_its_header(tmp_path: Path) -> None:
    """Saved by np.savez_compressed, its member's stream then cut by 4 bytes of data while the
    archive still claims them (as a damaged stream that ends early does): "internal error:
    decoded storage ended 4 bytes early" before; np.load refuses it too."""
    src = tmp_path / "src.npz"
    np.savez_compressed(src, w=np.arange(128, dtype="<f4"))
    with zipfile.ZipFile(src) as zf:
        member = zf.read("w.npy")
    path = tmp_path / "short.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("w.npy", member[:-4])
    raw = bytearray(path.read_bytes())
    struct.pack_into("<I", raw, 22, len(member))  # the local header's uncompressed size
    central = raw.find(b"PK\x01\x02")
    struct.pack_into("<I", raw, central + 24, len(member))
    path.write_bytes(bytes(raw))
    with pytest.raises((ValueError, zipfile.BadZipFile)), np.load(path) as z:
        z["w"]
    # Every member is read through as np.load reads it, whatever slim writes (a copy when
    # there is nothing to slim: copied byte for byte, exit 0, before; a cast).
    _slim_refused(path, tmp_path, "w.npy", f"inflates to {len(member) - 4} bytes")
    _slim_refused(path, tmp_path, "w.npy", f"inflates to {len(member) - 4} bytes",
                  cast="float16")


def test_verification_applies_the_loaders_rules(tmp_path: Path) -> None:
    """An output numpy or Keras would refuse is a verification problem, not "Verified"."""
    ok = tmp_path / "ok.npz"
    np.savez(ok, w=np.arange(3, dtype="<f4"))
    assert problems_loading(read(ok)) == []
    # An inventory read before the damage, checked against the file after it: what an output
    # written wrong would look like to verification.
    inv = read(ok)
    with zipfile.ZipFile(ok) as zf:
        data = zf.read("w.npy")
    with zipfile.ZipFile(ok, "w") as zf:
        zf.writestr("w.npy", data.replace(b"'<f4'", b"'<f3'"))
    problems = problems_loading(inv)
    assert problems and "NumPy cannot read its header" in problems[0], problems
    keras = _keras_copy(tmp_path)
    kinv = read(keras)
    assert problems_loading(kinv) == []
    with zipfile.ZipFile(keras) as zf:
        items = [(i.filename, zf.read(i)) for i in zf.infolist()]
    with zipfile.ZipFile(keras, "w") as zf:
        for name, data in items:
            zf.writestr(name, b"[1, 2" if name == "config.json" else data)
    assert any("config.json is not valid JSON" in p for p in problems_loading(kinv))


def test_hostile_sizes_module_runs_as_a_script(tmp_path: Path) -> None:
    """``hostile_sizes.py DIR`` writes the reproducers (the benchmark's way in)."""
    import subprocess

    script = Path(__file__).with_name("hostile_sizes.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), "--scale", "0.001",
                           "--only", "npz-200k"], capture_output=True, text=True, timeout=HANG)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["case"] == "npz-200k"


@pytest.mark.parametrize("name", ["lying.pt", "lying.npz", "lying.keras"])
def test_a_central_directory_size_that_lies_reads_no_more_than_its_records(
        tmp_path: Path, name: str) -> None:
    """A 3 GiB sparse file whose end record claims a 3 GiB central directory: zipfile reads
    the claimed size whole (3 GiB of RSS before its first record fails); modelsize reads the
    directory as it walks it, so the first bad record ends it in one line."""
    path = tmp_path / name
    n = 3 * GiB
    with open(path, "wb") as fh:
        fh.write(b"PK\x03\x04" + bytes(26))
        fh.truncate(n - 22)
        fh.seek(n - 22)
        fh.write(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 1, 1, n - 22, 0, 0))
    run = _cli("inspect", str(path))
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert run.maxrss < GiB // 4, f"peaked at {run.maxrss / 2**20:.0f} MiB"
