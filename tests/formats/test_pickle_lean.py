"""What the pickle parser lets go of, shares or leaves unrecorded, and what the torch walk drops
once used: none of it changes a parse's value, its errors or a reader's records.

* memo entries the pickle never reads back are stored as None (``_Machine.keep``, found by
  ``_pickleops.memo_reads``): the value tree is the one every entry kept gives;
* short tuples of tuples are left without a depth record (``_pickle._SHALLOW``): the depth
  and hashing-cost limits fall where they fell when every such tuple was recorded;
* equal short tuples of ints are one object (``_Machine.share``);
* :attr:`PickleScan.shared` is False only where no container or call sits twice in the tree;
* the torch walk's runs of a mapping's tensors (``_Walker.plain_run``), and its letting go of
  them in an unshared tree, give the records the general path gives.
"""

from __future__ import annotations

import collections
import io
import mmap
import pickle
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from modelsize.errors import CorruptFileError
from modelsize.formats import _pickle, _torch_tree, read, torch_zip
from modelsize.formats._pickle import Call, PickleError, _Machine, scan
from tests.formats import test_pickle_compiled as compiled

needs_ops = pytest.mark.skipif(_pickle._ops is None, reason="modelsize._pickleops is not built")

_LEAVES = (str, int, float, bool, complex, bytes, type(None), _pickle.Global, _pickle.Blob)


def _outcome(data: bytes, *, keep_all: bool = False, fast: bool = True,
             persistent_load: Callable[[object], object] | None = None) -> dict[str, object]:
    """The value tree (as a token list, sharing shown) or the error of one parse."""
    m = _Machine(data, 0, persistent_load, None)
    if keep_all:
        m.keep = None
    if not fast:
        m.fast = None
    try:
        value = m.run()
    except PickleError as exc:
        return {"error": str(exc), "offset": exc.offset, "unsafe": exc.unsafe}
    except ValueError as exc:  # from recording_load
        return {"raised": str(exc)}
    return {"value": compiled.canon(value), "globals": list(m.globals),
            "unsafe": list(m.unsafe), "pos": m.pos}


def _families() -> list[bytes]:
    seeds = [p for p in compiled.protocol_pickles() if len(p) < 200_000]
    seeds += compiled.persid_pickles() + compiled.torch_pickles()
    seeds += list(compiled.EDGE_CASES.values())
    seeds += [d for _, d in compiled.corpus_pickles()]
    return seeds


def _mutations(count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    seeds = [p for p in _families() if len(p) < 20_000]
    return [compiled._mutate(rng, rng.choice(seeds)) for _ in range(count)]


@needs_ops
def test_memo_entries_never_read_back_change_no_value() -> None:
    for i, data in enumerate(_families() + _mutations(1500, 22)):
        load = compiled.recording_load() if i % 2 else None
        assert _outcome(data, persistent_load=load) == _outcome(
            data, keep_all=True, persistent_load=load), i


@needs_ops
def test_memo_reads_lists_the_entries_read_back() -> None:
    data = pickle.dumps([(1, 2), "a", "a", [3]], protocol=2)  # "a" is read back once
    m = _Machine(data, 0, None, None)
    assert m.keep is not None and sum(m.keep) == 1
    m.run()
    assert [x for x in m.memo if x is not None] == ["a"]
    # a GET with a decimal index: every entry is kept
    assert _pickle._ops.memo_reads(b"(I1\np0\ng0\nl.", 19, 0) is None  # type: ignore[union-attr]


def test_shallow_tuples_keep_the_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python loop with every tuple of tuples recorded (``_SHALLOW = 0``, as before) and
    the parser as it is: the same values, the same wrapped keys, the same errors."""
    data_sets = _families() + _mutations(1500, 23)
    data_sets += [
        # keys that cost just under and over the limit, shallow and deeper
        b"\x80\x02}(" + b"(" + b"K\x01\x85" * 8 + b"tK\x00u.",
        b"\x80\x02}(" + b"(" + b"(" + b"K\x01" * 120 + b"t" + b"(" + b"K\x01" * 130 + b"t"
        + b"tK\x00u.",
        b"\x80\x02}(" + b"(" + b"(" + b"K\x01" * 120 + b"t" + b"(" + b"K\x01" * 132 + b"t"
        + b"tK\x00u.",
        *(b"\x80\x02}(" + b"(" + b"K\x01" * n + b"t\x85\x85K\x00u." for n in (251, 252)),
        *(b"\x80\x02}(" + b"((" + b"K\x01" * n + b"tK\x01tK\x00u." for n in (252, 253)),
        # a shallow tuple nested to the depth limit
        b"\x80\x02K\x01\x85\x85" + b"\x85" * (_pickle.MAX_DEPTH - 2) + b".",
        b"\x80\x02K\x01\x85\x85" + b"\x85" * (_pickle.MAX_DEPTH - 1) + b".",
        b"\x80\x02(K\x01\x85K\x02\x85K\x03K\x04K\x05K\x06K\x07K\x08t\x85" + b"\x85" * 97 + b".",
        b"\x80\x02(K\x01\x85K\x02\x85K\x03K\x04K\x05K\x06K\x07K\x08K\x09t\x85" + b"\x85" * 97
        + b".",
    ]
    now = [_outcome(d, fast=_pickle._ops is not None) for d in data_sets]
    monkeypatch.setattr(_pickle, "_SHALLOW", 0)
    before = [_outcome(d, fast=False, keep_all=True) for d in data_sets]
    for i, (a, b) in enumerate(zip(now, before, strict=True)):
        assert a == b, i


def test_equal_tuples_of_ints_are_one_object() -> None:
    value = scan(pickle.dumps([tuple([1, 2]), tuple([1, 2]), (1, True), (1, 1.0), (1, 1)],
                              protocol=2)).value
    assert isinstance(value, list)
    assert value[0] is value[1] and value[4] == (1, 1)
    assert value[2] == (1, True) and value[2][1] is True  # no bool made an int
    assert type(value[3][1]) is float
    rng = random.Random(5)

    def make(depth: int) -> object:
        kind = rng.randrange(5 if depth < 4 else 2)
        if kind == 0:
            return rng.randrange(-3, 300)
        if kind == 1:
            return rng.choice(["a", "b", "weight"])
        if kind == 2:
            return tuple(make(depth + 1) for _ in range(rng.randrange(0, 10)))
        if kind == 3:
            return [make(depth + 1) for _ in range(rng.randrange(0, 5))]
        return {rng.randrange(9): make(depth + 1) for _ in range(rng.randrange(0, 5))}

    for _ in range(300):
        obj = make(0)
        for proto in (0, 2, 4):
            assert scan(pickle.dumps(obj, protocol=proto)).value == obj


def _sharing(value: object) -> bool:
    """Whether a container or call of ``value`` sits at two places (tuples of ints aside: the
    parser makes equal ones once)."""
    seen: set[int] = set()
    todo = [value]
    while todo:
        obj = todo.pop()
        if isinstance(obj, _LEAVES) or (type(obj) is tuple and all(type(x) is int for x in obj)):
            continue
        if id(obj) in seen:
            return True
        seen.add(id(obj))
        if isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif isinstance(obj, Call):
            todo.extend([obj.func, obj.args, obj.state, obj.items, obj.dictitems])
            todo.extend(obj.kwargs.values())
        elif isinstance(obj, (_pickle.PersistentId, _pickle.UnhashableKey)):
            todo.append(obj.value)
    return False


def test_a_tree_says_when_it_shares() -> None:
    torch = pytest.importorskip("torch")
    a, b = torch.ones(2), torch.zeros(3)

    def data_pkl(obj: object) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        import zipfile

        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
            return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))

    assert not scan(data_pkl({"a": a, "b": b})).shared
    assert scan(data_pkl({"a": a, "b": a})).shared  # tied: the second is read back
    assert scan(b"\x80\x02]2\x86.").shared  # DUP
    # and where it says it does not, nothing sits twice
    unshared = 0
    for i, data in enumerate(_families() + _mutations(2000, 24)):
        try:
            parsed = scan(data, persistent_load=compiled.recording_load() if i % 2 else None)
        except (PickleError, ValueError):
            continue
        if not parsed.shared:
            unshared += 1
            assert not _sharing(parsed.value), i
    assert unshared > 50 or _pickle._ops is None


def test_a_mapped_pickle_read_past_gives_the_same_value(tmp_path: Path) -> None:
    obj = {f"k{i}": (i, [i, "x"], {"v": i}) for i in range(120_000)}  # > 1M opcodes
    data = pickle.dumps(obj, protocol=2)
    path = tmp_path / "big.pkl"
    path.write_bytes(b"junk" + data)
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    m = _Machine(mm, 4, None, None)
    value = m.run()
    assert value == obj
    if _pickle._DONTNEED is not None:
        assert m.released > 4 + (1 << 20)


# -- the torch walk ------------------------------------------------------------------------


def _checkpoints() -> dict[str, Any]:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.SGD(net.parameters(), momentum=0.9)
    net(torch.randn(5, 4)).sum().backward()
    opt.step()
    flat = {f"layer.{i}.weight": torch.full((2,), float(i)) for i in range(50)}
    od = collections.OrderedDict((f"blocks.{i}.bias", torch.ones(i + 1)) for i in range(30))
    keys = {"w": torch.ones(2), "grad": torch.ones(2), "x.grad": torch.ones(2),
            "rng_state": torch.zeros(3, dtype=torch.uint8), "ema.w": torch.ones(1),
            "model_ema": {"w": torch.ones(1)}, "hidden_states": torch.ones(2),
            "running_mean": torch.ones(2), "mask": torch.ones(2, dtype=torch.bool),
            "": torch.ones(1), "optimizer_state": {"w": torch.ones(1)},
            "q": torch.ones(2, requires_grad=True), "t": torch.ones(2, 3).t(),
            "e": torch.ones(0, 3), "off": torch.arange(6.0)[2:]}
    deep: dict[str, Any] = {"w": torch.ones(1)}
    for i in range(70):
        deep = {f"d{i}": deep, "v": torch.ones(1)}
    shared = torch.arange(8.0)
    return {
        "flat": flat, "ordered": od, "nested": {"model": od, "ema": flat, "step": 2},
        "keys": keys, "deep": deep,
        "training": {"model": net.state_dict(), "optimizer": opt.state_dict()},
        "optimizer only": opt.state_dict(),
        "views": {"a": shared[:4], "b": shared[4:], "c": shared},
        "tied": {"a": flat["layer.0.weight"], "b": flat["layer.0.weight"], **od},
        "mixed": {"a": torch.ones(1), "n": 3, "b": torch.ones(2), "l": [torch.ones(1)],
                  "c": torch.ones(1)},
        "int keys": {0: torch.ones(1), "a": torch.ones(1), 1: torch.ones(2)},
        "module": net,
    }


def _read_as(path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Any]:
    from tests.formats.test_torch_fast_paths import _state  # (it needs torch)

    with monkeypatch.context() as mp:
        if mode == "general":
            mp.setattr(_torch_tree._Walker, "plain_tensor", lambda self, *a: False)
        elif mode == "kept":  # the runs, but the tree never let go of
            classify = torch_zip.classify

            def keep(*args: Any, **kwargs: Any) -> Any:
                kwargs["unshared"] = False
                return classify(*args, **kwargs)

            mp.setattr(torch_zip, "classify", keep)
        try:
            inv = read(path)
        except CorruptFileError as exc:
            return "error", str(exc)
        return "inventory", _state(inv)


@pytest.mark.parametrize("case", sorted(_checkpoints()))
def test_runs_and_letting_go_give_the_general_paths_records(
    tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "ckpt.pt"
    torch.save(_checkpoints()[case], path)
    fast = _read_as(path, "fast", monkeypatch)
    assert fast[0] == "inventory"
    assert fast == _read_as(path, "kept", monkeypatch)
    assert fast == _read_as(path, "general", monkeypatch)


def test_a_run_stops_at_a_tensor_past_its_storage(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from tests.formats.test_torch_fast_paths import (
        _HOOKS,
        _PID,
        _data_pkl,
        _Rebuild,
        _Storage,
        _with_data_pkl,
    )

    saved = tmp_path / "saved.pt"
    torch.save({"w": torch.arange(6, dtype=torch.float32)}, saved)
    path = tmp_path / "odd.pt"
    _with_data_pkl(saved, path, _data_pkl(
        {"w": _Rebuild(_Storage(_PID), 0, (6,), (1,), False, _HOOKS),
         "x": _Rebuild(_Storage(_PID), 2, (6,), (1,), False, _HOOKS)}))
    fast = _read_as(path, "fast", monkeypatch)
    assert fast[0] == "error" and "reaches byte" in fast[1]
    assert fast == _read_as(path, "general", monkeypatch)
