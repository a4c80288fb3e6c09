"""The compiled opcode loop (``modelsize._pickleops``) against the Python loop alone.

The compiled loop only repeats the success path of the opcodes the Python loop runs inline and
hands everything else back (see ``_pickleops.c``). These tests run every pickle both ways and
compare all the machine leaves behind: the value tree (with its sharing), the memo, the depth
records of nested values, the stack, globals, the safety judgement, the counts a budget reads,
and, for a pickle that fails, the error, its offset and what was judged before it. The inputs:
pickles of every protocol, torch checkpoints, the picklescan exploit corpus, hand-made edge
cases (deep nesting, memo out of order, undecodable text, a failing ``persistent_load``), and a
few thousand random mutations of them.
"""

from __future__ import annotations

import io
import math
import pickle
import random
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest

from modelsize.formats import _pickle
from modelsize.formats._pickle import (
    Blob,
    Call,
    Global,
    PersistentId,
    PickleError,
    UnhashableKey,
    _Machine,
)
from tests.conftest import SHARED_FIXTURES

pytestmark = pytest.mark.skipif(_pickle._ops is None, reason="modelsize._pickleops is not built")

_ATOMS = (str, int, float, bool, type(None), bytes, complex)


def canon(root: object) -> list[object]:
    """A flat token list of ``root``'s tree: types, values, and which objects are shared.

    Iterative (a list may nest thousands deep); every non-atomic object gets an index the
    first time it is met, and is a back reference after.
    """
    ids: dict[int, int] = {}
    keep: list[object] = []
    out: list[object] = []
    todo: list[object] = [root]
    while todo:
        obj = todo.pop()
        t = type(obj)
        if t in _ATOMS:
            out.append((t.__name__, "nan" if t is float and math.isnan(obj) else obj))
            continue
        if id(obj) in ids:
            out.append(("ref", ids[id(obj)]))
            continue
        ids[id(obj)] = len(ids)
        keep.append(obj)
        if t is list or t is tuple:
            out.append((t.__name__, len(obj)))  # type: ignore[arg-type]
            todo.extend(reversed(obj))  # type: ignore[call-overload]
        elif t is dict:
            out.append(("dict", len(obj)))  # type: ignore[arg-type]
            for k, v in reversed(list(obj.items())):  # type: ignore[attr-defined]
                todo.append(v)
                todo.append(k)
        elif t is set or t is frozenset:
            items = sorted(obj, key=repr)  # type: ignore[call-overload]
            out.append((t.__name__, len(items)))
            todo.extend(reversed(items))
        elif t is Global:
            out.append(("Global", obj.module, obj.name))  # type: ignore[attr-defined]
        elif t is Call:
            assert isinstance(obj, Call)
            out.append(("Call", obj.kind, type(obj.items).__name__,
                        type(obj.dictitems).__name__))
            todo.extend(reversed([obj.func, obj.args, obj.state, obj.items, obj.dictitems,
                                  dict(obj.kwargs)]))
        elif t is PersistentId:
            out.append(("PersistentId",))
            todo.append(obj.value)  # type: ignore[attr-defined]
        elif t is Blob:
            out.append(("Blob", *obj._key()))  # type: ignore[attr-defined]
        elif t is UnhashableKey:
            out.append(("UnhashableKey",))
            todo.append(obj.value)  # type: ignore[attr-defined]
        else:
            out.append(("other", t.__name__, repr(obj)))
    return out


def machine_state(m: _Machine, value: object) -> dict[str, object]:
    depths = sorted((d, c, repr(canon(o))) for d, c, o in m.depths.values())
    return {
        "tree": canon([value, m.memo, m.far, m.stack, m.metastack]),
        "depths": depths, "pos": m.pos, "proto": m.proto, "globals": list(m.globals),
        "unsafe": list(m.unsafe), "fails": m.fails, "found": m.found, "slow": m.slow,
    }


def run_once(data: bytes, compiled: bool, offset: int = 0,
             persistent_load: Callable[[object], object] | None = None,
             on_build: _pickle.BuildHook | None = None) -> dict[str, object]:
    m = _Machine(data, offset, persistent_load, on_build)
    if not compiled:
        m.fast = None
    try:
        value = m.run()
    except PickleError as exc:
        return {"error": str(exc), "offset": exc.offset, "unsafe": exc.unsafe,
                "globals": exc.globals, "found": m.found}
    except Exception as exc:  # from persistent_load: compared as such
        return {"raised": type(exc).__name__, "message": str(exc), "found": m.found}
    return machine_state(m, value)


def both(data: bytes, offset: int = 0,
         persistent_load: Callable[[], Callable[[object], object]] | None = None,
         on_build: _pickle.BuildHook | None = None) -> dict[str, object]:
    """Run ``data`` both ways; assert they agree; return the compiled run's result."""
    loads = [persistent_load() if persistent_load else None for _ in range(2)]
    fast = run_once(data, True, offset, loads[0], on_build)
    slow = run_once(data, False, offset, loads[1], on_build)
    assert fast == slow
    return fast


def recording_load() -> Callable[[object], object]:
    """A persistent_load that returns a fresh object per id and refuses an id of 'bad'."""
    def load(pid: object) -> object:
        if pid == "bad" or (isinstance(pid, tuple) and "bad" in pid):
            raise ValueError(f"refused {pid!r}")
        return ("loaded", pid)
    return load


# -- inputs ------------------------------------------------------------------------------


class _Pid(pickle.Pickler):
    def persistent_id(self, obj: object) -> object:
        if isinstance(obj, _Tensorish):
            return ("storage", obj.kind, obj.key, "cpu", obj.numel)
        return None


class _Tensorish:
    def __init__(self, kind: str, key: str, numel: int) -> None:
        self.kind, self.key, self.numel = kind, key, numel


def sample_values() -> list[object]:
    shared = [1, 2, 3]
    recursive: list[object] = []
    recursive.append(recursive)
    deep: object = ()
    for _ in range(30):
        deep = (deep, 1)
    return [
        {"int": 7, "neg": -70000, "big": 2**100, "float": 1.5, "str": "héllo\nworld",
         "none": None, "bools": [True, False], "tuple": (1, (2, 3), ()), "set": {1, 2},
         "frozen": frozenset({3, (4, 5)}), "bytes": b"\x00\x01raw", "ba": bytearray(b"ab")},
        OrderedDict((f"layer.{i}.weight", (i, (i, i + 1), [i] * 3)) for i in range(300)),
        {(1, 2): "tuple key", 3: "int", "s": "str", (1, (2, (3,))): [shared, shared]},
        [shared, shared, recursive, deep],
        ["x" * 70_000, "é" * 300_000, ("y" * (1 << 20 | 1),)],
        {"surrogate": "\udc80 lone", "empty": "", "tuples": [(), (1,), (1, 2), (1, 2, 3)]},
        list(range(-300, 70_000, 7)),
        {i: {j: (i, j) for j in range(5)} for i in range(400)},
    ]


def protocol_pickles() -> list[bytes]:
    out = []
    for value in sample_values():
        for proto in range(pickle.HIGHEST_PROTOCOL + 1):
            out.append(pickle.dumps(value, protocol=proto))
    return out


def persid_pickles() -> list[bytes]:
    """Pickles with persistent ids, as torch.save writes them (protocol 2) and at 4."""
    out = []
    for proto in (1, 2, 4):
        buf = io.BytesIO()
        state = OrderedDict((f"l{i}.w", (_Tensorish("FloatStorage", str(i), 4 * i), i, (2, i)))
                            for i in range(200))
        _Pid(buf, protocol=proto).dump({"model": state, "step": 3, "ids": [(0, 1)] * 5})
        out.append(buf.getvalue())
    return out


def torch_pickles() -> list[bytes]:
    """data.pkl of real torch.save archives: a state dict, an optimizer, a whole module."""
    torch = pytest.importorskip("torch")
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    out = []
    for obj, proto in (
        ({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}, 2),
        (model.state_dict(), 4),
        ({"tied": [model[0].weight, model[0].weight[1:]], "half": model[0].weight.half()}, 2),
        (model, 2),
    ):
        buf = io.BytesIO()
        torch.save(obj, buf, pickle_protocol=proto)
        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
            out.extend(z.read(n) for n in z.namelist() if n.endswith(".pkl"))
    return out


# -- the tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("index", range(len(protocol_pickles())))
def test_every_protocol_agrees(index: int) -> None:
    data = protocol_pickles()[index]
    result = both(data)
    assert "error" not in result


def test_persistent_ids_agree() -> None:
    for data in persid_pickles():
        assert "error" not in both(data, persistent_load=recording_load)
        both(data)  # and without persistent_load: PersistentId placeholders


def test_torch_checkpoints_agree() -> None:
    for data in torch_pickles():
        result = both(data, persistent_load=recording_load)
        assert "error" not in result and "raised" not in result
        both(data)


def test_a_failing_persistent_load_fails_at_the_same_opcode() -> None:
    buf = io.BytesIO()
    _Pid(buf, protocol=2).dump([_Tensorish("FloatStorage", "0", 1), _Tensorish("bad", "1", 2)])
    result = both(buf.getvalue(), persistent_load=recording_load)
    assert result["raised"] == "ValueError" and result["found"] == 2


def test_the_compiled_loop_runs_the_frequent_opcodes() -> None:
    """It runs a torch-style pickle up to its STOP (everything after its first GLOBAL)."""
    data = persid_pickles()[1]
    m = _Machine(data, 0, recording_load(), None)
    _pickle._ops.run  # noqa: B018 - the module is built (see pytestmark)
    total = sum(1 for _ in pickletools_ops(data))
    value = m.run()
    assert isinstance(value, dict)
    m2 = _Machine(data, 0, recording_load(), None)
    assert m2.fast is not None
    pos, _stack, ran, found, _texts, exc = m2.fast(
        data, len(data), 2, total, m2.stack, m2.metastack, m2.memo, m2.far, m2.depths,
        (None, None), m2.persistent_load)
    assert exc is None and found == 0 and ran >= 1  # stops at the first GLOBAL
    assert data[pos:pos + 1] == b"c"


def pickletools_ops(data: bytes) -> list[object]:
    import pickletools

    return list(pickletools.genops(data))


def test_an_offset_and_a_second_pickle_agree() -> None:
    first, second = pickle.dumps({"a": (1, 2)}, 2), pickle.dumps([3, 4], 4)
    data = b"junk" + first + second
    assert "error" not in both(data, offset=4)
    assert "error" not in both(data, offset=4 + len(first))


def _ops(*parts: bytes) -> bytes:
    return b"\x80\x02" + b"".join(parts)


EDGE_CASES: dict[str, bytes] = {
    # stack underflow and missing MARKs, at each inline opcode
    **{f"underflow {name}": _ops(code, b".") for name, code in (
        ("REDUCE", b"R"), ("TUPLE1", b"\x85"), ("TUPLE2", b"K\x01\x86"), ("TUPLE3", b"\x87"),
        ("TUPLE", b"t"), ("SETITEMS", b"u"), ("SETITEM", b"}K\x01s"), ("APPENDS", b"e"),
        ("APPEND", b"a"), ("BINPUT", b"q\x00"), ("LONG_BINPUT", b"r\x00\x00\x00\x00"),
        ("MEMOIZE", b"\x94"), ("BINPERSID", b"Q"), ("STOP", b""))},
    # data that ends inside an opcode's argument
    **{f"short {name}": _ops(code) for name, code in (
        ("BININT", b"J\x01\x02"), ("BININT2", b"M\x01"), ("BININT1", b"K"),
        ("BINUNICODE", b"X\x05\x00\x00\x00ab"), ("SHORT_BINUNICODE", b"\x8c\x09abc"),
        ("BINGET", b"h"), ("LONG_BINGET", b"j\x00\x00"), ("LONG_BINPUT", b"N r\x00"),
        ("BINPUT", b"Nq"), ("no STOP", b"N"))},
    "memo never stored": _ops(b"h\x05."),
    "memo far": _ops(b"Nq\x05K\x01q\x00h\x05h\x00\x86."),
    "memo replaced": _ops(b"Nq\x00K\x01q\x00h\x00."),
    "memoize after far": _ops(b"Nq\x03K\x01\x94K\x02\x94h\x00h\x01\x86h\x03\x86."),
    "long memo index": _ops(b"Nr\xff\xff\xff\x7fj\xff\xff\xff\x7f."),
    "undecodable text": _ops(b"\x8c\x02\xff\xfe."),
    "surrogate text": _ops(b"\x8c\x03\xed\xb2\x80."),
    "BININT negative": _ops(b"J\xff\xff\xff\xff."),
    "SETITEMS odd": _ops(b"}(K\x01u."),
    "SETITEMS tuple key": _ops(b"}(K\x01K\x02\x86K\x03u."),
    "SETITEMS list key": _ops(b"}(]K\x03u."),
    "SETITEMS bool key": _ops(b"}(\x88K\x03u."),
    "SETITEMS on a list": _ops(b"](K\x01K\x02u."),
    "SETITEM on a call": _ops(b"ccollections\nOrderedDict\n)RK\x01K\x02s."),
    "SETITEMS on a call": _ops(b"ccollections\nOrderedDict\n)R(K\x01K\x02u."),
    "APPENDS to a dict": _ops(b"}(K\x01e."),
    "APPENDS to a call": _ops(b"ccollections\ndeque\n)R(K\x01e."),
    "APPEND to a tuple": _ops(b")K\x01a."),
    "REDUCE plain": _ops(b"ctorch._utils\n_rebuild_tensor_v2\n(K\x01K\x02tR."),
    "REDUCE safe no args": _ops(b"ccollections\nOrderedDict\n)R."),
    "REDUCE bytes no args": _ops(b"c__builtin__\nbytes\n)R."),
    "REDUCE converter": _ops(b"c__builtin__\nset\n](K\x01eR."),
    "REDUCE unsafe": _ops(b"cposix\nsystem\n\x8c\x02ls\x85R."),
    "REDUCE list args": _ops(b"ctorch._utils\n_rebuild_tensor_v2\n]R."),
    "REDUCE a str": _ops(b"\x8c\x01a)R."),
    "REDUCE a call": _ops(b"ccollections\nOrderedDict\n)R)R."),
    "REDUCE a persistent id": _ops(b"\x8c\x01aQ)R."),
    "empty TUPLE": _ops(b"(t(t\x86."),
    "tuple of a persistent id": _ops(b"\x8c\x01aQ\x85\x85."),
    "frozenset in a tuple": _ops(b"(K\x01\x91\x85."),
    "recursive list": _ops(b"]q\x00h\x00a."),
    "appends to itself": _ops(b"]q\x00(h\x00h\x00e."),
    "latin1 bytes": _ops(b"c_codecs\nencode\nq\x00\x8c\x03\xc3\xa9aq\x01\x8c\x06latin1"
                         b"q\x02\x86q\x03Rq\x04."),
    "latin1 bytes far text": _ops(b"c_codecs\nencode\n\x8c\x01a\x8c\x01b\x8c\x01c\x8c\x06latin1"
                                  b"\x86\x86R."),
    "BUILD on a call": _ops(b"ccollections\nOrderedDict\n)R}(\x8c\x01aK\x01ub."),
    "unknown opcode": _ops(b"N\xff."),
    "text then judge": _ops(b"\x8c\x01a\x8c\x01b\x86cposix\nsystem\n\x8c\x02ls\x85R0."),
}
EDGE_CASES["deep tuples"] = _ops(b"K\x01" + b"\x85" * 150 + b".")
EDGE_CASES["deep tuples via MARK"] = _ops(b"(" * 120 + b"K\x01" + b"t" * 120 + b".")
EDGE_CASES["deep lists"] = _ops(b"]" + b"(]" * 5000 + b"e" * 5000 + b".")
EDGE_CASES["costly key"] = _ops(b"}(" + b"(" + b"K\x01" * 300 + b"tK\x01u.")
EDGE_CASES["wide tuple key"] = _ops(b"}(" + b"(" + b"(K\x01\x85" * 20 + b"K\x02" * 3
                                    + b"\x85" * 0 + b"tK\x01u.")
EDGE_CASES["long text"] = _ops(b"X" + struct.pack("<I", (1 << 20) + 3) + b"a" * ((1 << 20) + 3)
                               + b".")


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_edge_cases_agree(name: str) -> None:
    both(EDGE_CASES[name], persistent_load=recording_load)
    both(EDGE_CASES[name])


def test_blocks_and_budget_counts_agree() -> None:
    """More opcodes than one block (the ceilings and the budget are checked between blocks):
    the same counts of opcodes run by methods and of persistent ids."""
    data = pickle.dumps([7] * (_pickle._BLOCK + 10) + [(1, "a")] * 3, protocol=2)
    assert "error" not in both(data)


def corpus_pickles() -> list[tuple[str, bytes]]:
    root = SHARED_FIXTURES / "hostile" / "picklescan"
    if not root.exists():
        return []
    out = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        raw = path.read_bytes()
        if zipfile.is_zipfile(io.BytesIO(raw)):
            try:
                with zipfile.ZipFile(io.BytesIO(raw)) as z:
                    for n in z.namelist():
                        if n.endswith(".pkl") and z.getinfo(n).file_size < 50 << 20:
                            out.append((f"{path.name}:{n}", z.read(n)))
            except (zipfile.BadZipFile, RuntimeError, NotImplementedError):
                pass
        elif _pickle.looks_like_pickle(raw):
            out.append((path.name, raw))
    return out


def test_the_exploit_corpus_agrees() -> None:
    """Every pickle of the picklescan corpus: the same judgement (and the same everything)."""
    pickles = corpus_pickles()
    if not pickles:
        pytest.skip("../shared/fixtures/hostile/picklescan is absent")
    judged = 0
    for _name, data in pickles:
        result = both(data)
        judged += bool(result.get("unsafe"))
    assert judged >= 10


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 4))):
        if not b:
            break
        i = rng.randrange(len(b))
        how = rng.random()
        if how < 0.45:
            b[i] = rng.randrange(256)
        elif how < 0.6:
            b[i:i] = bytes([rng.choice(b"()tRQ\x85\x86\x87uesahjqr\x94}]N")])
        elif how < 0.75:
            del b[i : i + rng.randrange(1, 4)]
        elif how < 0.85:
            b[i:i] = b[rng.randrange(len(b)) :][: rng.randrange(1, 16)]
        else:
            del b[rng.randrange(len(b) + 1) :]
    return bytes(b)


def test_random_mutations_agree() -> None:
    """Thousands of mutated pickles (every family above): the same result both ways, failure
    or not, with and without a persistent_load."""
    rng = random.Random(20261127)
    seeds = [p for p in protocol_pickles() if len(p) < 20_000]
    seeds += persid_pickles()[:2] + [p for p in torch_pickles() if len(p) < 20_000]
    seeds += [d for _, d in corpus_pickles() if len(d) < 20_000][:40]
    outcomes = {"ok": 0, "error": 0, "raised": 0}
    for i in range(3000):
        data = _mutate(rng, rng.choice(seeds))
        result = both(data, persistent_load=recording_load if i % 2 else None)
        outcomes["error" if "error" in result else "raised" if "raised" in result else "ok"] += 1
    assert outcomes["ok"] > 100 and outcomes["error"] > 100


def test_reading_a_checkpoint_agrees(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the torch reader: the same inventory with and without the compiled loop."""
    torch = pytest.importorskip("torch")
    from modelsize.formats import read

    torch.manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(3, 2) for i in range(50)}
    state["tied"] = state["layers.0.weight"]
    torch.save({"model": state, "step": 3}, tmp_path / "ckpt.pt")
    fast = read(tmp_path / "ckpt.pt")
    monkeypatch.setattr(_pickle, "_ops", None)
    slow = read(tmp_path / "ckpt.pt")
    assert fast == slow


def test_pure_python_turns_the_extensions_off() -> None:
    """``MODELSIZE_PURE_PYTHON=1``: the Python loop and NumPy's casts, where the extensions are
    built (the same results, for anyone who would rather not run compiled code on a file)."""
    import os
    import subprocess
    import sys

    from modelsize.formats import safetensors

    code = ("from modelsize.formats import _pickle, safetensors; "
            "from modelsize.slimming import cast; "
            "print(_pickle._ops is None, cast._speedups is None, "
            "safetensors._scan_entries is None)")
    env = {**os.environ, "MODELSIZE_PURE_PYTHON": "1"}
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert off == ["True", "True", "True"]
    env.pop("MODELSIZE_PURE_PYTHON")
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        check=True).stdout.split()
    assert on[0] == "False"
    assert on[2] == str(safetensors._scan_entries is None)
