"""TFLite: models converted by the real TFLiteConverter (plain, dynamic-range, float16, full
int8, buffers past the flatbuffer) checked against TensorFlow's own interpreter and flatbuffer
schema, and hand-built flatbuffers that lie about their offsets and lengths."""

from __future__ import annotations

import json
import random
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

import modelsize
from modelsize.categories import Category
from modelsize.diff import diff
from modelsize.errors import CorruptFileError, InputError
from modelsize.formats import Registry, read, sniff_format
from modelsize.formats.tflite import TfliteReader
from modelsize.inventory import Inventory
from tests.conftest import assert_one_line_error, run_cli, run_in_tf

ONLY_TFLITE = Registry([TfliteReader()])
KINDS = ("plain", "dynamic", "float16", "int8", "offset")


def _read(path: Path) -> Inventory:
    return read(path, ONLY_TFLITE)


# -- a minimal flatbuffer writer (children after parents: every uoffset points forward) -----
Field = tuple[str, Any]


def _pad(buf: bytearray, align: int) -> None:
    buf.extend(b"\0" * (-len(buf) % align))


def _emit(buf: bytearray, obj: Field) -> int:
    """Write ``obj`` at the end of ``buf`` (children after it); return its position."""
    kind, value = obj
    _pad(buf, 4)
    if kind == "table":
        fields: list[Field | None] = value
        vtable = len(buf)
        offsets = [0 if f is None else 4 + 4 * i for i, f in enumerate(fields)]
        buf.extend(struct.pack(f"<HH{len(fields)}H", 4 + 2 * len(fields),
                               4 + 4 * len(fields), *offsets))
        _pad(buf, 4)
        pos = len(buf)
        buf.extend(struct.pack("<i", pos - vtable) + b"\0" * (4 * len(fields)))
        for i, f in enumerate(fields):
            if f is None:
                continue
            at = pos + 4 + 4 * i
            if f[0] == "u32":
                struct.pack_into("<I", buf, at, f[1])
            elif f[0] == "u8":
                struct.pack_into("<B", buf, at, f[1])
            else:
                struct.pack_into("<I", buf, at, _emit(buf, f) - at)
        return pos
    if kind == "tables":
        pos = len(buf)
        buf.extend(struct.pack("<I", len(value)) + b"\0" * (4 * len(value)))
        for i, t in enumerate(value):
            at = pos + 4 + 4 * i
            struct.pack_into("<I", buf, at, _emit(buf, ("table", t)) - at)
        return pos
    pos = len(buf)
    if kind == "ints":
        buf.extend(struct.pack(f"<I{len(value)}i", len(value), *value))
    elif kind == "vec":  # (count, items already packed)
        buf.extend(struct.pack("<I", value[0]) + value[1])
    elif kind == "bytes":
        buf.extend(struct.pack("<I", len(value)) + value)
    elif kind == "str":
        buf.extend(struct.pack("<I", len(value)) + value.encode() + b"\0")
    return pos


def tiny_model(shape: tuple[int, ...] = (2, 3), data: bytes = bytes(range(24)),
               buffer: int = 1, metadata: bytes = b"1.5.0\0", inputs: tuple[int, ...] = (1,),
               metadata_buffer: int = 2, version: int = 3,
               input_shape: tuple[int, ...] = (1, 3),
               ops: tuple[tuple[int, list[int], list[int]], ...] = ()) -> bytes:
    """A model of one subgraph with one float32 constant and one input, and one metadata
    buffer named ``min_runtime_version``; ``ops``: (opcode index, inputs, outputs) of
    operators, with one operator code (ADD)."""
    tensors = [
        [("ints", list(shape)), ("u8", 0), ("u32", buffer), ("str", "dense/kernel")],
        [("ints", list(input_shape)), ("u8", 0), ("u32", 0), ("str", "input")],
    ]
    operators = [[("u32", code), ("ints", ins), ("ints", outs)] for code, ins, outs in ops]
    subgraph = [("tables", tensors), ("ints", list(inputs)), ("ints", [1]),
                ("tables", operators), ("str", "main")]
    model = [
        ("u32", version), ("tables", [[("u8", 0), None, None, ("u32", 0)]] if ops else []),
        ("tables", [subgraph]), ("str", "hand made"),
        ("tables", [[], [("bytes", data)], [("bytes", metadata)]]), None,
        ("tables", [[("str", "min_runtime_version"), ("u32", metadata_buffer)]]),
    ]
    buf = bytearray(struct.pack("<I", 0) + b"TFL3")
    struct.pack_into("<I", buf, 0, _emit(buf, ("table", model)))
    return bytes(buf)


def _write(tmp_path: Path, data: bytes, name: str = "m.tflite") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_hand_made_model_is_accounted_to_the_byte(tmp_path: Path) -> None:
    data = tiny_model()
    inv = _read(_write(tmp_path, data))
    assert inv.format == "tflite"
    assert [(t.name, t.dtype, t.shape, t.nbytes, t.stored_nbytes, t.category)
            for t in inv.tensors] == [("dense/kernel", "float32", (2, 3), 24, 24,
                                       Category.WEIGHTS)]
    assert inv.bytes_by_category[Category.WEIGHTS] == 24
    assert sum(inv.bytes_by_category.values()) == len(data)
    assert inv.bytes_by_category[Category.GRAPH] > 0
    meta = [r for r in inv.regions if r.label == "metadata min_runtime_version"]
    assert [r.nbytes for r in meta] == [6]
    assert inv.facts["tflite.min_runtime_version"] == "1.5.0"
    assert inv.facts["tflite.tensors"] == "2 (1 constant)"


def test_subgraphs_shared_buffers_names_and_quantization(tmp_path: Path) -> None:
    """Tensors of a second subgraph are named after it; a repeated name gets ``#2``; two
    tensors on one buffer share it; a constant's scales and zero points are its weights; a
    buffer no one names is unused."""
    # min, max absent; scale: two float32; zero_point: two int64.
    quant = [None, None, ("vec", (2, struct.pack("<2f", 0.5, 0.25))),
             ("vec", (2, struct.pack("<2q", 0, 0)))]
    kernel = [("ints", [2, 4]), ("u8", 9), ("u32", 1), ("str", "k"), ("table", quant)]
    again = [("ints", [8]), ("u8", 3), ("u32", 1), ("str", "k")]
    other = [("ints", [4]), ("u8", 2), ("u32", 2), ("str", "shape")]
    model = [
        ("u32", 3), None,
        ("tables", [[("tables", [kernel, again])],
                    [("tables", [other]), None, None, None, ("str", "init")]]),
        None, ("tables", [[], [("bytes", bytes(8))], [("bytes", bytes(16))],
                          [("bytes", bytes(5))]]),
    ]
    buf = bytearray(struct.pack("<I", 0) + b"TFL3")
    struct.pack_into("<I", buf, 0, _emit(buf, ("table", model)))
    inv = _read(_write(tmp_path, bytes(buf)))
    got = {t.name: (t.dtype, t.shape, t.stored_nbytes, t.category, t.tags) for t in inv.tensors}
    assert got == {
        "k": ("int8", (2, 4), 8, Category.WEIGHTS, ("per-channel (axis 0, 2 scales)",)),
        "k#2": ("uint8", (8,), 0, Category.WEIGHTS, ()),
        "init/shape": ("int32", (4,), 16, Category.BUFFERS, ()),
    }
    by = inv.bytes_by_category
    # Weights: the 8 bytes of buffer 1 and the two quantization vectors (4 + 8, 4 + 16).
    assert by[Category.WEIGHTS] == 8 + (4 + 8) + (4 + 16)
    assert (by[Category.BUFFERS], by[Category.UNUSED_STORAGE]) == (16, 5)
    assert sum(by.values()) == len(buf)
    assert inv.facts["tflite.subgraphs"] == "2"


def test_sniffed_by_its_identifier_not_its_name(tmp_path: Path) -> None:
    path = _write(tmp_path, tiny_model(), "model.bin")
    assert sniff_format(path) == "tflite"
    assert modelsize.inspect(path).inventory.format == "tflite"


@pytest.mark.parametrize(
    "data, reason",
    [
        (tiny_model(shape=(4, 3)), "needs 48 bytes but its buffer 1 holds 24"),
        (tiny_model(buffer=7), "refers to buffer 7, but the model has 3"),
        (tiny_model(shape=(-1, 3)), "has shape [-1, 3]"),
        (struct.pack("<I", 1 << 30) + b"TFL3" + bytes(8), "root offset claims bytes"),
        # Found by the fuzz target: the interpreter refuses these ("Invalid tensor index"),
        # and slim wrote them on as "Verified".
        (tiny_model(inputs=(5,)), "subgraphs[0].inputs names tensor 5, but subgraph 0 has 2"),
        (tiny_model(ops=((0, [0, 2147483647], [1]),)),
         "operators[0].inputs names tensor 2147483647, but subgraph 0 has 2"),
        (tiny_model(ops=((0, [0, 1], [12]),)), "operators[0].outputs names tensor 12"),
        (tiny_model(ops=((3, [0, 1], [1]),)), "uses operator code 3, but the model has 1"),
        # TF 2.21's interpreter: "required_bytes <= bytes was not true. Tensor 0 is invalidly
        # specified in schema": an empty data vector makes its tensor a constant of 0 bytes.
        (tiny_model(data=b""), "needs 24 bytes but its buffer 1 holds 0"),
        # slim --dedupe: "internal error: KeyError: (2147483647, 'raw')" before.
        (tiny_model(metadata_buffer=2**31 - 1),
         "refers to buffer 2147483647, but the model has 3"),
        # The interpreter: "BytesRequired number of elements overflowed".
        (tiny_model(input_shape=(-2**31, 3)), "whose bytes overflow 64 bits"),
        # TFLite's Python API decodes names strictly (UnicodeDecodeError).
        (tiny_model().replace(b"dense/kernel", b"dense/ker\xfeel"),
         "tensors[0].name is not UTF-8 text"),
    ],
    ids=["shape-larger-than-buffer", "buffer-index", "negative-dim", "root-offset",
         "subgraph-input-index", "operator-input-index", "operator-output-index",
         "operator-code-index", "empty-data-vector", "metadata-buffer-index",
         "activation-shape-overflow", "name-not-utf8"],
)
def test_lying_models_are_refused(tmp_path: Path, data: bytes, reason: str) -> None:
    with pytest.raises(CorruptFileError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        _read(_write(tmp_path, data))


def test_operators_naming_their_tensors_and_optional_inputs_are_read(tmp_path: Path) -> None:
    inv = _read(_write(tmp_path, tiny_model(ops=((0, [0, -1], [1]),))))
    assert inv.facts["tflite.operators"] == "1 (1 kinds)"


def test_lying_vector_length_is_refused_without_allocating(tmp_path: Path) -> None:
    data = bytearray(tiny_model())
    at = bytes(data).index(bytes(range(24))) - 4  # the data vector's length prefix
    struct.pack_into("<I", data, at, 0xFFFFFFF0)
    path = _write(tmp_path, bytes(data))
    with pytest.raises(CorruptFileError, match=r"buffers\[1\]\.data \(4294967280 elements\)"):
        _read(path)
    assert_one_line_error(run_cli("inspect", str(path)), path)


def test_truncated_files_are_refused_in_one_line(tmp_path: Path) -> None:
    data = tiny_model()
    for cut in range(8, len(data), 7):
        path = _write(tmp_path, data[:cut], f"cut{cut}.tflite")
        with pytest.raises(CorruptFileError):
            _read(path)
    path = _write(tmp_path, data[:40], "cut.tflite")
    assert_one_line_error(run_cli("inspect", str(path)), path)


def test_fuzzed_models_read_or_fail_cleanly(tmp_path: Path) -> None:
    """Random byte changes past the identifier: a clean read that adds up, or an InputError."""
    data = tiny_model()
    rng = random.Random(10)
    outcomes = {"read": 0, "refused": 0}
    for i in range(300):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            at = rng.choice([0, 1, 2, 3, *range(8, len(data))])
            mutated[at] = rng.randrange(256)
        path = _write(tmp_path, bytes(mutated), f"f{i}.tflite")
        try:
            inv = _read(path)
        except InputError:
            outcomes["refused"] += 1
            continue
        assert sum(inv.bytes_by_category.values()) == len(mutated)
        outcomes["read"] += 1
    assert outcomes["read"] and outcomes["refused"]


# -- real converter outputs ------------------------------------------------------------------
_CONVERT = r'''
import json, os, sys
import numpy as np
import tensorflow as tf
from tensorflow.lite.python import schema_py_generated as schema

out = sys.argv[1]
tf.keras.utils.set_random_seed(0)
inp = tf.keras.Input((16, 16, 3), name="image")
x = tf.keras.layers.Conv2D(8, 3, name="conv")(inp)
x = tf.keras.layers.BatchNormalization(name="bn")(x)
x = tf.keras.layers.ReLU()(x)
x = tf.keras.layers.Conv2D(16, 3, name="conv2")(x)
x = tf.keras.layers.Flatten()(x)
x = tf.keras.layers.Dense(64, name="fc1")(x)
y = tf.keras.layers.Dense(10, name="fc2")(x)
saved = os.path.join(out, "saved")
tf.keras.Model(inp, y).export(saved, verbose=False)

def representative():
    rng = np.random.default_rng(0)
    for _ in range(4):
        yield [rng.standard_normal((1, 16, 16, 3)).astype(np.float32)]

files = {}
for kind in ("plain", "dynamic", "float16", "int8", "offset"):
    c = tf.lite.TFLiteConverter.from_saved_model(saved)
    if kind in ("dynamic", "float16", "int8"):
        c.optimizations = [tf.lite.Optimize.DEFAULT]
    if kind == "float16":
        c.target_spec.supported_types = [tf.float16]
    if kind == "int8":
        c.representative_dataset = representative
        c.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        c.inference_input_type = c.inference_output_type = tf.int8
    if kind == "offset":
        c._experimental_use_buffer_offset = True  # buffers after the flatbuffer, as past 2 GB
    data = c.convert()
    path = os.path.join(out, kind + ".tflite")
    with open(path, "wb") as f:
        f.write(data)
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(data, 0))
    sizes = [len(b.data) if b.data is not None and len(b.data) else
             int(b.size) if (b.offset or 0) > 1 else 0 for b in model.buffers]
    details = {d["index"]: d for d in tf.lite.Interpreter(model_path=path).get_tensor_details()}
    tensors, quant_bytes = [], 0
    for i, t in enumerate(model.subgraphs[0].tensors):
        d, q = details[i], details[i]["quantization_parameters"]
        dtype = np.dtype(d["dtype"])
        tensors.append({"name": d["name"], "dtype": dtype.name, "shape": d["shape"].tolist(),
                        "nbytes": int(np.prod(d["shape"])) * dtype.itemsize,
                        "buffer": int(t.buffer), "buffer_bytes": sizes[t.buffer],
                        "scales": len(q["scales"]), "axis": int(q["quantized_dimension"])})
        tq = t.quantization
        if sizes[t.buffer] and tq is not None:  # each present vector: length prefix + items
            for values, item in ((tq.scale, 4), (tq.zeroPoint, 8), (tq.min, 4), (tq.max, 4)):
                if values is not None:
                    quant_bytes += 4 + len(values) * item
    files[kind] = {"path": path, "file_bytes": len(data), "tensors": tensors,
                   "quant_bytes": quant_bytes,
                   "metadata": {m.name.decode(): sizes[m.buffer] for m in model.metadata or []}}
print(json.dumps({"saved": saved, "files": files}))
'''


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Five conversions of one small Keras CNN, with TensorFlow's view of each."""
    out = tmp_path_factory.mktemp("tflite")
    proc = run_in_tf(_CONVERT, str(out))
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", KINDS)
def test_constants_match_the_interpreter(converted: dict[str, Any], kind: str) -> None:
    truth = converted["files"][kind]
    inv = _read(Path(truth["path"]))
    ours = {t.name: t for t in inv.tensors}
    constants = {t["name"]: t for t in truth["tensors"] if t["buffer_bytes"]}
    assert sorted(ours) == sorted(constants)
    for name, t in constants.items():
        mine = ours[name]
        assert (mine.dtype, list(mine.shape), mine.nbytes) == (t["dtype"], t["shape"],
                                                               t["nbytes"]), name
        assert mine.nbytes == t["buffer_bytes"], name
        tag = f"per-channel (axis {t['axis']}, {t['scales']} scales)"
        assert mine.tags == ((tag,) if t["scales"] > 1 else ("per-tensor",) if t["scales"]
                             else ()), name
    assert inv.file_bytes == truth["file_bytes"]
    assert sum(inv.bytes_by_category.values()) == truth["file_bytes"]


@pytest.mark.parametrize("kind", KINDS)
def test_weight_bytes_are_buffers_plus_their_quantization(converted: dict[str, Any],
                                                          kind: str) -> None:
    truth = converted["files"][kind]
    inv = _read(Path(truth["path"]))
    by = inv.bytes_by_category
    buffers = {t["buffer"]: t["buffer_bytes"] for t in truth["tensors"] if t["buffer_bytes"]}
    assert by[Category.WEIGHTS] + by[Category.BUFFERS] == (sum(buffers.values())
                                                           + truth["quant_bytes"])
    meta = sum(r.nbytes for r in inv.regions if r.label.startswith("metadata "))
    assert meta == sum(truth["metadata"].values())
    assert by[Category.UNUSED_STORAGE] == by[Category.DUPLICATES] == 0


def test_quantized_conversions_shrink_the_weights(converted: dict[str, Any]) -> None:
    weights = {k: _read(Path(f["path"])).bytes_by_category[Category.WEIGHTS]
               for k, f in converted["files"].items()}
    assert weights["float16"] < weights["plain"] and weights["dynamic"] < weights["float16"]
    dtypes = {k: {t.dtype for t in _read(Path(f["path"])).tensors if len(t.shape) > 1}
              for k, f in converted["files"].items()}
    assert dtypes["plain"] == dtypes["offset"] == {"float32"}
    assert dtypes["float16"] == {"float16"}
    assert dtypes["int8"] == {"int8"}
    # Dynamic range quantizes kernels of 1024 elements or more: not the first conv's 216.
    assert dtypes["dynamic"] == {"int8", "float32"}


def test_int8_model_is_int8_with_int32_biases(converted: dict[str, Any]) -> None:
    inv = _read(Path(converted["files"]["int8"]["path"]))
    quantized = {t.dtype for t in inv.tensors if t.tags}
    assert quantized == {"int8", "int32"}
    biases = [t for t in inv.tensors if t.dtype == "int32" and t.tags]
    assert biases and all(t.category is Category.WEIGHTS for t in biases)
    assert inv.facts["tflite.quantization"] == "6 constant tensors quantized, 6 per-channel"


def test_cli_inspect_json(converted: dict[str, Any]) -> None:
    truth = converted["files"]["dynamic"]
    proc = run_cli("inspect", truth["path"], "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["format"] == "tflite"
    assert sum(report["bytes_by_category"].values()) == truth["file_bytes"]


@pytest.mark.parametrize("kind", ["plain", "int8"])
def test_diff_with_its_saved_model_matches_kernels_by_layout(converted: dict[str, Any],
                                                             kind: str) -> None:
    """No name is shared: the four kernels pair by their dimensions (TFLite stores them
    transposed, OHWI and out x in), the ambiguous 8- and 16-element vectors pair with none."""
    truth = converted["files"][kind]
    d = diff(converted["saved"], truth["path"])
    assert (d.a.format, d.b.format, d.renamed, d.by_layout) == ("tensorflow", "tflite", 0, 4)
    # From the model: 16x16x3 input, two 3x3 convs (8, 16 filters) -> 12x12x16 = 2304.
    assert {(c.a.shape, c.b.shape) for c in d.changed} == {
        ((3, 3, 3, 8), (8, 3, 3, 3)), ((3, 3, 8, 16), (16, 3, 3, 8)),
        ((2304, 64), (64, 2304)), ((64, 10), (10, 64))}
    names = {t["name"]: t for t in truth["tensors"]}
    for c in d.changed:
        assert names[c.b.name]["shape"] == list(c.b.shape)
        assert c.b.dtype == ("int8" if kind == "int8" else "float32")
    assert d.to_dict()["tensors"]["matched_by_layout"] == 4


# -- sparse tensors: densified as TFLite's Densify does --------------------------------------
_SPARSE = r'''
import json, os, sys, warnings
import numpy as np
warnings.filterwarnings("ignore")
import tensorflow as tf

out = sys.argv[1]
tf.keras.utils.set_random_seed(0)
inp = tf.keras.Input((64,))
layer = tf.keras.layers.Dense(48)
model = tf.keras.Model(inp, layer(inp))
w, b = layer.get_weights()
keep = np.random.default_rng(0).random(w.shape) < 0.1
layer.set_weights([np.where(keep, w, 0).astype("f4"), b])
c = tf.lite.TFLiteConverter.from_keras_model(model)
c.optimizations = [tf.lite.Optimize.EXPERIMENTAL_SPARSITY]
path = os.path.join(out, "sparse.tflite")
with open(path, "wb") as f:
    f.write(c.convert())
# The reference kernels (no XNNPACK) keep the DENSIFY operator's output.
it = tf.lite.Interpreter(model_path=path, experimental_preserve_all_tensors=True,
                         experimental_op_resolver_type=(
                             tf.lite.experimental.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES))
it.allocate_tensors()
x = it.get_input_details()[0]
it.set_tensor(x["index"], np.zeros(x["shape"], np.float32))
it.invoke()
[dense] = [it.get_tensor(d["index"]) for d in it.get_tensor_details()
           if d["name"] == "Densify_output"]
print(json.dumps({"path": path, "dense": dense.astype("<f4").tobytes().hex(),
                  "shape": list(dense.shape), "nonzero": int((dense != 0).sum())}))
'''


@pytest.fixture(scope="module")
def sparse_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("tflite_sparse")
    proc = run_in_tf(_SPARSE, str(out))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sparse_tensor_reads_dense_as_the_interpreter_densifies_it(
        sparse_model: dict[str, Any], tmp_path: Path) -> None:
    """Before: ``slim --to safetensors`` of a sparse model said the tensor was stored "in a way
    modelsize cannot decode"; now its tensor is the DENSIFY operator's output, byte for byte."""
    from modelsize.slimming.verify import crc_of

    path = Path(sparse_model["path"])
    inv = _read(path)
    [kernel] = [t for t in inv.tensors if "sparse" in t.tags]
    assert list(kernel.shape) == sparse_model["shape"]
    dense = bytes.fromhex(sparse_model["dense"])
    assert crc_of(inv, kernel) == (zlib.crc32(dense), len(dense))
    out = tmp_path / "dense.safetensors"
    report = modelsize.slim(path, out, to="safetensors")
    assert report.verified
    [tensor] = load_file(str(out)).values()
    assert tensor.tobytes() == dense and int((tensor != 0).sum()) == sparse_model["nonzero"]


def test_lying_sparsity_is_refused_in_one_line(sparse_model: dict[str, Any],
                                               tmp_path: Path) -> None:
    """Segments that run backwards or past the indices: one line, exit 2, nothing written."""
    data = bytearray(Path(sparse_model["path"]).read_bytes())
    # The CSR level's segments: 49 increasing uint16/int32 values ending in the value count;
    # reverse two of them.
    inv = _read(Path(sparse_model["path"]))
    [kernel] = [t for t in inv.tensors if "sparse" in t.tags]
    count = next(s.nbytes for s in inv.storages if s.key == kernel.storage) // 4
    found, width = -1, 0
    for code, size in (("<i4", 4), ("<u2", 2), ("<u1", 1)):
        for start in range(8, len(data) - 49 * size, size):
            vals = np.frombuffer(bytes(data[start:start + 49 * size]), dtype=code)
            if vals[0] == 0 and vals[-1] == count and (np.diff(vals.astype(np.int64)) >= 0).all():
                found, width = start, size
                break
        if found >= 0:
            break
    assert found >= 0, "no segment array found"
    data[found + 10 * width:found + 11 * width] = (count + 7).to_bytes(width, "little")
    path = tmp_path / "lying.tflite"
    path.write_bytes(bytes(data))
    proc = run_cli("slim", str(path), "--to", "safetensors", "-o", str(tmp_path / "o.st"))
    assert_one_line_error(proc, path)
    assert not (tmp_path / "o.st").exists()


def test_densify_block_sparse_by_hand() -> None:
    """A 4x4 matrix stored as 1x2 blocks along its columns (rows dense, block columns CSR,
    the block's two elements dense): the layout TFLite's FormatConverter reads."""
    from modelsize.formats.tflite import _densify

    # Dense matrix (row-major):      blocks kept (row, block column): (0,1) (2,0) (3,1)
    #  0 0 1 2
    #  0 0 0 0
    #  3 4 0 0
    #  0 0 5 6
    values = struct.pack("<6f", 1, 2, 3, 4, 5, 6)
    levels = [(0, 4, [], []), (1, 0, [0, 1, 1, 2, 3], [1, 0, 1]), (0, 2, [], [])]
    dense = _densify(values, 4, (4, 4), [0, 1, 2], [1], levels)
    assert struct.unpack("<16f", dense) == (0, 0, 1, 2, 0, 0, 0, 0, 3, 4, 0, 0, 0, 0, 5, 6)
