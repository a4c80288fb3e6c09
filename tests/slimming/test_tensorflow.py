"""slim of TensorFlow checkpoints: bundles written without TensorFlow, read back by TensorFlow.

Inputs are the committed fixtures (``tests/fixtures/tensorflow``, written by TF 2.21, Keras 3
and tf_keras), the demo's TF1 checkpoint, and checkpoints TensorFlow writes in the test. Every
round trip runs in the TensorFlow venv (``run_in_tf``): ``tf.train.load_checkpoint`` checks
each entry's CRC-32C as it reads, and the values are compared byte for byte with TensorFlow's
own reading of the input. Expected sizes come from TensorFlow's shapes and dtypes.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import modelsize
from modelsize import Category
from modelsize.errors import CorruptFileError, UsageError
from modelsize.formats._sstable import crc32c as crc32c_table
from modelsize.formats._sstable import iter_table
from modelsize.slimming.writers import _tfcrc
from modelsize.slimming.writers._tftable import table
from tests.conftest import REPO, assert_one_line_error, run_cli, run_in_tf

FIXTURES = REPO / "tests" / "fixtures" / "tensorflow"
DEMO = REPO / "src" / "modelsize" / "demo_data" / "tf1_mlp_adam"

#: The TensorFlow side of every round trip, run once for all of them (importing TensorFlow
#: takes seconds). ``sys.argv[1]`` is ``[[case, src, out], ...]``; each case's check (the
#: function named before any dot) runs in its own ``try``; the results come back as JSON,
#: ``{case: value or {"error": traceback}}``.
_TF_CHECKS = r"""
import json, sys, traceback
import numpy as np
import tensorflow as tf
tf1 = tf.compat.v1

def same(src, out, skip=("_CHECKPOINTABLE_OBJECT_GRAPH",)):
    # Every tensor of out equals src's, bit for bit; {name: [dtype, shape]} of out.
    a, b = tf.train.load_checkpoint(src), tf.train.load_checkpoint(out)
    dtypes = b.get_variable_to_dtype_map()
    result = {}
    for name, shape in b.get_variable_to_shape_map().items():
        if name not in skip:
            x, y = np.asarray(a.get_tensor(name)), np.asarray(b.get_tensor(name))
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert (x.tobytes() == y.tobytes() if x.dtype != object
                    else x.tolist() == y.tolist()), name
        result[name] = [dtypes[name].name, list(shape)]
    return result

def demo(src, out):
    model = {n: s for n, s in tf.train.list_variables(src)
             if "Adam" not in n and "power" not in n and n != "global_step"}
    result = same(src, out)
    assert sorted(result) == sorted(model), (sorted(result), sorted(model))
    graph = tf.Graph()
    with graph.as_default():
        variables = [tf1.get_variable(n, s) for n, s in sorted(model.items())]
        with tf1.Session() as sess:
            tf1.train.Saver(var_list=variables).restore(sess, out)
            reader = tf.train.load_checkpoint(src)
            for v in variables:
                assert sess.run(v).tobytes() == reader.get_tensor(v.op.name).tobytes(), v.op.name
    return {"bytes": sum(4 * int(np.prod(s)) for s in model.values())}

def keras3(src, out):
    import keras
    src, out = tf.train.latest_checkpoint(src), tf.train.latest_checkpoint(out)
    keys = same(src, out)

    def build():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                 keras.layers.BatchNormalization(), keras.layers.Dense(2)])

    model, reference = build(), build()
    status = tf.train.Checkpoint(model=model).restore(out)
    status.assert_consumed()  # every object of the graph matched, every value used
    tf.train.Checkpoint(model=reference).restore(src).expect_partial()
    for v, r in zip(model.variables, reference.variables, strict=True):
        assert v.numpy().tobytes() == r.numpy().tobytes(), v.path
    return {"keys": sorted(keys), "variables": len(model.variables)}

def slots(src, out):
    from tensorflow.core.protobuf import trackable_object_graph_pb2
    keys = same(src, out)
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(tf.train.load_checkpoint(out).get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    assert not any(n.slot_variables for n in graph.nodes)
    assert not any(c.local_name == "optimizer" for n in graph.nodes for c in n.children)

    def layer(**shapes):
        m = tf.Module()
        for name, shape in shapes.items():
            setattr(m, name, tf.Variable(tf.zeros(shape)))
        return m

    model = tf.Module()  # the tf_keras model's checkpoint structure, rebuilt without tf_keras
    setattr(model, "layer_with_weights-0", layer(kernel=(4, 8), bias=(8,)))
    setattr(model, "layer_with_weights-1", layer(gamma=(8,), beta=(8,), moving_mean=(8,),
                                                 moving_variance=(8,)))
    setattr(model, "layer_with_weights-2", layer(kernel=(8, 2), bias=(2,)))
    tf.train.Checkpoint(model=model).read(out).assert_consumed()
    reader = tf.train.load_checkpoint(src)
    for i, name in [(0, "kernel"), (1, "moving_variance"), (2, "bias")]:
        value = getattr(getattr(model, f"layer_with_weights-{i}"), name).numpy()
        key = f"model/layer_with_weights-{i}/{name}/.ATTRIBUTES/VARIABLE_VALUE"
        assert value.tobytes() == reader.get_tensor(key).tobytes(), key
    return {"keys": len(keys)}

def partitioned(src, out):
    keys = same(src, out)
    graph = tf.Graph()
    with graph.as_default():
        emb = tf1.get_variable("embedding", [8, 2], partitioner=tf1.fixed_size_partitioner(2))
        with tf1.Session() as sess:
            tf1.train.Saver(var_list=[emb]).restore(sess, out)
            value = sess.run(emb.as_tensor())
    assert value.tobytes() == tf.train.load_checkpoint(src).get_tensor("embedding").tobytes()
    return keys

def dedupe(src, out):
    a, b = tf.train.load_checkpoint(src), tf.train.load_checkpoint(out)
    key = "model/{}/.ATTRIBUTES/VARIABLE_VALUE".format
    for name in "ab":
        assert a.get_tensor(key(name)).tobytes() == b.get_tensor(key(name)).tobytes()
    c = b.get_tensor(key("c"))
    assert c.dtype == np.float32
    assert c.tobytes() == a.get_tensor(key("c")).astype(np.float32).tobytes()
    module = tf.Module()
    module.a, module.b = tf.Variable(tf.zeros((64, 32))), tf.Variable(tf.zeros((64, 32)))
    module.c = tf.Variable(tf.zeros(5))
    tf.train.Checkpoint(model=module).read(out).assert_consumed()
    return module.b.numpy().tobytes() == a.get_tensor(key("b")).tobytes()

def restore_all(src, out):
    # RestoreV2 of every entry, as a restore does (slices copied into their full tensor).
    dtypes = tf.train.load_checkpoint(out).get_variable_to_dtype_map()
    names = sorted(dtypes)
    tf.raw_ops.RestoreV2(prefix=out, tensor_names=names, shape_and_slices=[""] * len(names),
                         dtypes=[dtypes[n] for n in names])
    return {n: d.name for n, d in dtypes.items()}

def refuses(src, out):
    # what TensorFlow says of a damaged string tensor (input only: slim must refuse it)
    try:
        tf.train.load_checkpoint(src).get_tensor("vocab")
    except tf.errors.OpError as exc:
        words = ("The length checksum does not match", "Checksum does not match")
        return next((w for w in words if w in exc.message), exc.message)
    return "read"

results = {}
for case, src, out in json.loads(sys.argv[1]):
    try:
        results[case] = globals()[case.split(".")[0]](src, out)
    except Exception:
        results[case] = {"error": traceback.format_exc()[-3000:]}
print(json.dumps(results))
"""

#: A checkpoint with two equal variables and a float64 one, written by TensorFlow.
_TF_MAKE_DUPLICATES = """
import sys
import numpy as np
import tensorflow as tf
rng = np.random.default_rng(0)
x = rng.standard_normal((64, 32)).astype(np.float32)
module = tf.Module()
module.a, module.b = tf.Variable(x), tf.Variable(x.copy())
module.c = tf.Variable(rng.standard_normal(5))
tf.train.Checkpoint(model=module).write(sys.argv[1])
"""


def _copy(name: str, root: Path) -> Path:
    dest = root / name
    shutil.copytree(FIXTURES / name, dest)
    return dest


@dataclass
class RoundTrips:
    """Every slim of this module, and what TensorFlow made of each output."""

    root: Path
    reports: dict[str, modelsize.SlimReport] = field(default_factory=dict)
    stdout: dict[str, str] = field(default_factory=dict)
    checked: dict[str, Any] = field(default_factory=dict)

    def tf(self, case: str) -> Any:
        """TensorFlow's result for ``case`` (fails the test with its traceback)."""
        result = self.checked[case]
        if isinstance(result, dict) and "error" in result:
            pytest.fail(f"TensorFlow check of {case} failed:\n{result['error']}")
        return result


@pytest.fixture(scope="module")
def trips(tmp_path_factory: pytest.TempPathFactory) -> RoundTrips:
    """Slim each input (the demo through the CLI, as its finding prints it), then check every
    output in one TensorFlow process."""
    root = tmp_path_factory.mktemp("tf")
    trips = RoundTrips(root)
    run_in_tf(_TF_MAKE_DUPLICATES, str(root / "dup" / "ckpt"))
    cases: list[list[str]] = []

    shutil.copytree(DEMO, root / "tf1_mlp_adam")
    proc = run_cli("inspect", "tf1_mlp_adam/model.ckpt", "--json", cwd=root)
    assert proc.returncode == 0, proc.stderr
    action = next(f["action"] for f in json.loads(proc.stdout)["findings"]
                  if f["kind"] == "optimizer_state")
    trips.stdout["demo.action"] = action
    proc = run_cli(*shlex.split(action)[1:], cwd=root)
    assert proc.returncode == 0, proc.stderr
    trips.stdout["demo"] = proc.stdout
    cases.append(["demo", str(root / "tf1_mlp_adam" / "model.ckpt"),
                  str(root / "tf1_mlp_adam" / "model.ckpt.slim")])

    keras3 = _copy("tf2_keras3", root)
    trips.reports["keras3"] = modelsize.slim(keras3)
    cases.append(["keras3", str(keras3), str(root / "tf2_keras3.slim")])

    slots = _copy("tf2_slots", root) / "weights"
    trips.reports["slots"] = modelsize.slim(slots, root / "slots", drop=["optimizer_state"])
    cases.append(["slots", str(slots), str(root / "slots")])

    one = _copy("tf1", root) / "model.ckpt"
    sharded = _copy("tf1_sharded", root) / "model.ckpt"
    trips.reports["one"] = modelsize.slim(one, root / "one", drop=["optimizer_state"])
    trips.reports["sharded"] = modelsize.slim(sharded.with_name("model.ckpt.index"),
                                              root / "sharded.index", drop=["optimizer_state"])
    cases += [["partitioned", str(one), str(root / "one")],
              ["partitioned.sharded", str(sharded), str(root / "sharded")]]

    trips.reports["half"] = modelsize.slim(one, root / "half", cast="float16")
    cases.append(["restore_all", str(one), str(root / "half")])

    dup = root / "dup" / "ckpt"
    trips.reports["dedupe.dry"] = modelsize.slim(dup, root / "dup" / "slim", dedupe=True,
                                                 cast="float32", dry_run=True)
    trips.reports["dedupe"] = modelsize.slim(dup, root / "dup" / "slim", dedupe=True,
                                             cast="float32")
    cases.append(["dedupe", str(dup), str(root / "dup" / "slim")])

    for case, at in _DAMAGED.items():
        damaged = _copy("tf1", root / "damaged" / case) / "model.ckpt"
        data, offset, nbytes = _vocab(damaged)
        raw = bytearray(data.read_bytes())
        assert raw[offset : offset + 3] == b"\x01\x02\x03" and nbytes == 13  # 3 lengths
        raw[offset + at] ^= 0x10
        data.write_bytes(bytes(raw))
        cases.append([f"refuses.{case}", str(damaged), ""])

    proc = run_in_tf(_TF_CHECKS, json.dumps(cases))
    trips.checked = json.loads(proc.stdout.strip().splitlines()[-1])
    return trips


#: Where the tf1 fixture's ``vocab`` (string [3]: "a", "bb", "ccc", written by TensorFlow) is
#: damaged, from its first byte: 6 lies in the length checksum, 8 in "bb".
_DAMAGED = {"lengths": 6, "payload": 8}


def _vocab(src: Path) -> tuple[Path, int, int]:
    """The data file of a tf1 checkpoint's ``vocab``, where its bytes start, how many."""
    inv = modelsize.inspect(src).inventory
    vocab = next(t for t in inv.tensors if t.name == "vocab")
    storage = next(s for s in inv.storages if s.key == vocab.storage)
    return inv.files[storage.file].path, storage.offset, storage.nbytes


def test_demo_fix_runs_as_printed_and_a_tf1_saver_restores_the_model(trips: RoundTrips) -> None:
    assert trips.stdout["demo.action"] == (
        "modelsize slim tf1_mlp_adam/model.ckpt --drop optimizer_state "
        "-o tf1_mlp_adam/model.ckpt.slim")
    assert "tf.compat.v1.train.Saver(var_list=" in trips.stdout["demo"]  # the note on the .meta
    folder = trips.root / "tf1_mlp_adam"
    written = sorted(p.name for p in folder.glob("model.ckpt.slim*"))
    assert written == ["model.ckpt.slim.data-00000-of-00001", "model.ckpt.slim.index"]
    after = modelsize.inspect(folder / "model.ckpt.slim")
    assert after.inventory.bytes_by_category[Category.OPTIMIZER_STATE] == 0
    assert not [f for f in after.findings if f.kind.value == "optimizer_state"]
    data = folder / "model.ckpt.slim.data-00000-of-00001"
    assert data.stat().st_size == trips.tf("demo")["bytes"]


def test_tf2_keras3_folder_restores_into_a_rebuilt_model(trips: RoundTrips) -> None:
    report = trips.reports["keras3"]
    out = trips.root / "tf2_keras3.slim"
    assert report.target == out
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index"]
    assert report.output_bytes == report.predicted_bytes
    assert modelsize.inspect(out).inventory.bytes_by_category[Category.OPTIMIZER_STATE] == 0
    got = trips.tf("keras3")
    assert got["variables"] == 8
    # Keys are kept (Keras 3 keys model kernels under the optimizer it walked first); the
    # optimizer's own variables are gone.
    assert not [k for k in got["keys"] if "optimizer/_variables" in k or "_iterations" in k]


def test_tf2_slot_variables_and_optimizer_leave_the_object_graph(trips: RoundTrips) -> None:
    report = trips.reports["slots"]
    assert {d.category for d in report.dropped} == {Category.OPTIMIZER_STATE}
    assert len(report.dropped) == 17  # slots m and v of 6 variables, and Adam's 5 scalars
    assert trips.tf("slots") == {"keys": 9}  # 8 model variables and the object graph


def test_partitioned_sharded_and_string_tensors_read_back(trips: RoundTrips) -> None:
    assert not list(trips.root.glob("sharded.data-0000?-of-00003"))
    for case in ("partitioned", "partitioned.sharded"):
        assert trips.tf(case) == {
            "dense/kernel": ["float32", [4, 3]], "dense/bias": ["float32", [3]],
            "embedding": ["float32", [8, 2]], "vocab": ["string", [3]]}


def test_cast_float16_keeps_partitioned_slices_restorable(trips: RoundTrips) -> None:
    """TensorFlow cannot restore a partitioned variable's float16 slices ("Dtype half not
    supported", found by the fuzz target's seed check): they stay float32, the rest is cast."""
    dtypes = trips.tf("restore_all")
    assert {n: d for n, d in dtypes.items() if n.startswith("embedding")} == {
        "embedding": "float32", "embedding/Adam": "float32", "embedding/Adam_1": "float32"}
    assert dtypes["dense/kernel"] == dtypes["dense/bias/Adam"] == "float16"
    assert any("6 slice(s) of partitioned variables kept" in n
               for n in trips.reports["half"].notes)


def test_dedupe_shares_bytes_and_cast_is_read_back_narrowed(trips: RoundTrips) -> None:
    report = trips.reports["dedupe"]
    assert report.output_bytes == trips.reports["dedupe.dry"].predicted_bytes
    assert any("share their original's bytes" in n for n in report.notes)
    assert any("restoring them into variables of the old dtype" in n for n in report.notes)
    folder = trips.root / "dup"
    # b's copy is gone (64 * 32 float32), c went from 5 float64 to 5 float32.
    assert (folder / "slim.data-00000-of-00001").stat().st_size == (
        (folder / "ckpt.data-00000-of-00001").stat().st_size - 64 * 32 * 4 - 5 * 4)
    inv = modelsize.inspect(folder / "slim").inventory
    assert inv.bytes_by_category[Category.DUPLICATES] == 0
    assert trips.tf("dedupe") is True


@pytest.mark.parametrize("case", ["demo", "tf2_keras3", "tf2_slots", "tf1_sharded"])
def test_dry_run_predicts_the_exact_size(tmp_path: Path, case: str) -> None:
    if case == "demo":
        src = tmp_path / "tf1_mlp_adam" / "model.ckpt"
        shutil.copytree(DEMO, src.parent)
    else:
        src = _copy(case, tmp_path)
        src = src / "weights" if case == "tf2_slots" else src
    dry = modelsize.slim(src, dry_run=True)
    report = modelsize.slim(src)
    assert dry.predicted_bytes == report.output_bytes == sum(n for _, n in report.output_files)
    assert report.verified


def test_saved_model_is_refused_in_one_line(tmp_path: Path) -> None:
    src = _copy("saved_model", tmp_path)
    proc = run_cli("slim", str(src))
    assert_one_line_error(proc, src)
    assert "--to safetensors" in proc.stderr
    assert not list(tmp_path.glob("saved_model.slim*"))


def test_a_folder_as_output_prefix_is_refused(tmp_path: Path) -> None:
    shutil.copytree(DEMO, tmp_path / "in")
    (tmp_path / "out").mkdir()
    with pytest.raises(UsageError, match="name the output's prefix inside it"):
        modelsize.slim(tmp_path / "in" / "model.ckpt", tmp_path / "out")


@pytest.mark.parametrize("cast", [None, "float16"])
def test_damaged_data_is_refused_and_nothing_is_written(tmp_path: Path, cast: str | None) -> None:
    """A flipped bit in a tensor's bytes: refused by its recorded CRC-32C. With --cast, the
    output's checksum is computed over the cast bytes: the damaged input was passed on as a
    sound checkpoint before (TensorFlow restored it without complaint)."""
    shutil.copytree(DEMO, tmp_path / "in")
    src = tmp_path / "in" / "model.ckpt"
    inv = modelsize.inspect(src).inventory
    kernel = next(t for t in inv.tensors if t.name == "hidden/kernel")
    storage = next(s for s in inv.storages if s.key == kernel.storage)
    data = inv.files[storage.file].path
    raw = bytearray(data.read_bytes())
    raw[storage.offset + 1000] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptFileError, match="hidden/kernel: its bytes' CRC-32C"):
        modelsize.slim(src, tmp_path / "out", cast=cast)
    assert sorted(os.listdir(tmp_path)) == ["in"]


@pytest.mark.parametrize(("case", "words", "tensorflow"), [
    ("lengths", "vocab: the checksum of its string lengths does not match",
     "The length checksum does not match"),
    ("payload", "vocab: its bytes' CRC-32C is", "Checksum does not match")])
def test_damaged_string_tensor_is_refused_and_nothing_is_written(
        trips: RoundTrips, tmp_path: Path, case: str, words: str, tensorflow: str) -> None:
    """Strings are copied as they are, checksum too; their checks were skipped, so a damaged
    string tensor went on into an output TensorFlow refuses, as it refused the input (found
    by a fuzz campaign: a byte of the length checksum, a dimension of the shape)."""
    assert trips.tf(f"refuses.{case}") == tensorflow
    src = trips.root / "damaged" / case / "tf1" / "model.ckpt"
    with pytest.raises(CorruptFileError, match=words):
        modelsize.slim(src, tmp_path / "api", cast="float16")
    data = src.with_name("model.ckpt.data-00000-of-00001")
    assert_one_line_error(run_cli("slim", str(src), "-o", str(tmp_path / "cli"), "--cast",
                                  "float16"), data)
    assert os.listdir(tmp_path) == []
    assert sorted(os.listdir(src.parent)) == sorted(os.listdir(FIXTURES / "tf1"))


def test_string_check_reads_a_tensor_in_pieces_of_any_size() -> None:
    from modelsize.slimming.writers.tensorflow import _read_index, _StringCheck

    src = FIXTURES / "tf1" / "model.ckpt"
    data, offset, nbytes = _vocab(src)
    recorded = _read_index(src.with_name("model.ckpt.index"))["vocab"].crc
    raw = data.read_bytes()[offset : offset + nbytes]
    for size in (1, 2, 3, 5, nbytes):
        check = _StringCheck(3)
        for i in range(0, nbytes, size):
            check.feed(raw[i : i + size])
        assert check.finish(recorded) == "", size
    short = _StringCheck(3)
    short.feed(raw[:5])
    assert short.finish(recorded) == "its string lengths run past its bytes"
    longer = _StringCheck(3)
    longer.feed(raw + b"d")
    assert longer.finish(recorded) == "its strings hold 7 bytes where its lengths add up to 6"


def test_string_check_of_lengths_over_several_bytes() -> None:
    # a 300-byte string: its length takes a 2-byte varint, split across pieces
    from modelsize.slimming.writers.tensorflow import _StringCheck, string_tensor

    raw, recorded = string_tensor(b"s" * 300)
    assert raw[:2] == b"\xac\x02"
    for size in (1, 2, 7):
        check = _StringCheck(1)
        for i in range(0, len(raw), size):
            check.feed(raw[i : i + size])
        assert check.finish(recorded) == "", size
    endless = _StringCheck(1)
    endless.feed(b"\x80" * 11)
    assert endless.finish(recorded) == "its string lengths are unreadable"


def test_dtypes_listed_as_bytes_are_checked_by_their_raw_crc() -> None:
    # int4 (DataType 29) packed two to a byte: stored raw, not listed in its own dtype
    from modelsize.formats.tensorflow import Entry
    from modelsize.slimming.writers.tensorflow import TensorflowJob, _InputEntry

    raw = bytes(range(16))
    crc = _tfcrc.crc32c(raw)
    for dtype, recorded, problem in ((29, _tfcrc.mask(crc), False), (29, 1234, True),
                                     (21, 1234, False)):  # a variant: not checked
        source = _InputEntry(Entry(b"w", dtype, (32,), 0, 0, 16), b"", recorded)
        assert bool(TensorflowJob._raw_problem(source, crc)) == problem, (dtype, recorded)


def test_crc32c_matches_the_table_loop_and_the_check_value() -> None:
    import numpy as np

    assert _tfcrc.crc32c(b"123456789") == 0xE3069283  # RFC 3720's check value
    assert _tfcrc.mask(0) == 0xA282EAD8
    rng = np.random.default_rng(1)
    for n in (4096, 4099, 65536 + 7, 300_001):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert _tfcrc._crc32c_numpy(memoryview(data), 0) == crc32c_table(data), n
        head = crc32c_table(data[:13])
        assert _tfcrc._crc32c_numpy(memoryview(data[13:]), head) == crc32c_table(data), n


def test_table_with_many_blocks_reads_back() -> None:
    entries = [(f"key/{i:05d}".encode(), bytes([i % 251]) * (i % 40)) for i in range(3000)]
    raw = table([(b"", b"header"), *entries], block_size=4096)
    got = [(k, raw[a:b]) for k, a, b in iter_table(raw)]  # checks every block's CRC-32C
    assert got == [(b"", b"header"), *entries]
