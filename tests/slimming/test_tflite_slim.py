"""slim on TFLite models made by TensorFlow's own converter (in the TF venv), each output run
in the TFLite interpreter against its input on seeded inputs: equal outputs for dedupe and
metadata drops, float16 tolerance for ``--cast float16``, compared with what the converter's
own float16 quantization writes for the same model. Models with duplicates, unused buffers,
metadata and appended files are the converter's output edited with TensorFlow's flatbuffer
object API (the converter itself never writes two buffers of one value). Hand-built
flatbuffers check refusals without TensorFlow."""

from __future__ import annotations

import json
import random
import shutil
import struct
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import modelsize
from modelsize.categories import Category
from modelsize.errors import InputError
from modelsize.findings import fix_command
from modelsize.slimming.writers import _flatbuffers as fb
from modelsize.slimming.writers._tflite_schema import SCHEMA
from modelsize.slimming.writers.tflite import OFFSET_MODE_BYTES
from tests.conftest import REPO, assert_one_line_error, run_cli, run_in_tf, run_printed_in_tf
from tests.formats.test_tflite import tiny_model

# -- models, made once by the converter --------------------------------------------------------
_BUILD = r'''
import io, json, os, sys, zipfile
import flatbuffers
import numpy as np
import tensorflow as tf
from tensorflow.lite.python import schema_py_generated as S

out = sys.argv[1]
tf.keras.utils.set_random_seed(0)

def convert(model, name, float16=False, offset=False):
    c = tf.lite.TFLiteConverter.from_keras_model(model)
    if float16:
        c.optimizations = [tf.lite.Optimize.DEFAULT]
        c.target_spec.supported_types = [tf.float16]
    if offset:
        c._experimental_use_buffer_offset = True
    path = os.path.join(out, name)
    with open(path, "wb") as f:
        f.write(c.convert())
    return path

def pack(mt, path, tail=b""):
    b = flatbuffers.Builder(1024)
    b.Finish(mt.Pack(b), file_identifier=b"TFL3")
    with open(path, "wb") as f:
        f.write(bytes(b.Output()) + tail)

def load(path):
    with open(path, "rb") as f:
        return S.ModelT.InitFromObj(S.Model.GetRootAs(f.read(), 0))

inp = tf.keras.Input((8,))
x = tf.keras.layers.Dense(16, activation="relu", bias_initializer="ones")(inp)
dense = tf.keras.Model(inp, tf.keras.layers.Dense(4, bias_initializer="ones")(x))

inp = tf.keras.Input((12, 12, 3))
x = tf.keras.layers.Conv2D(8, 3, padding="same")(inp)
x = tf.keras.layers.BatchNormalization()(x)
x = tf.keras.layers.ReLU()(x)
x = tf.keras.layers.DepthwiseConv2D(3)(x)
x = tf.keras.layers.Flatten()(x)
conv = tf.keras.Model(inp, tf.keras.layers.Dense(3, bias_initializer="ones")(x))
bn = conv.layers[2]
rng = np.random.default_rng(1)
bn.set_weights([rng.random(8).astype("f4") + 0.5, rng.random(8).astype("f4"),
                rng.random(8).astype("f4"), rng.random(8).astype("f4") + 0.5])

# Two layers with one initial kernel: the converter keeps one constant for both.
init = np.random.default_rng(2).standard_normal((8, 8)).astype("f4")
inp = tf.keras.Input((8,))
x = tf.keras.layers.Dense(8, kernel_initializer=tf.constant_initializer(init))(inp)
x = tf.keras.layers.Dense(8, kernel_initializer=tf.constant_initializer(init))(x)
shared = tf.keras.Model(inp, x)

files = {}
for name, model in (("dense", dense), ("conv", conv), ("shared", shared)):
    files[name] = convert(model, name + ".tflite")
    files[name + ".tf16"] = convert(model, name + ".tf16.tflite", float16=True)
files["offset"] = convert(conv, "offset.tflite", offset=True)

# A loop: constants inside the WHILE body's subgraph.
class Loop(tf.Module):
    def __init__(self):
        self.w = tf.constant(np.random.default_rng(3).standard_normal((4, 4)).astype("f4") / 2)
    @tf.function(input_signature=[tf.TensorSpec([1, 4], tf.float32)])
    def __call__(self, x):
        i = tf.constant(0)
        _, y = tf.while_loop(lambda i, y: i < 3,
                             lambda i, y: (i + 1, tf.tanh(tf.matmul(y, self.w) + 0.25)),
                             (i, x))
        return y
loop = Loop()
for name, f16 in (("loop", False), ("loop.tf16", True)):
    c = tf.lite.TFLiteConverter.from_concrete_functions([loop.__call__.get_concrete_function()],
                                                        loop)
    if f16:
        c.optimizations = [tf.lite.Optimize.DEFAULT]
        c.target_spec.supported_types = [tf.float16]
    files[name] = os.path.join(out, name + ".tflite")
    with open(files[name], "wb") as f:
        f.write(c.convert())

# Duplicates: the second layer reads its own copy of the shared kernel; plus a buffer that
# nothing reads.
mt = load(files["shared"])
sg = mt.subgraphs[0]
fcs = [op for op in sg.operators if mt.operatorCodes[op.opcodeIndex].builtinCode == 9]
kernel = int(fcs[1].inputs[1])
copy = S.TensorT.InitFromObj(S.Model.GetRootAs(open(files["shared"], "rb").read(), 0)
                             .Subgraphs(0).Tensors(kernel))
copy.name = b"second_kernel"
buf = S.BufferT()
buf.data = np.array(mt.buffers[sg.tensors[kernel].buffer].data, dtype=np.uint8)
mt.buffers.append(buf)
copy.buffer = len(mt.buffers) - 1
sg.tensors.append(copy)
inputs = np.array(fcs[1].inputs, dtype=np.int32)
inputs[1] = len(sg.tensors) - 1
fcs[1].inputs = inputs
unused = S.BufferT()
unused.data = np.arange(96, dtype=np.uint8)
mt.buffers.append(unused)
files["dups"] = os.path.join(out, "dups.tflite")
pack(mt, files["dups"])

# Metadata entries (labels, TFLite Support's metadata) and its associated files: a zip
# appended after the flatbuffer, as tflite_support's MetadataPopulator writes it.
mt = load(files["dense"])
for name, data in ((b"labels", b"cat\ndog\nbird\nfish\n"), (b"TFLITE_METADATA", bytes(64))):
    b = S.BufferT()
    b.data = np.frombuffer(data, dtype=np.uint8)
    mt.buffers.append(b)
    m = S.MetadataT()
    m.name, m.buffer = name, len(mt.buffers) - 1
    mt.metadata.append(m)
zbuf = io.BytesIO()
with zipfile.ZipFile(zbuf, "w") as z:
    z.writestr("labels.txt", "cat\ndog\nbird\nfish\n")
files["meta"] = os.path.join(out, "meta.tflite")
pack(mt, files["meta"], zbuf.getvalue())
print(json.dumps(files))
'''

#: Runs models pairwise on seeded inputs; describes each model's structure.
_RUN = r'''
import hashlib, json, sys, warnings
import numpy as np
warnings.filterwarnings("ignore")
import tensorflow as tf
from tensorflow.lite.python import schema_py_generated as S

jobs = json.load(open(sys.argv[1]))

def outputs(path, steps=3):
    it = tf.lite.Interpreter(model_path=path)
    it.allocate_tensors()
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):  # one interpreter: a streaming model's state carries over
        for d in it.get_input_details():
            shape = [s if s > 0 else 1 for s in d["shape"]]
            if np.issubdtype(d["dtype"], np.floating):
                x = rng.standard_normal(shape).astype(d["dtype"])
            else:
                x = rng.integers(-100, 100, shape).astype(d["dtype"])
            it.set_tensor(d["index"], x)
        it.invoke()
        out.append([it.get_tensor(d["index"]).astype("f8") for d in it.get_output_details()])
    return out

def describe(path):
    data = open(path, "rb").read()
    m = S.ModelT.InitFromObj(S.Model.GetRootAs(data, 0))
    def buffer_bytes(i):
        b = m.buffers[i]
        if b.data is not None and len(b.data):
            return bytes(np.asarray(b.data, dtype=np.uint8))
        if (b.offset or 0) > 1:
            return data[b.offset:b.offset + b.size]
        return b""
    constants = []
    for s, sg in enumerate(m.subgraphs):
        for t in sg.tensors:
            raw = buffer_bytes(t.buffer)
            if raw:
                constants.append({"name": f"{s}:{t.name.decode()}", "type": int(t.type),
                                  "sha": hashlib.sha256(raw).hexdigest()})
    return {
        "bytes": len(data),
        "buffers": len(m.buffers),
        "offset_buffers": sum(1 for b in m.buffers if (b.offset or 0) > 1),
        "opcodes": [[max(c.builtinCode, c.deprecatedBuiltinCode), c.version]
                    for c in m.operatorCodes],
        "ops": [[max(m.operatorCodes[op.opcodeIndex].builtinCode,
                     m.operatorCodes[op.opcodeIndex].deprecatedBuiltinCode)
                 for op in sg.operators] for sg in m.subgraphs],
        "metadata": {md.name.decode(): buffer_bytes(md.buffer).decode("latin-1")
                     for md in m.metadata or []},
        "constants": constants,
    }

def canonical(model, data):
    """A ModelT as plain values; a tensor's or a metadata entry's buffer by its bytes (the
    buffers' order and places aside: an empty buffer no tensor names may go)."""
    contents = []
    for b in model.buffers:
        contents.append((bytes(np.asarray(b.data, dtype=np.uint8)) if b.data is not None
                         else data[b.offset:b.offset + b.size] if (b.offset or 0) > 1
                         else b"").hex())
    def plain(obj, field=""):
        if field == "buffer":
            return contents[obj]
        if isinstance(obj, np.ndarray):
            return obj.tolist()
        if isinstance(obj, (list, tuple)):
            return [plain(x) for x in obj]
        if isinstance(obj, bytes):
            return obj.hex()
        if hasattr(obj, "__dict__"):
            return {k: plain(v, k) for k, v in sorted(vars(obj).items())
                    if k not in ("buffers", "metadataBuffer")}
        return obj
    tree = plain(model)
    tree["buffers"] = sorted(c for c in contents if c)
    tree["metadataBuffer"] = [contents[i] for i in (model.metadataBuffer if model.metadataBuffer
                                                    is not None else [])]
    return tree

result = {}
for key, job in jobs.items():
    if job["kind"] == "run":
        a, b = outputs(job["a"]), outputs(job["b"])
        diff = max((float(np.max(np.abs(x - y))) if x.size else 0.0)
                   for sa, sb in zip(a, b) for x, y in zip(sa, sb))
        scale = max(float(np.max(np.abs(x))) for s in a for x in s if x.size)
        result[key] = {"maxdiff": diff, "scale": scale,
                       "exact": all(np.array_equal(x, y) for sa, sb in zip(a, b)
                                    for x, y in zip(sa, sb))}
    elif job["kind"] == "describe":
        result[key] = describe(job["a"])
    elif job["kind"] == "same_tree":
        trees = []
        for p in (job["a"], job["b"]):
            data = open(p, "rb").read()
            trees.append(canonical(S.ModelT.InitFromObj(S.Model.GetRootAs(data, 0)), data))
        result[key] = trees[0] == trees[1]
json.dump(result, open(sys.argv[2], "w"))
'''


def _tf_env(code: str) -> str:
    return f"import sys; sys.path.insert(0, {str(REPO / 'src')!r})\n" + code


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("tflite_models")
    proc = run_in_tf(_BUILD, str(out))
    return {k: Path(v) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def _tf_jobs(jobs: dict[str, dict[str, Any]], tmp: Path) -> dict[str, Any]:
    """Run ``_RUN``'s jobs in one TF process."""
    src, dst = tmp / "jobs.json", tmp / "results.json"
    src.write_text(json.dumps(jobs))
    run_in_tf(_RUN, str(src), str(dst))
    return json.loads(dst.read_text())


def _slim_metadata(path: Path, out: Path, **kw: Any) -> modelsize.SlimReport:
    """``slim --drop metadata``."""
    return modelsize.slim(path, out, drop=["metadata"], **kw)


@pytest.fixture(scope="module")
def slimmed(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> dict[str, Any]:
    """Every slim of the models, then one TF process that runs and describes them all."""
    tmp = tmp_path_factory.mktemp("tflite_slims")
    outs: dict[str, Path] = {}
    reports: dict[str, modelsize.SlimReport] = {}

    def slim(key: str, src: str, **kw: Any) -> None:
        outs[key] = tmp / f"{key}.tflite"
        reports[key] = modelsize.slim(models[src], outs[key], **kw)

    slim("dups.default", "dups")
    slim("dups.dedupe", "dups", dedupe=True)
    for name in ("dense", "conv", "loop", "offset", "dups"):
        slim(f"{name}.f16", name, cast="float16")
    slim("meta.default", "meta")
    outs["meta.drop"] = tmp / "meta.drop.tflite"
    reports["meta.drop"] = _slim_metadata(models["meta"], outs["meta.drop"])
    outs["meta.keep"] = tmp / "meta.keep.tflite"
    reports["meta.keep"] = _slim_metadata(models["meta"], outs["meta.keep"],
                                          keep=["labels", "min_runtime_version"])
    jobs: dict[str, dict[str, Any]] = {}
    for key, out in outs.items():
        source = models[key.split(".")[0]]
        jobs[f"run:{key}"] = {"kind": "run", "a": str(source), "b": str(out)}
        jobs[f"describe:{key}"] = {"kind": "describe", "a": str(out)}
    for name in ("dense", "conv", "loop"):
        jobs[f"run:{name}.tf16"] = {"kind": "run", "a": str(models[name]),
                                    "b": str(models[f"{name}.tf16"])}
        jobs[f"run:{name}.f16-vs-tf16"] = {"kind": "run", "a": str(models[f"{name}.tf16"]),
                                           "b": str(outs[f"{name}.f16"])}
        jobs[f"describe:{name}.tf16"] = {"kind": "describe", "a": str(models[f"{name}.tf16"])}
    for name in ("dups", "meta", "offset", "dense"):
        jobs[f"describe:{name}"] = {"kind": "describe", "a": str(models[name])}
    # Nothing to change, but every table written anew (see test_rewritten_tree_...).
    from modelsize.slimming import writers
    from modelsize.slimming.writers import tflite as writer

    trees = [models[k] for k in ("dense", "conv.tf16", "loop", "offset", "meta")]
    trees += [p for p in _corpus_tflite() if p.exists()]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(writer, "COPY_WHEN_UNCHANGED", False)
        mp.setattr(writers, "copyable", lambda plan, out: False)
        for i, path in enumerate(trees):
            out = tmp / f"tree{i}.tflite"
            reports[f"tree:{path}"] = modelsize.slim(path, out)
            outs[f"tree:{path}"] = out
            jobs[f"tree:{path}"] = {"kind": "same_tree", "a": str(path), "b": str(out)}
    # Past the 2 GB limit (here: past 0 bytes) every buffer follows the flatbuffer.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(writer, "OFFSET_MODE_BYTES", 0)
        slim("conv.f16past", "conv", cast="float16")
    jobs["run:conv.f16past"] = {"kind": "run", "a": str(models["conv"]),
                                "b": str(outs["conv.f16past"])}
    jobs["describe:conv.f16past"] = {"kind": "describe", "a": str(outs["conv.f16past"])}
    nabu = _wake_word()
    if nabu.exists():
        outs["nabu"] = tmp / "nabu.tflite"
        reports["nabu"] = _slim_metadata(nabu, outs["nabu"])
        jobs["run:nabu"] = {"kind": "run", "a": str(nabu), "b": str(outs["nabu"])}
    return {"outs": outs, "reports": reports, "tf": _tf_jobs(jobs, tmp)}


def _corpus_tflite() -> list[Path]:
    from tests.realfiles.fetch import CORPUS, cache_dir

    return [cache_dir() / "files" / w.folder / mf.member
            for w in CORPUS for mf in w.files if mf.format == "tflite"]


def _wake_word() -> Path:
    """pymicro_wakeword's okay_nabu in the real-file corpus (absent when not fetched)."""
    [path] = [p for p in _corpus_tflite() if p.name == "okay_nabu.tflite"]
    return path


# -- dedupe and unused buffers -------------------------------------------------------------------
def test_inspect_finds_the_duplicate_and_the_unused_buffer(models: dict[str, Path]) -> None:
    inv = modelsize.inspect(models["dups"]).inventory
    by = inv.bytes_by_category
    # From the edit: an 8x8 float32 kernel copied (256 B) and a 96-byte buffer nothing reads.
    assert (by[Category.DUPLICATES], by[Category.UNUSED_STORAGE]) == (8 * 8 * 4, 96)


@pytest.mark.parametrize("key", ["dups.default", "dups.dedupe"])
def test_dedupe_drops_the_copy_and_the_unused_buffer_and_computes_the_same(
        slimmed: dict[str, Any], key: str) -> None:
    report = slimmed["reports"][key]
    assert report.verified
    before, after = slimmed["tf"]["describe:dups"], slimmed["tf"][f"describe:{key}"]
    assert after["buffers"] == before["buffers"] - 2
    # The copy now reads the original's bytes: both tensors, one buffer.
    shas = {c["sha"] for c in after["constants"]}
    assert len(after["constants"]) == len(before["constants"])
    assert len(shas) == len({c["sha"] for c in before["constants"]})
    assert before["bytes"] - after["bytes"] >= 8 * 8 * 4 + 96 - 64  # less some padding
    run = slimmed["tf"][f"run:{key}"]
    assert run["exact"], run
    out_inv = modelsize.inspect(slimmed["outs"][key]).inventory.bytes_by_category
    assert out_inv[Category.DUPLICATES] == out_inv[Category.UNUSED_STORAGE] == 0


def test_printed_dedupe_fix_runs_as_printed(models: dict[str, Path], tmp_path: Path) -> None:
    """Before the writer: inspect printed ``--dedupe`` and slim answered "slim cannot write
    tflite files yet"."""
    src = tmp_path / "dups.tflite"
    shutil.copy(models["dups"], src)
    report = modelsize.inspect(src)
    command = fix_command(report.inventory, list(report.findings))
    assert command is not None and "--dedupe" in command
    proc = run_printed_in_tf(command, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Verified" in proc.stdout
    left = modelsize.inspect(command.split()[-1])
    assert not [f for f in left.findings if f.bytes]


def test_nothing_to_slim_is_a_byte_for_byte_copy(slimmed: dict[str, Any],
                                                 models: dict[str, Path]) -> None:
    out = slimmed["outs"]["meta.default"]
    assert out.read_bytes() == models["meta"].read_bytes()
    assert slimmed["reports"]["meta.default"].verified


# -- --cast float16 ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dense", "conv", "loop"])
def test_cast_float16_writes_what_the_converter_writes(slimmed: dict[str, Any],
                                                       name: str) -> None:
    tf = slimmed["tf"]
    ours, theirs = tf[f"describe:{name}.f16"], tf[f"describe:{name}.tf16"]
    # The float32 constants the converter made float16 are float16 here, with the same bytes
    # (the converter renames some of its own "arith.constant"s: compared by their bytes).
    def half(d: dict[str, Any]) -> Counter[str]:
        return Counter(c["sha"] for c in d["constants"] if c["type"] == 1)

    assert half(theirs) and half(ours) == half(theirs)
    # One DEQUANTIZE (6, version 3) per float16 constant, and the runtime metadata.
    assert [6, 3] in ours["opcodes"]
    assert sum(ops.count(6) for ops in ours["ops"]) == sum(ops.count(6) for ops in theirs["ops"])
    assert ours["metadata"]["reduced_precision_support"] == "fp16accfp32"
    assert ours["metadata"]["min_runtime_version"].rstrip("\0") == "1.15.0"
    assert ours["bytes"] <= theirs["bytes"] + 64  # the same, but for padding
    # Outputs: what TF's own float16 model computes, within float16's precision of float32.
    assert tf[f"run:{name}.f16-vs-tf16"]["exact"], tf[f"run:{name}.f16-vs-tf16"]
    run, ref = tf[f"run:{name}.f16"], tf[f"run:{name}.tf16"]
    assert run["maxdiff"] <= max(ref["maxdiff"] * 1.01, 1e-3 * run["scale"]), (run, ref)


def test_cast_float16_past_the_flatbuffer(slimmed: dict[str, Any]) -> None:
    """A model whose buffers follow the flatbuffer (offset/size, as past 2 GB) stays so."""
    tf = slimmed["tf"]
    before, after = tf["describe:offset"], tf["describe:offset.f16"]
    assert before["offset_buffers"] and after["offset_buffers"]
    assert {c["type"] for c in after["constants"]} >= {1}
    run = tf["run:offset.f16"]
    assert 0 < run["maxdiff"] <= 1e-2 * run["scale"], run


def test_output_past_the_flatbuffer_limit_moves_its_buffers_after_it(
        slimmed: dict[str, Any]) -> None:
    """An output the 2 GB limit would not hold (the limit lowered to 0 for the test): every
    buffer's bytes follow the flatbuffer, and the model computes what the inline one does."""
    tf = slimmed["tf"]
    past, inline = tf["describe:conv.f16past"], tf["describe:conv.f16"]
    assert past["offset_buffers"] == len(inline["constants"]) + len(inline["metadata"])
    assert sorted(c["sha"] for c in past["constants"]) == sorted(
        c["sha"] for c in inline["constants"])
    assert tf["run:conv.f16past"] == tf["run:conv.f16"]


def test_cast_float16_on_duplicates_keeps_one_buffer(slimmed: dict[str, Any]) -> None:
    after = slimmed["tf"]["describe:dups.f16"]
    halves = [c for c in after["constants"] if c["type"] == 1]
    assert len({c["sha"] for c in halves}) == len(halves) - 1  # the two kernels share one
    assert slimmed["reports"]["dups.f16"].verified


def test_cast_reports_its_error(slimmed: dict[str, Any]) -> None:
    report = slimmed["reports"]["conv.f16"]
    cast = [k for k in report.kept if k.dtype == "float16"]
    assert cast and all(k.source_dtype == "float32" for k in cast)
    # float16 keeps 11 significant bits (relative error 2**-11) but for subnormal values.
    assert 0 < max(k.max_rel_error or 0 for k in cast) < 1e-2


# -- metadata ------------------------------------------------------------------------------------
def test_drop_metadata_drops_entries_and_their_files(slimmed: dict[str, Any],
                                                     models: dict[str, Path]) -> None:
    tf = slimmed["tf"]
    before, after = tf["describe:meta"], tf["describe:meta.drop"]
    assert set(before["metadata"]) == {"min_runtime_version", "CONVERSION_METADATA", "labels",
                                       "TFLITE_METADATA"}
    assert after["metadata"] == {}
    assert tf["run:meta.drop"]["exact"]
    with zipfile.ZipFile(models["meta"]) as z:  # the input's associated files
        assert z.read("labels.txt") == b"cat\ndog\nbird\nfish\n"
    assert not zipfile.is_zipfile(slimmed["outs"]["meta.drop"])
    meta = sum(len(v) for v in before["metadata"].values())
    assert before["bytes"] - after["bytes"] >= meta


def test_keep_names_metadata_to_keep_and_the_appended_files_stay(
        slimmed: dict[str, Any]) -> None:
    tf = slimmed["tf"]
    after = tf["describe:meta.keep"]
    assert after["metadata"]["labels"] == "cat\ndog\nbird\nfish\n"
    assert set(after["metadata"]) == {"labels", "min_runtime_version"}
    assert tf["run:meta.keep"]["exact"]
    # TFLITE_METADATA went, and its associated files with it.
    assert not zipfile.is_zipfile(slimmed["outs"]["meta.keep"])


def test_appended_files_are_kept_when_their_metadata_is(models: dict[str, Path],
                                                        tmp_path: Path) -> None:
    out = tmp_path / "m.tflite"
    _slim_metadata(models["meta"], out, keep=["TFLITE_METADATA"])
    with zipfile.ZipFile(out) as z:
        assert z.read("labels.txt") == b"cat\ndog\nbird\nfish\n"


# -- every table, as it was ----------------------------------------------------------------------
def test_rewritten_tree_equals_the_input_tree(slimmed: dict[str, Any]) -> None:
    """Slimmed with nothing to change but written table by table anyway, every model (its
    buffers inside or after the flatbuffer, three subgraphs, signatures, metadata, an appended
    zip) is the same tree to TensorFlow's own schema, and the corpus's real files too."""
    trees = {k: v for k, v in slimmed["tf"].items() if k.startswith("tree:")}
    assert len(trees) >= 5
    for key in trees:
        assert slimmed["reports"][key].verified
        path = Path(key[len("tree:"):])
        assert slimmed["outs"][key].read_bytes() != path.read_bytes()
    assert [k for k, same in trees.items() if not same] == []


def test_schema_matches_tensorflows_generated_schema() -> None:
    """Every table's slots (width, vector element size and alignment) and every union's
    members, against ``schema_py_generated`` of the installed TensorFlow."""
    code = r'''
import importlib.util, json, os, re
# The generated module alone (importing tensorflow takes seconds).
root = os.path.dirname(importlib.util.find_spec("tensorflow").origin)
path = os.path.join(root, "lite", "python", "schema_py_generated.py")
spec = importlib.util.spec_from_file_location("schema_py_generated", path)
S = importlib.util.module_from_spec(spec)
spec.loader.exec_module(S)
src = open(path).read()
tables = {}
for name, n in re.findall(r"def (\w+)Start\(builder\):\s+builder\.StartObject\((\d+)\)", src):
    tables[name] = {"slots": int(n), "fields": {}, "vectors": {}}
for table, field, kind, slot in re.findall(
        r"def (\w+?)Add(\w+)\(builder, \w+\):\s+builder\.Prepend(\w+)Slot\((\d+),", src):
    if table in tables:
        tables[table]["fields"][field] = [kind, int(slot)]
for table, field, elem, align in re.findall(
        r"def (\w+?)Start(\w+)Vector\(builder, numElems\):\s+return builder\.StartVector"
        r"\((\d+), numElems, (\d+)\)", src):
    if table in tables:
        tables[table]["vectors"][field] = [int(elem), int(align)]
unions = {}
for name in ("BuiltinOptions", "BuiltinOptions2", "QuantizationDetails", "SparseIndexVector"):
    cls = getattr(S, name)
    unions[name] = {k: v for k, v in vars(cls).items() if not k.startswith("_") and k != "NONE"}
print(json.dumps({"tables": tables, "unions": unions}))
'''
    theirs = json.loads(run_in_tf(code).stdout.strip().splitlines()[-1])
    widths = {"Int8": 1, "Uint8": 1, "Bool": 1, "Int16": 2, "Uint16": 2, "Int32": 4,
              "Uint32": 4, "Float32": 4, "Int64": 8, "Uint64": 8, "Float64": 8,
              "UOffsetTRelative": 4}
    for union, members in theirs["unions"].items():
        ours = SCHEMA.unions[union]
        for member, type_id in members.items():
            assert ours[type_id - 1] == member, (union, member)
    for name, table in theirs["tables"].items():
        if name not in SCHEMA.tables:
            continue  # a table of TFLite's other schemas (the ones we read are all here)
        fields = SCHEMA.tables[name].fields
        assert len(fields) >= table["slots"], name
        camel = {f.replace("_", "").lower(): (slot, ft) for slot, (f, ft) in enumerate(fields)}
        for field, (kind, slot) in table["fields"].items():
            ours_slot, ft = camel[field.lower()]
            assert ours_slot == slot, (name, field)
            assert ft.width == widths[kind], (name, field, ft, kind)
            assert (kind == "UOffsetTRelative") == (ft.kind not in ("scalar", "utype"))
        for field, (elem, align) in table["vectors"].items():
            _, ft = camel[field.lower()]
            if ft.kind == "vector":  # (the generated code leaves force_align out)
                assert (ft.elem, align) == (elem, elem), (name, field)
            else:
                assert elem == 4, (name, field)
    assert set(SCHEMA.tables) >= {n for n in theirs["tables"] if n in SCHEMA.tables}


# -- the corpus's wake-word model, rewritten ---------------------------------------------------
def test_wake_word_model_rewritten_runs_the_same(slimmed: dict[str, Any]) -> None:
    """pymicro_wakeword's okay_nabu: int8, two subgraphs (CALL_ONCE initialises variables),
    streaming state; dropping its metadata rewrites every table."""
    if "nabu" not in slimmed["outs"]:
        pytest.skip(f"{_wake_word()} not fetched (run tests/realfiles/fetch.py)")
    assert slimmed["reports"]["nabu"].verified
    assert slimmed["outs"]["nabu"].stat().st_size < _wake_word().stat().st_size
    assert slimmed["tf"]["run:nabu"]["exact"], slimmed["tf"]["run:nabu"]


# -- refusals, and the writer without TensorFlow ----------------------------------------------
def _with_vtable_slot(data: bytes, slot: int) -> bytes:
    """``data`` with the root table's vtable copied to the end and given field ``slot``
    (pointing at the table's first field), as a newer schema's Model would have."""
    root = struct.unpack_from("<I", data, 0)[0]
    vtable = root - struct.unpack_from("<i", data, root)[0]
    vt_size, inline = struct.unpack_from("<HH", data, vtable)
    offsets = list(struct.unpack_from(f"<{(vt_size - 4) // 2}H", data, vtable + 4))
    offsets += [0] * (slot + 1 - len(offsets))
    offsets[slot] = next(o for o in offsets if o)
    new = bytearray(data)
    new.extend(bytes(-len(new) % 4))
    at = len(new)
    new.extend(struct.pack(f"<HH{len(offsets)}H", 4 + 2 * len(offsets), inline, *offsets))
    struct.pack_into("<i", new, root, root - at)
    return bytes(new)


def test_newer_schema_model_is_refused_in_one_line(tmp_path: Path) -> None:
    """A field past the schema (Model has 10) cannot be carried over unseen: refused."""
    path = tmp_path / "newer.tflite"
    path.write_bytes(_with_vtable_slot(tiny_model(), 12))
    with pytest.raises(fb.Unsupported, match="field 12"):
        fb.read(path.read_bytes(), SCHEMA)
    proc = run_cli("slim", str(path), "--cast", "float16", "-o", str(tmp_path / "out.tflite"))
    assert_one_line_error(proc, path)
    assert "newer schema" in proc.stderr
    assert not (tmp_path / "out.tflite").exists()


@pytest.mark.parametrize("version", [1, 768])
def test_schema_version_the_interpreter_refuses_is_refused(tmp_path: Path, version: int) -> None:
    """The interpreter reads schema version 3 only ("Model provided is schema version 1 not
    equal to supported version 3"); slim copied or rewrote such models, exit 0, before (found
    by the fuzz target)."""
    path = tmp_path / "old.tflite"
    path.write_bytes(tiny_model(version=version))
    for args in ([], ["--cast", "float16"]):
        proc = run_cli("slim", str(path), *args, "-o", str(tmp_path / "out.tflite"))
        assert_one_line_error(proc, path)
        assert f"schema version {version}: the TFLite interpreter reads version 3" in proc.stderr
        assert not (tmp_path / "out.tflite").exists()


def test_cast_of_a_constant_without_elements(tmp_path: Path) -> None:
    """A [0, 3] constant over a 24-byte buffer: its output buffer is an empty data vector, which
    the interpreter (and modelsize's reader) take for a constant of 0 bytes; it stays float32.
    Verification missed it before ("dense/kernel is missing", exit 1: found by the fuzz
    target)."""
    path = tmp_path / "empty.tflite"
    path.write_bytes(tiny_model(shape=(0, 3), data=bytes(24)))
    report = modelsize.slim(path, tmp_path / "o.tflite", cast="float16")
    assert report.verified
    assert any("no elements" in n for n in report.notes)
    got = {t.name: (t.dtype, t.shape) for t in modelsize.inspect(tmp_path / "o.tflite")
           .inventory.tensors}
    assert got == {"dense/kernel": ("float32", (0, 3))}


def test_dropping_a_constant_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    """The converter's int32 shape constants are ``buffers``; operators read them."""
    proc = run_cli("slim", str(models["conv"]), "--drop", "buffers", "-o",
                   str(tmp_path / "o.tflite"))
    assert_one_line_error(proc, models["conv"])
    assert "read by its operators" in proc.stderr


def test_hand_made_model_cast_and_metadata_without_tensorflow(tmp_path: Path) -> None:
    """No TensorFlow: the float32 constant becomes float16 (its bytes numpy's float16 of the
    values), a DEQUANTIZE operator code appears, min_runtime_version is raised."""
    import numpy as np

    values = np.arange(6, dtype="<f4") / 3
    path = tmp_path / "m.tflite"
    path.write_bytes(tiny_model(data=values.tobytes()))
    out = tmp_path / "o.tflite"
    report = modelsize.slim(path, out, cast="float16")
    assert report.verified
    inv = modelsize.inspect(out).inventory
    [kernel] = inv.tensors
    assert (kernel.name, kernel.dtype, kernel.shape) == ("dense/kernel", "float16", (2, 3))
    root, _ = fb.read(out.read_bytes(), SCHEMA, lazy=[("Buffer", "data")])
    codes = [(c.get("builtin_code", 0), c.get("version", 1)) for c in root["operator_codes"]]
    assert codes == [(6, 3)]
    sg = root["subgraphs"][0]
    [op] = sg["operators"]
    assert (op.ints("inputs"), op.ints("outputs")) == ([0], [2])
    assert [t.get("type", 0) for t in sg["tensors"]] == [1, 0, 0]
    data = out.read_bytes()
    buffers = root["buffers"]
    half = buffers[sg["tensors"][0]["buffer"]]["data"]
    assert data[half.source:half.source + half.nbytes] == values.astype("<f2").tobytes()
    assert half.source % 16 == 0
    names = {m["name"]: m["buffer"] for m in root["metadata"]}
    version = buffers[names[b"min_runtime_version"]]["data"]
    assert data[version.source:version.source + version.nbytes].rstrip(b"\0") == b"1.15.0"
    assert inv.facts["tflite.min_runtime_version"] == "1.15.0"


@pytest.mark.parametrize("cast", ["bfloat16"])
def test_cast_other_than_float16_is_refused(models: dict[str, Path], tmp_path: Path,
                                            cast: str) -> None:
    proc = run_cli("slim", str(models["dense"]), "--cast", cast, "-o",
                   str(tmp_path / "o.tflite"))
    assert_one_line_error(proc, models["dense"])
    assert "--cast float16" in proc.stderr


def test_offset_mode_threshold_is_under_the_flatbuffer_limit() -> None:
    assert 0 < OFFSET_MODE_BYTES < fb.MAX_FLATBUFFER


def test_mutated_models_slim_or_fail_in_one_line(models: dict[str, Path], tmp_path: Path) -> None:
    """Random bytes changed in a converter's model: slim writes a verified output or refuses
    (an InputError: one line, exit 2), leaving nothing; never another exception."""
    rng = random.Random(18)
    data = models["dense"].read_bytes()
    outcomes: Counter[str] = Counter()
    for i in range(200):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            mutated[rng.randrange(8, len(data))] = rng.randrange(256)
        src, out = tmp_path / f"m{i}.tflite", tmp_path / f"o{i}.tflite"
        src.write_bytes(bytes(mutated))
        try:
            report = modelsize.slim(src, out, cast="float16")
        except InputError:
            outcomes["refused"] += 1
            assert not out.exists()
            continue
        assert report.verified
        outcomes["slimmed"] += 1
    assert outcomes["slimmed"] and outcomes["refused"], outcomes


def test_drop_metadata_is_for_tflite_only(tmp_path: Path) -> None:
    """``--drop metadata`` names TFLite metadata entries; on another format the metadata
    category is the file's structure: one line, exit 2, nothing written."""
    torch = pytest.importorskip("torch")
    src = tmp_path / "m.pt"
    torch.save({"w": torch.ones(4)}, src)
    proc = run_cli("slim", str(src), "--drop", "metadata", "-o", str(tmp_path / "o.pt"))
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "TFLite" in proc.stderr
    assert not (tmp_path / "o.pt").exists()


def test_fully_connected_with_one_input_is_refused(models: dict[str, Path],
                                                     tmp_path: Path) -> None:
    """A FULLY_CONNECTED whose inputs list names its activation alone (the fuzz target moved a
    vtable entry onto another vector): the interpreter dies of SIGSEGV in ``allocate_tensors``,
    on the input and on what slim wrote of it, "Verified" (`scripts/fuzz_slim.py --seed 11`).
    The reader refuses an operator with fewer inputs than its kernel reads, in one line."""
    root, _ = fb.read(models["dense"].read_bytes(), SCHEMA)
    codes = [max(c.get("deprecated_builtin_code", 0), c.get("builtin_code", 0))
             for c in root["operator_codes"]]
    op = next(op for op in root["subgraphs"][0]["operators"]
              if codes[op.get("opcode_index", 0)] == 9)
    op.set_ints("inputs", op.ints("inputs")[:1])
    path = tmp_path / "fc1.tflite"
    path.write_bytes(b"".join(p for p in fb.Builder(SCHEMA).build(root).stream()
                              if isinstance(p, bytes)))
    code = ("import sys, tensorflow as tf; "
            "tf.lite.Interpreter(model_path=sys.argv[1]).allocate_tensors()")
    with pytest.raises(AssertionError):  # the interpreter crashes (or refuses) on it
        run_in_tf(code, str(path))
    for verb in (["inspect", str(path)],
                 ["slim", str(path), "--cast", "float16", "-o", str(tmp_path / "o.tflite")]):
        proc = run_cli(*verb)
        assert_one_line_error(proc, path)
        assert "is a FULLY_CONNECTED with 1 input(s); its kernel reads 2" in proc.stderr
    assert not (tmp_path / "o.tflite").exists()


def test_builtin_code_past_the_schema_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    """An operator code whose builtin_code reads 65535 (`scripts/fuzz_slim.py --seed 23`):
    the interpreter refuses the input and what slim wrote of it ("Op builtin_code out of
    range"), and slim wrote it, "Verified". Inspect still reads it; slim refuses it in one line.
    The last code modelsize knows is TensorFlow's last BuiltinOperator."""
    from modelsize.formats.tflite import LAST_BUILTIN

    root, _ = fb.read(models["dense"].read_bytes(), SCHEMA)
    root["operator_codes"][0]["builtin_code"] = 65535
    path = tmp_path / "code.tflite"
    path.write_bytes(b"".join(p for p in fb.Builder(SCHEMA).build(root).stream()
                              if isinstance(p, bytes)))
    code = ("import sys, tensorflow as tf; "
            "tf.lite.Interpreter(model_path=sys.argv[1]).allocate_tensors()")
    with pytest.raises(AssertionError, match="builtin_code out of range: 65535"):
        run_in_tf(code, str(path))
    last = run_in_tf("from tensorflow.lite.python import schema_py_generated as S; "
                     "print(max(v for k, v in vars(S.BuiltinOperator).items() "
                     "if not k.startswith('_')))")
    assert int(last.stdout.split()[-1]) == LAST_BUILTIN
    assert run_cli("inspect", str(path)).returncode == 0
    for flags in ([], ["--cast", "float16"]):
        proc = run_cli("slim", str(path), *flags, "-o", str(tmp_path / "o.tflite"))
        assert_one_line_error(proc, path)
        assert "operator_codes[0] is builtin operator 65535" in proc.stderr
    assert not (tmp_path / "o.tflite").exists()


def test_signature_without_outputs_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    """A SignatureDef whose outputs vector is gone (`scripts/fuzz_slim.py --seed 53` zeroed
    its vtable entry): the interpreter refuses the input and what slim wrote of it ("NULL
    SignatureDef outputs for exported method serving_default"); slim wrote it, "Verified"."""
    root, _ = fb.read(models["dense"].read_bytes(), SCHEMA)
    assert root["signature_defs"][0].pop("outputs") is not None
    path = tmp_path / "sig.tflite"
    path.write_bytes(b"".join(p for p in fb.Builder(SCHEMA).build(root).stream()
                              if isinstance(p, bytes)))
    code = ("import sys, tensorflow as tf; "
            "tf.lite.Interpreter(model_path=sys.argv[1]).allocate_tensors()")
    with pytest.raises(AssertionError, match="NULL SignatureDef outputs"):
        run_in_tf(code, str(path))
    assert run_cli("inspect", str(path)).returncode == 0
    proc = run_cli("slim", str(path), "--cast", "float16", "-o", str(tmp_path / "o.tflite"))
    assert_one_line_error(proc, path)
    assert "signature_defs[0] has no outputs vector" in proc.stderr
    assert not (tmp_path / "o.tflite").exists()
