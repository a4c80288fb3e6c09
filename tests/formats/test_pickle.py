"""The pickle virtual machine: parses every protocol, never imports or calls, fails cleanly."""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import json
import os
import pickle
import random
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

from modelsize.categories import Category
from modelsize.errors import CorruptFileError
from modelsize.formats import read
from modelsize.formats._pickle import (
    MAX_DEPTH,
    Blob,
    Call,
    Global,
    PersistentId,
    PickleError,
    UnhashableKey,
    scan,
    scan_all,
)

PROTOCOLS = range(pickle.HIGHEST_PROTOCOL + 1)
SAMPLE: dict[str, Any] = {
    "int": 7,
    "neg": -70000,
    "big": 2**100,
    "float": 1.5,
    "str": "héllo\nworld",
    "none": None,
    "bools": [True, False],
    "tuple": (1, (2, 3), ()),
    "nested": {"a": [1, 2, {"b": "c"}]},
    "set": {1, 2},
    "frozen": frozenset({3}),
    "bytes": b"\x00\x01raw",
}


def plain(value: object, data: bytes) -> object:
    """Turn the placeholders for bytes, sets and frozensets back into values, for comparing."""
    if isinstance(value, Blob):
        return value.read(data)
    if isinstance(value, Call) and isinstance(value.func, Global):
        name = str(value.func)
        args = [plain(a, data) for a in value.args]
        if name == "_codecs.encode":  # protocols 0-2 spell bytes as encode(str, 'latin1')
            return str(args[0]).encode(str(args[1]))
        if name in ("builtins.set", "builtins.frozenset"):
            return {"builtins.set": set, "builtins.frozenset": frozenset}[name](
                *args, *[plain(x, data) for x in value.items]
            )
    if isinstance(value, dict):
        return {plain(k, data): plain(v, data) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v, data) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v, data) for v in value)
    if isinstance(value, (set, frozenset)):
        return type(value)(plain(v, data) for v in value)
    return value


class Boom:
    """Unpickling this would run ``os.system``; the scanner must only name it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class EvalBoom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.eval, ("1 + 1",))


class ExecBoom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.exec, ("import os",))


class Plain:
    def __init__(self) -> None:
        self.x = 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_plain_values_round_trip(protocol: int) -> None:
    data = pickle.dumps(SAMPLE, protocol=protocol)
    result = scan(data)
    assert result.end == len(data)
    assert result.protocol == (protocol if protocol >= 2 else 0)
    assert plain(result.value, data) == SAMPLE
    assert result.unsafe == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_os_system_is_named_never_run(protocol: int, tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    data = pickle.dumps({"x": Boom(marker)}, protocol=protocol)
    result = scan(data)
    assert result.unsafe == [f"{os.system.__module__}.system"]
    assert Global(os.system.__module__, "system") in result.globals
    call = result.value["x"]
    assert isinstance(call, Call)
    assert call.args == (f"touch {marker}",)
    assert not marker.exists()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_eval_and_exec_are_unsafe(protocol: int) -> None:
    data = pickle.dumps([EvalBoom(), ExecBoom()], protocol=protocol)
    assert scan(data).unsafe == ["builtins.eval", "builtins.exec"]


def test_nothing_is_imported() -> None:
    module = b"modelsize_nowhere_xyz"
    data = b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c\x03run\x93)R."
    assert "modelsize_nowhere_xyz" not in sys.modules
    result = scan(data)
    assert result.unsafe == ["modelsize_nowhere_xyz.run"]
    assert "modelsize_nowhere_xyz" not in sys.modules


@pytest.mark.parametrize("protocol", [0, 1, 2, 4])
def test_instances_of_unknown_classes_are_unsafe(protocol: int) -> None:
    result = scan(pickle.dumps(Plain(), protocol=protocol))
    assert result.unsafe == [f"{__name__}.Plain"]
    assert isinstance(result.value, Call)
    assert result.value.state == {"x": 1}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_ordered_dict_is_safe(protocol: int) -> None:
    data = pickle.dumps(OrderedDict(a=1, b=[2]), protocol=protocol)
    result = scan(data)
    assert result.unsafe == []
    assert isinstance(result.value, Call)
    assert str(result.value.func) == "collections.OrderedDict"
    pairs = list(result.value.dictitems)
    if not pairs:  # protocol 0/1 pass the items as the constructor's argument
        pairs = [tuple(p) for p in result.value.args[0]]
    assert pairs == [("a", 1), ("b", [2])]


def test_builtin_converter_fed_a_global_is_unsafe() -> None:
    # set(SomeClass) iterates a class: its metaclass may run code.
    data = b"\x80\x02c__builtin__\nset\ncsome_mod\nKlass\n\x85R."
    assert scan(data).unsafe == ["some_mod.Klass"]


def test_build_on_a_module_is_unsafe() -> None:
    # The sys.modules override trick: BUILD sets attributes of torch._utils itself.
    data = b"\x80\x04\x8c\x05torch\x8c\x06_utils\x93}\x8c\x01xK\x01sb."
    assert scan(data).unsafe == ["torch._utils"]


def test_computed_global_names_are_unsafe() -> None:
    data = b"\x80\x04K\x01\x8c\x02os\x93."
    result = scan(data)
    assert result.unsafe == ["<int>.os"]


def test_ext_codes_are_unsafe() -> None:
    assert scan(b"\x80\x02\x82\x05)R.").unsafe == ["copyreg-ext.5"]


def test_persistent_ids() -> None:
    data = b"\x80\x02(X\x07\x00\x00\x00storageK\x03tQ."
    assert scan(data).value == PersistentId(("storage", 3))
    seen: list[object] = []

    def hook(pid: object) -> object:
        seen.append(pid)
        return "resolved"

    assert scan(data, persistent_load=hook).value == "resolved"
    assert seen == [("storage", 3)]


def test_unhashable_keys_fall_back() -> None:
    data = b"\x80\x02}]K\x01s."
    value = scan(data).value
    assert isinstance(value, dict)
    (key,) = value
    assert isinstance(key, UnhashableKey)
    assert key.value == []


def test_big_tuple_keys_are_not_rehashed() -> None:
    # A big tuple used as a key over and over would make hashing quadratic: it is wrapped.
    big = b"(" + b"N" * 1000 + b"t\x94"
    data = b"\x80\x04" + big + b"0}" + b"h\x00Ns" * 3 + b"(K\x01K\x02tK\x03s."
    value = scan(data).value
    keys = list(value)
    assert len(keys) == 4
    assert all(isinstance(k, UnhashableKey) for k in keys[:3])
    assert keys[3] == (1, 2)


def test_offset_and_end() -> None:
    first = pickle.dumps([1, 2], protocol=2)
    second = pickle.dumps({"k": "v"}, protocol=4)
    data = first + second + b"\x00junk"
    result = scan(data, offset=len(first))
    assert result.start == len(first)
    assert result.end == len(first) + len(second)
    scans = scan_all(data)
    assert [s.value for s in scans] == [[1, 2], {"k": "v"}]
    assert scans[-1].end == len(first) + len(second)


def test_hidden_second_pickle_is_scanned() -> None:
    data = pickle.dumps(["a"], protocol=4) + pickle.dumps(EvalBoom(), protocol=4)
    scans = scan_all(data)
    assert len(scans) == 2
    assert scans[1].unsafe == ["builtins.eval"]


def test_broken_second_pickle_keeps_what_it_called() -> None:
    evil = pickle.dumps(EvalBoom(), protocol=2)
    data = pickle.dumps(1, protocol=2) + evil[:-1] + b"h\x63"  # then a missing memo entry
    scans = scan_all(data)
    assert len(scans) == 2
    assert scans[1].error is not None
    assert scans[1].unsafe == ["builtins.eval"]


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"\x80\x02\xff.", "unknown opcode b'\\xff' (offset 2)"),
        (b"\x80\x09N.", "unsupported pickle protocol 9 (PROTO at offset 0)"),
        (b"\x80\x02X\xff\xff\xff\x7fabc.", "BINUNICODE at offset 2"),
        (b"\x80\x02\x8b\xff\xff\xff\x7f.", "LONG4 at offset 2"),
        (b"\x80\x02h\x05.", "memo entry 5 was never stored (BINGET at offset 2)"),
        (b"\x80\x02N", "ends before the pickle's STOP"),
        (b"\x80\x02.", "STOP with an empty stack"),
        (b"\x80\x02e.", "no MARK"),
        (b"\x80\x05\x97.", "out-of-band"),
        (b"\x80\x02K\x01K\x02a.", "cannot append to a int"),
    ],
)
def test_malformed_input_names_opcode_and_offset(data: bytes, words: str) -> None:
    with pytest.raises(PickleError) as info:
        scan(data)
    assert words in str(info.value)


def test_out_of_band_buffer_refused() -> None:
    buf = pickle.PickleBuffer(b"abc")
    data = pickle.dumps(buf, protocol=5, buffer_callback=lambda b: False)
    with pytest.raises(PickleError, match="out-of-band"):
        scan(data)


def test_deep_tuples_refused_without_recursion_error() -> None:
    data = b"\x80\x02)" + b"\x85" * (MAX_DEPTH + 5) + b"."
    with pytest.raises(PickleError, match="nested more than"):
        scan(data)


def test_deep_lists_parse_and_classify_without_recursion(tmp_path: Path) -> None:
    depth = 50_000
    data = b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."
    path = tmp_path / "deep.pkl"
    path.write_bytes(data)
    assert isinstance(scan(data).value, list)
    inv = read(path)
    assert inv.bytes_by_category[Category.METADATA] == len(data)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_truncation_fails_cleanly(protocol: int) -> None:
    data = pickle.dumps([SAMPLE, Boom(Path("/nonexistent")), OrderedDict(k=(1, 2.5))],
                        protocol=protocol)
    for cut in range(len(data)):
        with pytest.raises(PickleError):
            scan(data[:cut])


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_random_corruption_never_escapes(protocol: int) -> None:
    data = pickle.dumps([SAMPLE, Boom(Path("/nonexistent"))], protocol=protocol)
    rng = random.Random(protocol)
    for _ in range(400):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        with contextlib.suppress(PickleError):
            scan(bytes(mutated))


def test_bare_pickle_file(tmp_path: Path) -> None:
    path = tmp_path / "evil.pkl"
    marker = tmp_path / "MARKER"
    path.write_bytes(pickle.dumps({"cfg": [1, 2], "x": Boom(marker)}, protocol=4) + b"tail")
    inv = read(path)
    assert inv.format == "pickle"
    assert inv.unsafe_globals == (f"{os.system.__module__}.system",)
    assert inv.bytes_by_category[Category.OTHER] == 4
    assert inv.bytes_by_category[Category.METADATA] == path.stat().st_size - 4
    assert not marker.exists()


def test_numpy_arrays_inside_a_pickle(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "ids": np.arange(5)}
    path = tmp_path / "arrays.pkl"
    path.write_bytes(pickle.dumps(arrays, protocol=4))
    inv = read(path)
    assert inv.unsafe_globals == ()
    by_name = {t.name: t for t in inv.tensors}
    assert by_name["w"].shape == (3, 4)
    assert by_name["w"].category == Category.WEIGHTS
    assert by_name["ids"].category == Category.BUFFERS
    assert inv.bytes_by_category[Category.WEIGHTS] == arrays["w"].nbytes
    assert inv.bytes_by_category[Category.BUFFERS] == arrays["ids"].nbytes
    assert inv.file_bytes == path.stat().st_size


def test_corrupt_pickle_file_names_what_it_called(tmp_path: Path) -> None:
    path = tmp_path / "broken.pkl"
    path.write_bytes(pickle.dumps(EvalBoom(), protocol=2)[:-1] + b"h\x63.")
    with pytest.raises(CorruptFileError, match=r"before that it calls builtins\.eval"):
        read(path)


JOBLIB = Path(__file__).resolve().parents[1] / "fixtures" / "pickle"


def test_joblib_file_with_inline_arrays() -> None:
    manifest = json.loads((JOBLIB / "MANIFEST.json").read_text())
    entry = manifest["files"]["arrays.joblib"]
    path = JOBLIB / "arrays.joblib"
    raw = path.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == entry["sha256"]
    arrays = entry["arrays"]

    inv = read(path)
    assert inv.unsafe_globals == ()
    cats = inv.bytes_by_category
    assert cats[Category.WEIGHTS] == arrays["coef"]["nbytes"]
    assert cats[Category.BUFFERS] == arrays["ids"]["nbytes"]
    assert cats[Category.OTHER] == arrays["names"]["nbytes"]
    assert inv.file_bytes == entry["bytes"] == sum(cats.values())
    by_name = {t.name: t for t in inv.tensors}
    assert by_name["model.coef"].shape == tuple(arrays["coef"]["shape"])
    offsets = {s.key: s.offset for s in inv.storages}
    assert offsets[by_name["model.coef"].storage] == arrays["coef"]["offset"]
    assert offsets[by_name["model.ids"].storage] == arrays["ids"]["offset"]


def test_truncated_joblib_file(tmp_path: Path) -> None:
    path = tmp_path / "cut.joblib"
    path.write_bytes((JOBLIB / "arrays.joblib").read_bytes()[:300])
    with pytest.raises(CorruptFileError, match="runs past the end of the file"):
        read(path)


# -- bytes pickled as latin-1 text (Python 3, protocols 1-2) ---------------------------------
@pytest.mark.parametrize("protocol", [1, 2])
def test_latin1_bytes_become_a_blob_where_the_text_lies(protocol: int) -> None:
    raw = bytes(range(256)) * 2  # half of it above 127: two UTF-8 bytes each
    data = pickle.dumps({"a": raw, "b": b"\x01ascii"}, protocol=protocol)
    value = scan(data).value
    assert isinstance(value, dict)
    blob = value["a"]
    assert isinstance(blob, Blob) and blob.kind == "latin1"
    assert blob.nbytes == len(raw)
    text = raw.decode("latin-1").encode("utf-8")
    assert blob.stored_nbytes == len(text) == 768
    assert data[blob.offset : blob.offset + blob.stored_nbytes] == text
    assert blob.read(data) == raw
    assert value["b"].read(data) == b"\x01ascii"


def test_encode_to_another_codec_or_with_wide_text_stays_a_call() -> None:
    enc = b"c_codecs\nencode\nq\x00"
    for args in (b"X\x02\x00\x00\x00abX\x05\x00\x00\x00utf-8\x86",
                 b"X\x03\x00\x00\x00\xe2\x82\xacX\x06\x00\x00\x00latin1\x86",
                 b"X\x02\x00\x00\x00ab]\x86"):
        value = scan(b"\x80\x02" + enc + args + b"R.").value
        assert isinstance(value, Call) and str(value.func) == "_codecs.encode", args


def test_numpy_arrays_pickled_at_protocol_2(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    from modelsize.formats.pickle_file import PickleReader

    rng = np.random.default_rng(0)
    arrays = {"w": rng.standard_normal((3, 4)).astype(np.float32), "ids": np.arange(300),
              "empty": np.zeros(0, np.float32)}
    path = tmp_path / "arrays.pkl"
    path.write_bytes(pickle.dumps(arrays, protocol=2))
    inv = read(path)
    by_name = {t.name: t for t in inv.tensors}
    assert {n: (t.dtype, t.shape) for n, t in by_name.items()} == {
        n: (str(a.dtype), a.shape) for n, a in arrays.items()}
    # The stored bytes are the UTF-8 text of the data's latin-1 code points.
    stored = {n: len(a.tobytes().decode("latin-1").encode("utf-8")) for n, a in arrays.items()}
    assert inv.bytes_by_category[Category.WEIGHTS] == stored["w"]
    assert inv.bytes_by_category[Category.BUFFERS] == stored["ids"]
    assert sum(inv.bytes_by_category.values()) == path.stat().st_size
    assert any("latin-1 text" in n for n in inv.notes)
    for t in inv.tensors:  # what slim writes: the arrays' own bytes
        st = next(s for s in inv.storages if s.key == t.storage)
        assert (st.nbytes, st.logical_nbytes) == (stored[t.name], arrays[t.name].nbytes)
        assert b"".join(PickleReader.storage_chunks(inv, st)) == arrays[t.name].tobytes()


def test_empty_bytes_and_odd_calls_at_protocol_2() -> None:
    data = pickle.dumps([b"", b"x"], protocol=2)
    empty, one = scan(data).value  # type: ignore[misc]
    assert isinstance(empty, Blob) and (empty.nbytes, empty.read(data)) == (0, b"")
    assert one.read(data) == b"x"
    # Calling None (a load fails there) is kept as the call it is: the stack stays whole.
    value = scan(b"\x80\x02]N)R\x85.").value
    assert isinstance(value, tuple) and isinstance(value[0], Call) and value[0].func is None


@pytest.mark.parametrize("callee", [b"}", b"]", b")", b"K\x05", b"X\x01\x00\x00\x00f", b"N",
                                    b"C\x01x", b"\x88"])
def test_a_call_of_something_never_callable_is_where_loads_fail(callee: bytes) -> None:
    data = b"\x80\x03" + callee + b")R."
    with pytest.raises(TypeError, match="not callable"):
        pickle.loads(data)
    s = scan(data)
    assert s.fails == f"byte {len(data) - 2}: REDUCE calls a " + s.fails.rsplit(" ", 1)[1]
    assert isinstance(s.value, Call)  # the stack stays whole: what follows is still read


def test_pickle_file_that_calls_a_list_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "calls_a_list.pkl"
    path.write_bytes(b"\x80\x04]\x94)R.")
    with pytest.raises(TypeError, match="'list' object is not callable"):
        pickle.loads(path.read_bytes())
    with pytest.raises(CorruptFileError, match="REDUCE calls a list, which is not callable"):
        read(path)


def test_calls_of_globals_and_call_results_are_not_judged_failing() -> None:
    assert scan(pickle.dumps(OrderedDict(a=1), protocol=2)).fails == ""
    # a call of a call's result: functools.partial(int)() could be callable, not judged
    assert scan(b"\x80\x02cfunctools\npartial\ncbuiltins\nint\n\x85R)R.").fails == ""


def _memo_program(rng: random.Random) -> bytes:
    """A protocol-4 pickle building a list from memo puts and gets at random indices: in
    order, ahead of order, overwritten, MEMOIZE after out-of-order puts, 1- and 4-byte forms."""
    out = [b"\x80\x04]"]  # PROTO 4, EMPTY_LIST
    stored: list[int] = []
    for step in range(rng.randint(1, 40)):
        out.append(b"K" + bytes([step % 256]))  # the value to memoize: BININT1
        kind = rng.random()
        if kind < 0.2:
            out.append(b"\x94")  # MEMOIZE
            stored.append(-1)  # its index is the count of distinct ones: not tracked here
        else:
            idx = rng.choice([len(stored), len(stored) + 1, rng.randrange(0, 300),
                              rng.randrange(0, 2**20)])
            out.append(b"q" + bytes([idx]) if idx < 256 and rng.random() < 0.5
                       else b"r" + idx.to_bytes(4, "little"))
            stored.append(idx)
        out.append(b"a")  # APPEND the value
        known = [i for i in stored if i >= 0]
        if known and rng.random() < 0.5:
            i = rng.choice(known)
            out.append((b"h" + bytes([i]) if i < 256 else b"j" + i.to_bytes(4, "little")) + b"a")
    return b"".join(out) + b"."


@pytest.mark.parametrize("seed", range(3))
def test_memo_puts_and_gets_in_any_order_read_as_pickle_reads_them(seed: int) -> None:
    """The memo is a list for the indices pickle writes in order and a dict for any other:
    every put and get gives what CPython's unpickler gives (MEMOIZE counts distinct indices)."""
    rng = random.Random(seed)
    for _ in range(300):
        data = _memo_program(rng)
        assert scan(data).value == pickle.loads(data), data


def test_a_negative_text_memo_index_is_kept_apart_from_the_list() -> None:
    """PUT -1 (only the text opcodes can say it; CPython refuses it) names its own entry, never
    the list's last one."""
    data = b"(lI3\np0\naI4\np-1\nag0\nag-1\na."
    assert scan(data).value == [3, 4, 3, 4]
