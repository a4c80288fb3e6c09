"""Damaged archives and paths that are not files: one clear line, exit 2, never a hang.

Zip members that modelsize reads or charges to ``graph``/``metadata`` are checked against
their CRC-32; each damaged file here is first shown to be damaged by :mod:`zipfile`'s own
check (``testzip``), independently of modelsize. Named pipes, devices and sockets are refused
before anything opens them; those tests run the CLI in a subprocess with a timeout, so a
regression fails instead of hanging the suite.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import stat
import struct
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest

from modelsize.errors import CorruptFileError, InputError
from modelsize.formats import read
from tests.conftest import REPO, assert_one_line_error, run_cli

KERAS = REPO / "tests" / "fixtures" / "keras"
#: A refused special path answers at once; this only bounds a regression.
HANG_LIMIT = 60

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")


# -- zip surgery, done with struct and zipfile, not with modelsize ---------------------------


def _data_range(path: Path, member: str) -> tuple[int, int]:
    """Where a member's (compressed) bytes lie, from its local header."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member)
    raw = path.read_bytes()
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    return start, start + info.compress_size


def _patch_member(path: Path, member: str, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (same length) inside a stored member's bytes."""
    assert len(old) == len(new)
    start, stop = _data_range(path, member)
    raw = bytearray(path.read_bytes())
    at = raw.find(old, start, stop)
    assert at >= 0, (member, old)
    raw[at : at + len(old)] = new
    path.write_bytes(bytes(raw))


def _flip_central_crc(path: Path, member: str) -> None:
    """Change the CRC-32 the central directory records for ``member``."""
    raw = bytearray(path.read_bytes())
    name = member.encode()
    at = raw.find(b"PK\x01\x02")
    while raw[at + 46 : at + 46 + len(name)] != name or raw[at + 28] != len(name):
        at = raw.find(b"PK\x01\x02", at + 4)
        assert at >= 0, member
    crc = struct.unpack_from("<I", raw, at + 16)[0]
    struct.pack_into("<I", raw, at + 16, crc ^ 0x5A5A)
    path.write_bytes(bytes(raw))


def _damaged_member(path: Path) -> str | None:
    with zipfile.ZipFile(path) as zf:
        try:
            return zf.testzip()
        except zipfile.BadZipFile:  # a deflate stream broken past inflating
            return "<does not inflate>"


def _assert_refused(path: Path, member: str) -> None:
    with pytest.raises(CorruptFileError, match=r"corrupted|does not inflate|inflates to") as err:
        read(path)
    assert repr(member) in str(err.value)
    proc = run_cli("inspect", str(path))
    assert_one_line_error(proc, path)
    assert member in proc.stderr


def _rezip(src: Path, dst: Path, deflate: bool = True) -> None:
    """Copy an archive, deflating every member but tensor storages (a hand-made re-zip)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            storage = "/data/" in info.filename and not info.filename.endswith(".pkl")
            method = zipfile.ZIP_DEFLATED if deflate and not storage else zipfile.ZIP_STORED
            zout.writestr(info.filename, zin.read(info), compress_type=method)


# -- PyTorch zip -----------------------------------------------------------------------------


def _torch_file(tmp_path: Path, name: str = "model.pt") -> Path:
    torch = pytest.importorskip("torch")
    path = tmp_path / name
    torch.save({"weight": torch.arange(6.0), "bias": torch.zeros(2)}, path)
    return path


def test_torch_data_pkl_with_one_byte_changed(tmp_path: Path) -> None:
    path = _torch_file(tmp_path)
    member = "model/data.pkl"
    read(path)  # healthy before
    # Same length and still a valid pickle: only the CRC can tell ('weight' -> 'weighu').
    _patch_member(path, member, b"weight", b"weighu")
    assert _damaged_member(path) == member
    _assert_refused(path, member)


def test_torch_small_record_with_one_byte_changed(tmp_path: Path) -> None:
    path = _torch_file(tmp_path)
    with zipfile.ZipFile(path) as zf:
        version = zf.read("model/version")
    _patch_member(path, "model/version", version[:1], b"9" if version[:1] != b"9" else b"8")
    assert _damaged_member(path) == "model/version"
    _assert_refused(path, "model/version")


def test_torch_tensor_payload_is_not_read(tmp_path: Path) -> None:
    """A damaged storage is tensor data: never read by inspect, so not checked."""
    path = _torch_file(tmp_path)
    start, _ = _data_range(path, "model/data/0")
    raw = bytearray(path.read_bytes())
    raw[start] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert _damaged_member(path) == "model/data/0"
    inv = read(path)
    assert {t.name for t in inv.tensors} == {"weight", "bias"}


def test_torch_archive_without_crcs_is_read_with_a_note(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.serialization import config

    path = tmp_path / "nocrc.pt"
    saved = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        torch.save({"weight": torch.arange(6.0)}, path)
    finally:
        config.save.compute_crc32 = saved
    with zipfile.ZipFile(path) as zf:
        assert {i.CRC for i in zf.infolist()} == {0}
    assert torch.load(path, weights_only=True)["weight"].tolist() == list(range(6))
    inv = read(path)
    assert [t.name for t in inv.tensors] == ["weight"]
    assert any("records no CRC-32" in n for n in inv.notes)


def test_deflated_torch_pickle_with_a_wrong_crc(tmp_path: Path) -> None:
    src = _torch_file(tmp_path, "src.pt")
    path = tmp_path / "deflated.pt"
    _rezip(src, path)
    healthy = read(path)
    assert {t.name for t in healthy.tensors} == {"weight", "bias"}
    _flip_central_crc(path, "src/data.pkl")
    assert _damaged_member(path) == "src/data.pkl"
    _assert_refused(path, "src/data.pkl")


def _scripted_with_extra(tmp_path: Path) -> Path:
    """A TorchScript archive with a 3 MB extra file (metadata, checked in several chunks)."""
    torch = pytest.importorskip("torch")
    path = tmp_path / "scripted.pt"
    text = random.Random(0).randbytes(3 << 19).hex().encode()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit is deprecated, not gone
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path),
                       _extra_files={"notes.txt": text})
    out = tmp_path / "scripted_deflated.pt"
    _rezip(path, out)
    return out


def test_deflated_metadata_member_is_checked_in_chunks(tmp_path: Path) -> None:
    path = _scripted_with_extra(tmp_path)
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("scripted/extra/notes.txt")
    assert info.compress_type == zipfile.ZIP_DEFLATED and info.file_size > 2 << 20
    inv = read(path)
    assert inv.file_bytes == path.stat().st_size
    _flip_central_crc(path, "scripted/extra/notes.txt")
    assert _damaged_member(path) == "scripted/extra/notes.txt"
    _assert_refused(path, "scripted/extra/notes.txt")


def test_deflated_member_with_a_broken_stream(tmp_path: Path) -> None:
    path = _scripted_with_extra(tmp_path)
    member = "scripted/extra/notes.txt"
    start, stop = _data_range(path, member)
    raw = bytearray(path.read_bytes())
    for at in range(start + (stop - start) // 2, start + (stop - start) // 2 + 64):
        raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert _damaged_member(path) is not None
    _assert_refused(path, member)


# -- Keras -----------------------------------------------------------------------------------


def _keras_copy(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    shutil.copy(KERAS / name, path)
    path.chmod(0o644)
    return path


def test_keras_config_json_with_one_byte_changed(tmp_path: Path) -> None:
    path = _keras_copy(tmp_path, "model.keras")
    read(path)
    # Still valid JSON naming a real class: only the CRC can tell.
    _patch_member(path, "config.json", b'"Functional"', b'"Functionam"')
    assert _damaged_member(path) == "config.json"
    _assert_refused(path, "config.json")


def test_keras_metadata_json_with_one_byte_changed(tmp_path: Path) -> None:
    path = _keras_copy(tmp_path, "model.keras")
    _patch_member(path, "metadata.json", b"keras_version", b"keras_versiom")
    assert _damaged_member(path) == "metadata.json"
    _assert_refused(path, "metadata.json")


def test_deflated_keras_config_with_a_wrong_crc(tmp_path: Path) -> None:
    path = _keras_copy(tmp_path, "model_deflated.keras")
    read(path)
    _flip_central_crc(path, "config.json")
    assert _damaged_member(path) == "config.json"
    _assert_refused(path, "config.json")


# -- NumPy -----------------------------------------------------------------------------------


@pytest.mark.parametrize("compressed", [False, True], ids=["stored", "deflated"])
def test_npz_object_array_read_whole_is_checked(tmp_path: Path, compressed: bool) -> None:
    np = pytest.importorskip("numpy")
    path = tmp_path / "objects.npz"
    arr = np.array(["hello world", 3], dtype=object)
    (np.savez_compressed if compressed else np.savez)(path, a=arr, b=np.zeros(3))
    read(path)
    if compressed:
        _flip_central_crc(path, "a.npy")
    else:
        _patch_member(path, "a.npy", b"hello world", b"hello worle")
    assert _damaged_member(path) == "a.npy"
    _assert_refused(path, "a.npy")


# -- paths that are not files ----------------------------------------------------------------


def _inspect(path: Path | str) -> subprocess.CompletedProcess[str]:
    """The CLI in a subprocess with a short timeout: a hang fails the test, not the suite."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "modelsize", "inspect", str(path)],
            capture_output=True, text=True, timeout=HANG_LIMIT,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"modelsize inspect {path} hung")


def _assert_not_a_file(proc: subprocess.CompletedProcess[str], path: Path | str,
                       what: str) -> None:
    assert_one_line_error(proc, path)
    assert f"is {what}, not a model file" in proc.stderr


@needs_fifo
def test_fifo_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "model.pt"
    os.mkfifo(fifo)
    _assert_not_a_file(_inspect(fifo), fifo, "a named pipe (FIFO)")


@needs_fifo
def test_symlink_to_a_fifo_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = tmp_path / "model.safetensors"
    link.symlink_to(fifo)
    _assert_not_a_file(_inspect(link), link, "a named pipe (FIFO)")


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_character_devices_are_refused(device: str) -> None:
    if not os.path.exists(device):
        pytest.skip(f"no {device} here")
    _assert_not_a_file(_inspect(device), device, "a character device")
    with pytest.raises(InputError, match="character device"):
        read(device)


@pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="no Unix sockets here")
def test_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
    except OSError as exc:  # a tmp path longer than sun_path allows
        pytest.skip(f"cannot bind a socket in {tmp_path}: {exc}")
    try:
        _assert_not_a_file(_inspect(path), path, "a socket")
        with pytest.raises(InputError, match="socket"):
            read(path)
    finally:
        sock.close()


@needs_fifo
@pytest.mark.parametrize(
    "shard",
    ["model.safetensors", "pytorch_model.bin", "global_step1/mp_rank_00_model_states.pt"],
)
def test_directory_holding_a_fifo_named_like_a_shard(tmp_path: Path, shard: str) -> None:
    model = tmp_path / "model"
    (model / shard).parent.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "gpt2"}')
    os.mkfifo(model / shard)
    proc = _inspect(model)
    _assert_not_a_file(proc, model / shard, "a named pipe (FIFO)")
    assert shard in proc.stderr


@needs_fifo
def test_fifo_beside_a_real_shard_is_not_passed_over(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    model = tmp_path / "model"
    model.mkdir()
    st.save_file({"a": torch.zeros(4)}, str(model / "model-00001-of-00002.safetensors"))
    os.mkfifo(model / "model-00002-of-00002.safetensors")
    _assert_not_a_file(_inspect(model), model / "model-00002-of-00002.safetensors",
                       "a named pipe (FIFO)")


def test_symlink_to_a_regular_file_still_works(tmp_path: Path) -> None:
    path = _torch_file(tmp_path)
    link = tmp_path / "link.pt"
    link.symlink_to(path)
    inv = read(link)
    assert {t.name for t in inv.tensors} == {"weight", "bias"}
    folder = tmp_path / "linked"
    folder.mkdir()
    (folder / "pytorch_model.bin").symlink_to(path)
    assert {t.name for t in read(folder).tensors} == {"weight", "bias"}


@needs_fifo
def test_load_cost_refuses_a_fifo_before_any_child(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    from modelsize.loadcost import measure_load_cost

    path = tmp_path / "a.npy"
    np.save(path, np.zeros(3))
    inv = read(path)
    path.unlink()
    os.mkfifo(path)  # swapped after inspect: no child may wait on it
    with pytest.raises(InputError, match="named pipe"):
        measure_load_cost(inv, timeout=5)


@needs_fifo
@pytest.mark.parametrize("index", ["model.safetensors.index.json", "pytorch_model.bin.index.json"])
def test_index_naming_a_fifo_shard(tmp_path: Path, index: str) -> None:
    import json

    torch = pytest.importorskip("torch")
    model = tmp_path / "model"
    model.mkdir()
    ext = ".safetensors" if index.startswith("model.") else ".bin"
    first, second = f"model-00001-of-00002{ext}", f"model-00002-of-00002{ext}"
    if ext == ".safetensors":
        st = pytest.importorskip("safetensors.torch")
        st.save_file({"a": torch.zeros(4)}, str(model / first))
    else:
        torch.save({"a": torch.zeros(4)}, model / first)
    os.mkfifo(model / second)
    weight_map = {"a": first, "b": second}
    (model / index).write_text(json.dumps({"metadata": {"total_size": 32},
                                           "weight_map": weight_map}))
    _assert_not_a_file(_inspect(model / index), model / second, "a named pipe (FIFO)")


@needs_fifo
def test_slim_never_replaces_a_fifo_even_with_force(tmp_path: Path) -> None:
    src = _torch_file(tmp_path)
    out = tmp_path / "out.pt"
    os.mkfifo(out)
    proc = run_cli("slim", str(src), "-o", str(out), "--force")
    assert_one_line_error(proc, out)
    assert "is a named pipe (FIFO)" in proc.stderr
    assert stat.S_ISFIFO(os.stat(out).st_mode)
