"""PyTorch checkpoints in the pre-zip format, written by real torch."""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
import tarfile
import warnings
from pathlib import Path
from typing import Any

import pytest

from modelsize.categories import Category
from modelsize.errors import CorruptFileError, UnknownFormatError
from modelsize.formats import read
from modelsize.formats.torch_legacy import MAGIC_NUMBER
from tests.conftest import assert_one_line_error, by_cat, nbytes, run_cli

torch = pytest.importorskip("torch")
nn = torch.nn


def save_legacy(obj: Any, path: Path) -> None:
    with warnings.catch_warnings():
        # torch warns when it cannot find a pickled module class's source; harmless here.
        warnings.simplefilter("ignore", UserWarning)
        torch.save(obj, path, _use_new_zipfile_serialization=False)


def pickles_end(data: bytes) -> int:
    """Offset just after the fifth pickle (the storage keys), found by pickletools."""
    stream = io.BytesIO(data)
    for _ in range(5):
        for _op in pickletools.genops(stream):
            pass
    return stream.tell()


class Cached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.cache: Any = None

    def forward(self, x: Any) -> Any:
        self.cache = self.fc(x).detach()
        return self.cache


def test_legacy_training_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    path = tmp_path / "legacy.pt"
    save_legacy({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}, path)

    inv = read(path)
    assert inv.format == "pytorch-legacy"
    cats = by_cat(inv)
    slots = [v for s in opt.state_dict()["state"].values() for v in s.values()]
    assert cats["weights"] == nbytes(*model.parameters())
    assert cats["buffers"] == nbytes(*model.buffers())
    assert cats["optimizer_state"] == nbytes(*slots)
    assert inv.file_bytes == path.stat().st_size == sum(cats.values())
    # Every byte after the pickles is a storage or its 8-byte element count.
    n_storages = len(inv.storages)
    tail = path.stat().st_size - pickles_end(path.read_bytes())
    assert tail == 8 * n_storages + sum(s.nbytes for s in inv.storages)
    assert inv.facts["optimizer"] == "Adam/AdamW"
    assert inv.unsafe_globals == ()


def test_legacy_slice_leaves_unused_storage(tmp_path: Path) -> None:
    big = torch.arange(100, dtype=torch.float64)
    path = tmp_path / "slice.pt"
    save_legacy(big[:10], path)
    cats = by_cat(read(path))
    assert cats["unused_storage"] == 90 * 8
    assert cats["weights"] == 10 * 8


def test_legacy_pickled_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Cached()
    net(torch.randn(2, 3))
    path = tmp_path / "module.pt"
    save_legacy(net, path)
    inv = read(path)
    cats = by_cat(inv)
    assert cats["weights"] == nbytes(*net.parameters())
    assert cats["activations"] == nbytes(net.cache)
    assert cats["graph"] > 0
    assert inv.unsafe_globals == (f"{__name__}.Cached",)
    assert {t.name: t.category for t in inv.tensors} == {
        "fc.weight": Category.WEIGHTS,
        "fc.bias": Category.WEIGHTS,
        "cache": Category.ACTIVATIONS,
    }


def test_legacy_numel_larger_than_file(tmp_path: Path) -> None:
    path = tmp_path / "lying.pt"
    save_legacy({"w": torch.ones(4)}, path)
    data = bytearray(path.read_bytes())
    start = pickles_end(bytes(data))
    assert struct.unpack_from("<q", data, start)[0] == 4
    struct.pack_into("<q", data, start, 1 << 40)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match="declared with 4 elements but its data says"):
        read(path)
    assert_one_line_error(run_cli("inspect", str(path)), path)


def test_legacy_declared_storage_past_end(tmp_path: Path) -> None:
    path = tmp_path / "short.pt"
    save_legacy({"w": torch.ones(64)}, path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CorruptFileError, match="claims bytes"):
        read(path)
    assert_one_line_error(run_cli("inspect", str(path)), path)


def test_legacy_truncated_in_pickles(tmp_path: Path) -> None:
    path = tmp_path / "cut.pt"
    save_legacy({"w": torch.ones(4), "name": "x" * 200}, path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CorruptFileError, match="object pickle"):
        read(path)
    assert_one_line_error(run_cli("inspect", str(path)), path)


def test_legacy_wrong_protocol_version(tmp_path: Path) -> None:
    path = tmp_path / "proto.pt"
    body = pickle.dumps(MAGIC_NUMBER, protocol=2) + pickle.dumps(7, protocol=2)
    path.write_bytes(body + pickle.dumps({}, protocol=2) * 3)
    with pytest.raises(CorruptFileError, match="protocol version is 7, expected 1001"):
        read(path)


def test_legacy_object_pickle_that_calls_a_dict_is_refused(tmp_path: Path) -> None:
    # found by a fuzz campaign: one byte made a REDUCE call a dict; every load fails, and slim
    # wrote the file on as a verified copy
    path = tmp_path / "calls_a_dict.pt"
    head = pickle.dumps(MAGIC_NUMBER, protocol=2) + pickle.dumps(1001, protocol=2)
    head += pickle.dumps({"protocol_version": 1001, "little_endian": True}, protocol=2)
    path.write_bytes(head + b"\x80\x02}q\x00)R." + pickle.dumps([], protocol=2))
    with pytest.raises(TypeError, match="'dict' object is not callable"):
        torch.load(path, weights_only=False)
    with pytest.raises(CorruptFileError, match="REDUCE calls a dict, which is not callable"):
        read(path)
    assert_one_line_error(run_cli("inspect", str(path)), path)


@pytest.mark.parametrize("values", [5, 7])
def test_legacy_storage_id_of_other_than_six_values_is_refused(tmp_path: Path,
                                                               values: int) -> None:
    # found by a fuzz campaign: torch unpacks exactly five values after "storage"
    class Ids(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            if isinstance(obj, bytes):
                return ("storage", torch.FloatStorage, "0", "cpu", 1, None, None)[:values]
            return None

    body = io.BytesIO()
    Ids(body, protocol=2).dump({"w": b"storage"})
    path = tmp_path / "ids.pt"
    head = pickle.dumps(MAGIC_NUMBER, protocol=2) + pickle.dumps(1001, protocol=2)
    head += pickle.dumps({"protocol_version": 1001, "little_endian": True}, protocol=2)
    path.write_bytes(head + body.getvalue() + pickle.dumps(["0"], protocol=2)
                     + struct.pack("<q", 1) + struct.pack("<f", 1.0))
    with pytest.raises(ValueError, match="values to unpack"):
        torch.load(path, weights_only=False)
    with pytest.raises(CorruptFileError, match=f"holds {values} values where torch's loader"):
        read(path)


def test_legacy_tar_format_is_refused_clearly(tmp_path: Path) -> None:
    path = tmp_path / "ancient.pt"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("sys_info", "pickle", "tensors", "storages"):
            payload = pickle.dumps({}, protocol=2)
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    with pytest.raises(UnknownFormatError, match="tar checkpoint"):
        read(path)
    assert_one_line_error(run_cli("inspect", str(path)), path)
