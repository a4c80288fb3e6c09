"""The torch reader's fast paths (the common ``_rebuild_tensor_v2`` tensor declared without
the general path's intermediate objects, the common persistent id resolved from a cache)
give exactly the general paths' records, and decline anything else, which the general paths
then take with their own checks and messages."""

from __future__ import annotations

import collections
import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import pytest

from modelsize.errors import CorruptFileError
from modelsize.formats import _torch_tree, read, torch_zip
from modelsize.inventory import Inventory

torch = pytest.importorskip("torch")


def _general_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both fast paths off: every tensor and persistent id through the general paths."""

    class _NeverKnown(dict):  # type: ignore[type-arg]
        def get(self, key: object, default: object = None) -> object:
            return default

        def __setitem__(self, key: object, value: object) -> None:
            pass

    monkeypatch.setattr(_torch_tree._Walker, "plain_tensor", lambda self, *a: False)
    init = torch_zip._ZipRead.__init__

    def without_cache(self: Any, *args: Any) -> None:
        init(self, *args)
        self.types = _NeverKnown()

    monkeypatch.setattr(torch_zip._ZipRead, "__init__", without_cache)


def _outcome(path: Path) -> tuple[str, Any]:
    """Everything a read gives, or the error it ends in."""
    try:
        inv = read(path)
    except CorruptFileError as exc:
        return "error", str(exc)
    return "inventory", _state(inv)


def _state(inv: Inventory) -> dict[str, Any]:
    return {
        "tensors": [(t.to_dict(), t.storage, t.storage_offset, t.strides) for t in inv.tensors],
        "storages": [repr(s) for s in inv.storages],
        "regions": [repr(r) for r in inv.regions],
        "by_category": dict(inv.bytes_by_category),
        "notes": inv.notes,
        "facts": inv.facts,
        "unsafe": inv.unsafe_globals,
    }


def _both_ways(path: Path) -> tuple[tuple[str, Any], tuple[str, Any]]:
    fast = _outcome(path)
    with pytest.MonkeyPatch.context() as mp:
        _general_only(mp)
        general = _outcome(path)
    return fast, general


def _checkpoints() -> dict[str, Any]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3),
                              torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(5, 4)).sum().backward()
    opt.step()
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    emb = torch.nn.Parameter(torch.randn(5, 2))
    return {
        "training": {"model": net.state_dict(), "optimizer": opt.state_dict(), "step": 1},
        "views": {"t": base.t(), "row": base[1], "col": base[:, 2], "tail": base[2:],
                  "empty": base[:0], "scalar": torch.tensor(3.0), "base": base,
                  "expand": torch.ones(1, 3).expand(4, 3)},
        "dtypes": {"mask": torch.ones(3, dtype=torch.bool), "ids": torch.arange(3),
                   "attention.masked_bias": torch.zeros(2, dtype=torch.uint8),
                   "half": torch.ones(2, dtype=torch.float16),
                   "c": torch.ones(2, dtype=torch.complex64),
                   "int4": torch.ones(4, dtype=torch.int8)},
        "tied": {"embed.weight": emb, "head.weight": emb, "grad": torch.ones(2),
                 "nested": {"ema": {"w": torch.ones(3, requires_grad=True)}}},
        "mixed": {"a": torch.ones(2), "cfg": {"lr": 0.1}, "b": [torch.zeros(3), 4],
                  "c": torch.ones(1), "rng_state": torch.zeros(5, dtype=torch.uint8)},
        "module": net,
    }


@pytest.mark.parametrize("case", sorted(_checkpoints()))
def test_fast_paths_give_the_general_paths_records(tmp_path: Path, case: str) -> None:
    path = tmp_path / f"{case}.pt"
    torch.save(_checkpoints()[case], path)
    fast, general = _both_ways(path)
    assert fast[0] == "inventory"
    assert fast == general


# -- hand-made data.pkl: odd rebuild arguments ------------------------------------------------


class _Storage:
    """Pickled as the persistent id torch writes for a storage (or as ``pid`` itself)."""

    def __init__(self, pid: object) -> None:
        self.pid = pid


class _Rebuild:
    """Pickled as ``torch._utils._rebuild_tensor_v2(*args)``."""

    def __init__(self, *args: object) -> None:
        self.args = args

    def __reduce__(self) -> tuple[Any, tuple[object, ...]]:
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: object) -> object:
        return obj.pid if isinstance(obj, _Storage) else None


def _data_pkl(obj: object) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def _with_data_pkl(saved: Path, dst: Path, data: bytes) -> None:
    with zipfile.ZipFile(saved) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            if info.filename.endswith("/data.pkl"):
                zout.writestr(info.filename, data)
            else:
                zout.writestr(info, zin.read(info.filename))


_PID = ("storage", torch.FloatStorage, "0", "cpu", 6)
_HOOKS = collections.OrderedDict()


@pytest.mark.parametrize(
    "args",
    [
        (_Storage(_PID), 0, (2, 3), (3, 1), False, _HOOKS),  # the common form
        (_Storage(_PID), 0, (3, 2), (1, 3), True, _HOOKS),  # strided, a parameter
        (_Storage(_PID), 2, (4,), (1,), False, _HOOKS),  # an offset
        (_Storage(_PID), 3, (4,), (1,), False, _HOOKS),  # past its storage
        (_Storage(_PID), 0, (2, 4), (4, 1), False, _HOOKS),  # past its storage
        (_Storage(_PID), True, (2,), (1,), False, _HOOKS),  # a bool offset
        (_Storage(_PID), -1, (2,), (1,), False, _HOOKS),
        (_Storage(_PID), 0, [2, 3], [3, 1], False, _HOOKS),  # lists
        (_Storage(_PID), 0, (2, -3), (3, 1), False, _HOOKS),
        (_Storage(_PID), 0, (2, 3), (3,), False, _HOOKS),  # fewer strides
        (_Storage(_PID), 0, (2, True), (1, 1), False, _HOOKS),
        (_Storage(_PID), 0, (6,), (1,), 1, _HOOKS),  # requires_grad not True
        (_Storage(_PID), 0, (6,)),  # too few arguments
        (_Storage(_PID), os.system, (6,), (1,), False, _HOOKS),  # a global as an offset
        (_Storage(("storage", torch.FloatStorage, "0", "cpu", True)), 0, (1,), (1,), False,
         _HOOKS),  # a bool numel
        (_Storage(("storage", torch.FloatStorage, 0, "cpu", 6)), 0, (6,), (1,), False,
         _HOOKS),  # an int key
        (_Storage(("storage", torch.FloatStorage, "0", 7, 6)), 0, (6,), (1,), False,
         _HOOKS),  # a location that is no str
        (_Storage(("storage", torch.FloatStorage, "9", "cpu", 6)), 0, (6,), (1,), False,
         _HOOKS),  # no such member
        (_Storage(("storage", torch.FloatStorage, "0", "cpu", 5)), 0, (5,), (1,), False,
         _HOOKS),  # the member holds more
        (_Storage(("storage", os.system, "0", "cpu", 6)), 0, (6,), (1,), False, _HOOKS),
        (_Storage(("storage", [1], "0", "cpu", 6)), 0, (6,), (1,), False, _HOOKS),
        (_Storage(["storage", torch.FloatStorage, "0", "cpu", 6]), 0, (6,), (1,), False,
         _HOOKS),
    ],
)
def test_odd_rebuild_arguments_read_as_the_general_paths_read_them(
    tmp_path: Path, args: tuple[object, ...]
) -> None:
    saved = tmp_path / "saved.pt"
    torch.save({"w": torch.arange(6, dtype=torch.float32)}, saved)
    path = tmp_path / "odd.pt"
    # the same tensor under two keys: the second is met through the memo
    _with_data_pkl(saved, path, _data_pkl({"w": (t := _Rebuild(*args)), "v": t,
                                            "x": _Rebuild(*args)}))
    fast, general = _both_ways(path)
    assert fast == general


def test_a_hostile_global_among_rebuild_arguments_is_never_called(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = tmp_path / "saved.pt"
    torch.save({"w": torch.arange(6, dtype=torch.float32)}, saved)
    path = tmp_path / "odd.pt"
    _with_data_pkl(saved, path, _data_pkl(
        {"w": _Rebuild(_Storage(_PID), 0, (6,), (1,), False, _HOOKS),
         "x": _Rebuild(_Storage(_PID), os.system, (6,), (1,), False, _HOOKS)}))
    called: list[object] = []
    monkeypatch.setattr(os, "system", lambda *a: called.append(a))
    with pytest.raises(CorruptFileError, match="offset"):
        read(path)
    assert called == []
