"""slim of TensorFlow SavedModels: pruned to the signatures, frozen, or converted to TFLite.

The SavedModels are built by TensorFlow in the test (a Keras CNN with BatchNorm exported with
``model.export``, and a ``tf.Module`` that holds its Adam optimizer after one training step).
The slims run in the TensorFlow venv (``run_in_tf``), and each output is checked there with
TensorFlow's own API on inputs the test makes itself: ``tf.saved_model.load`` and the
signature, ``tf.train.list_variables`` for what the bundle holds, ``tf.lite.Interpreter`` for
TFLite files. Expected counts come from the models' definitions.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from modelsize import formats
from modelsize.categories import Category
from modelsize.errors import (
    MissingDependencyError,
    PathNotFoundError,
    UnknownFormatError,
    UsageError,
)
from modelsize.slimming.graph.tf_savedmodel import TOLERANCES, slim_from_options, slim_saved_model
from modelsize.slimming.plan import SlimOptions
from tests.conftest import REPO, run_in_tf, run_printed_in_tf

#: Builds the two SavedModels under sys.argv[1]; prints what the test needs to know of them.
_BUILD = r"""
import json, sys
import numpy as np
import tensorflow as tf
import keras

root = sys.argv[1]
keras.utils.set_random_seed(0)
inp = keras.Input((12, 12, 3))
x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inp)
x = keras.layers.BatchNormalization()(x)
x = keras.layers.ReLU()(x)
y = keras.layers.Conv2D(8, 3, padding="same")(x)
y = keras.layers.BatchNormalization()(y)
x = keras.layers.ReLU()(keras.layers.Add()([x, y]))
x = keras.layers.GlobalAveragePooling2D()(x)
x = keras.layers.Dense(16)(x)
x = keras.layers.BatchNormalization()(x)
out = keras.layers.Dense(4)(x)
model = keras.Model(inp, out)
model.compile("adam", "mse")
rng = np.random.default_rng(0)
model.fit(rng.standard_normal((16, 12, 12, 3)).astype("float32"),
          rng.standard_normal((16, 4)).astype("float32"), epochs=2, verbose=0)
model.export(root + "/keras_bn", verbose=False)

class Regressor(tf.Module):
    def __init__(self):
        self.w = tf.Variable(tf.random.stateless_normal([4, 3], seed=[1, 2]), name="w")
        self.b = tf.Variable(tf.zeros([3]), name="b")
        self.optimizer = keras.optimizers.Adam()

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
    def serve(self, x):
        return {"y": tf.matmul(x, self.w) + self.b}

module = Regressor()
with tf.GradientTape() as tape:
    loss = tf.reduce_sum(module.serve(tf.ones([2, 4]))["y"] ** 2)
grads = tape.gradient(loss, [module.w, module.b])
module.optimizer.apply_gradients(zip(grads, [module.w, module.b]))
tf.saved_model.save(module, root + "/module_adam", signatures={"serving_default": module.serve})

# MobileNet-shaped: depthwise convolutions, BatchNorm, ReLU6, a linear bottleneck and a
# residual. The first depthwise BatchNorm keeps its fresh statistics (mean 0, variance 1,
# beta 0: grappler folds its shift away, leaving a lone Mul); the others get seeded ones.
keras.utils.set_random_seed(1)
inp = keras.Input((16, 16, 3))
x = keras.layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False)(inp)
x = keras.layers.ReLU(6.0)(keras.layers.BatchNormalization(name="stem_bn")(x))
x = keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False)(x)
x = keras.layers.ReLU(6.0)(keras.layers.BatchNormalization(name="fresh_dw_bn")(x))
x = keras.layers.Conv2D(16, 1, use_bias=False)(x)
x = keras.layers.BatchNormalization(name="project_bn")(x)
y = keras.layers.Conv2D(32, 1, use_bias=False)(x)
y = keras.layers.ReLU(6.0)(keras.layers.BatchNormalization(name="expand_bn")(y))
y = keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False)(y)
y = keras.layers.ReLU(6.0)(keras.layers.BatchNormalization(name="dw_bn")(y))
y = keras.layers.Conv2D(16, 1, use_bias=False)(y)
y = keras.layers.BatchNormalization(name="project2_bn")(y)
x = keras.layers.Add()([x, y])
x = keras.layers.GlobalAveragePooling2D()(x)
out = keras.layers.Dense(5)(x)
mobilenet = keras.Model(inp, out)
for layer in mobilenet.layers:
    if isinstance(layer, keras.layers.BatchNormalization) and layer.name != "fresh_dw_bn":
        n = layer.gamma.shape[0]
        layer.set_weights([rng.uniform(0.5, 1.5, n), rng.normal(0, 0.5, n),
                           rng.normal(0, 0.5, n), rng.uniform(0.5, 2.0, n)])
mobilenet.export(root + "/mobilenet_bn", verbose=False)
print(json.dumps({
    "mobilenet_batchnorms": sum(isinstance(l, keras.layers.BatchNormalization)
                                for l in mobilenet.layers),
    "mobilenet_depthwise": sum(isinstance(l, keras.layers.DepthwiseConv2D)
                               for l in mobilenet.layers),
    "keras_variables": len(model.weights),
    "batchnorms": sum(isinstance(l, keras.layers.BatchNormalization) for l in model.layers),
    "module_variables": {"w": [4, 3], "b": [3]},
    "optimizer_variables": len(module.optimizer.variables),
}))
"""

#: Runs every slim and checks each output with TensorFlow's API; one JSON object per case.
_SLIM_AND_CHECK = r"""
import json, sys, traceback, warnings
from pathlib import Path
import numpy as np
import tensorflow as tf
from modelsize.report.slim_text import render_slim
from modelsize.slimming.graph.tf_savedmodel import (
    OutputMismatchError, TOLERANCES, slim_saved_model, to_slim_report)

root = Path(sys.argv[1])
rng = np.random.default_rng(123)
FEEDS = {"keras_bn": {"keras_tensor": rng.standard_normal((3, 12, 12, 3)).astype("float32")},
         "module_adam": {"x": rng.standard_normal((5, 4)).astype("float32")}}
_mobilenet_input = next(iter(tf.saved_model.load(str(root / "mobilenet_bn"))
                             .signatures["serving_default"].structured_input_signature[1]))
FEEDS["mobilenet_bn"] = {
    _mobilenet_input: rng.standard_normal((3, 16, 16, 3)).astype("float32")}

def serve(path, key, feed):
    fn = tf.saved_model.load(str(path)).signatures[key]
    return {k: v.numpy() for k, v in fn(**feed).items()}

def rel(a, b):
    return max(float(np.max(np.abs(a[k] - b[k])) / np.max(np.abs(a[k]))) for k in a)

def variables(path):
    return {n: s for n, s in tf.train.list_variables(str(path / "variables" / "variables"))
            if n != "_CHECKPOINTABLE_OBJECT_GRAPH"}

def op_types(path):
    from tensorflow.core.protobuf import saved_model_pb2
    sm = saved_model_pb2.SavedModel()
    sm.ParseFromString((path / "saved_model.pb").read_bytes())
    graph = sm.meta_graphs[0].graph_def
    ops = [n.op for n in graph.node]
    for f in graph.library.function:
        ops += [n.op for n in f.node_def]
    return sorted(set(ops))

def check_saved_model(name, out, result):
    src = root / name
    feed = FEEDS[name]
    rels = {k: rel(serve(src, k, feed), serve(out, k, feed)) for k in result.signatures}
    report = to_slim_report(result)
    return {"rel": rels, "variables": variables(out), "ops": op_types(out),
            "source_variables": variables(src),
            "bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file()),
            "result": result.to_dict(), "report": report.to_dict(), "text": render_slim(report)}

def check_tflite(name, out, result):
    src = root / name
    feed = FEEDS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        interpreter = tf.lite.Interpreter(model_path=str(out))
    keys = list(interpreter.get_signature_list())
    rels = {}
    for k in keys:
        got = interpreter.get_signature_runner(k)(**feed)
        rels[k] = rel(serve(src, k, feed), got)
    return {"rel": rels, "signatures": keys, "bytes": out.stat().st_size,
            "result": result.to_dict()}

CASES = [
    ("keras_default", "keras_bn", {}, check_saved_model),
    ("keras_freeze", "keras_bn", {"freeze": True}, check_saved_model),
    ("keras_tflite", "keras_bn", {"to": "tflite"}, check_tflite),
    ("keras_dynamic", "keras_bn", {"to": "tflite", "quantize": "dynamic"}, check_tflite),
    ("keras_float16", "keras_bn", {"to": "tflite", "quantize": "float16"}, check_tflite),
    ("keras_int8", "keras_bn", {"to": "tflite", "quantize": "int8"}, check_tflite),
    ("mobilenet_freeze", "mobilenet_bn", {"freeze": True}, check_saved_model),
    ("mobilenet_dynamic", "mobilenet_bn", {"to": "tflite", "quantize": "dynamic"},
     check_tflite),
    ("module_default", "module_adam", {}, check_saved_model),
    ("module_freeze", "module_adam", {"freeze": True}, check_saved_model),
]
results = {}
for case, name, kwargs, check in CASES:
    try:
        suffix = ".tflite" if kwargs.get("to") == "tflite" else ""
        out = root / "out" / (case + suffix)
        result = slim_saved_model(root / name, out, **kwargs)
        results[case] = check(name, out, result)
    except Exception:
        results[case] = {"error": traceback.format_exc()}

# Over the tolerance: an error, and nothing at OUT (nor a staging folder beside it).
try:
    slim_saved_model(root / "keras_bn", root / "out" / "strict.tflite", to="tflite",
                     quantize="float16", tolerance=0.0)
    results["mismatch"] = {"error": "no OutputMismatchError"}
except OutputMismatchError as exc:
    results["mismatch"] = {"message": str(exc),
                           "left": sorted(p.name for p in (root / "out").iterdir())}

# A saved_model.pb TensorFlow cannot parse: CorruptFileError (exit 2), nothing written.
import shutil
from modelsize.errors import CorruptFileError
bad = root / "corrupt"
shutil.copytree(root / "module_adam", bad)
(bad / "saved_model.pb").write_bytes(b"\xff" * 64)
try:
    slim_saved_model(bad, root / "out" / "corrupt_out")
    results["corrupt"] = {"error": "no CorruptFileError"}
except CorruptFileError as exc:
    results["corrupt"] = {"message": str(exc), "exit_code": exc.exit_code,
                          "written": (root / "out" / "corrupt_out").exists()}

# A dry run: the plan, nothing written.
try:
    dry = slim_saved_model(root / "module_adam", root / "out" / "dry", dry_run=True)
    results["dry_run"] = {"result": dry.to_dict(), "written": (root / "out" / "dry").exists()}
except Exception:
    results["dry_run"] = {"error": traceback.format_exc()}

# Through SlimOptions, as modelsize.slim calls it: default name beside the input.
try:
    from modelsize import formats
    from modelsize.slimming.graph.tf_savedmodel import slim_from_options
    from modelsize.slimming.plan import SlimOptions
    report = slim_from_options(formats.read(root / "keras_bn"), None,
                               SlimOptions(to="tflite", quantize="float16"),
                               dry_run=False, force=False)
    results["options"] = {"report": report.to_dict(),
                          "exists": (root / "keras_bn.tflite").is_file()}
except Exception:
    results["options"] = {"error": traceback.format_exc()}

# --force replaces an existing output folder.
try:
    out = root / "out" / "module_default"
    (out / "stale.txt").write_text("x")
    slim_saved_model(root / "module_adam", out, force=True)
    results["force"] = {"files": sorted(p.name for p in out.iterdir())}
except Exception:
    results["force"] = {"error": traceback.format_exc()}

# The same slims again after other functions were traced in the process: TensorFlow's
# counter has moved on, the saved_model.pb bytes have not (functions renumbered from 0).
try:
    import re
    for _ in range(40):
        tf.function(lambda v: v + 1).get_concrete_function(tf.TensorSpec([1]))
    again = {}
    for case, name, kwargs in (("keras_freeze", "keras_bn", {"freeze": True}),
                               ("module_default", "module_adam", {})):
        out = root / "out" / (case + "_again")
        slim_saved_model(root / name, out, **kwargs)
        first = (root / "out" / case / "saved_model.pb").read_bytes()
        again[case] = {
            "same": first == (out / "saved_model.pb").read_bytes(),
            "numbers": sorted({int(n) for n in re.findall(rb"__inference_\w*?_(\d+)\b", first)}),
            "served": rel(serve(root / name, "serving_default", FEEDS[name]),
                          serve(out, "serving_default", FEEDS[name])),
        }
    results["renumbered"] = again
except Exception:
    results["renumbered"] = {"error": traceback.format_exc()}
print(json.dumps(results))
"""


def _tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _tf_env_code(code: str) -> str:
    # run_in_tf starts a bare environment; modelsize's source must be importable there.
    return f"import sys; sys.path.insert(0, {str(REPO / 'src')!r})\n" + code


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The two SavedModels, built once by TensorFlow."""
    root = tmp_path_factory.mktemp("tf_savedmodels")
    proc = run_in_tf(_BUILD, str(root))
    return root, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def slimmed(built: tuple[Path, dict[str, Any]]) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Every slim of both models, checked by TensorFlow; the inputs' digests before and after."""
    root, info = built
    (root / "out").mkdir(exist_ok=True)
    before = {n: _tree_digest(root / n) for n in ("keras_bn", "module_adam", "mobilenet_bn")}
    proc = run_in_tf(_tf_env_code(_SLIM_AND_CHECK), str(root))
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    results["_inputs_untouched"] = before == {n: _tree_digest(root / n) for n in before}
    return root, info, results


def _case(results: dict[str, Any], name: str) -> dict[str, Any]:
    case = results[name]
    assert "error" not in case, case["error"]
    return case


# ------------------------------------------------------------------------------------------
# Round trips (TensorFlow venv)
# ------------------------------------------------------------------------------------------
def test_module_with_optimizer_keeps_only_what_the_signature_reads(slimmed: Any) -> None:
    root, info, results = slimmed
    case = _case(results, "module_default")
    assert case["rel"] == {"serving_default": 0.0}
    # Only w and b are left: Adam's slots, its step counter and learning rate are gone.
    assert sorted(case["variables"].values()) == sorted(info["module_variables"].values())
    assert info["optimizer_variables"] > 0
    source = formats.read(root / "module_adam").bytes_by_category
    output = formats.read(root / "out" / "module_default").bytes_by_category
    assert source[Category.OPTIMIZER_STATE] > 0
    assert output[Category.OPTIMIZER_STATE] == 0
    assert output[Category.WEIGHTS] == (4 * 3 + 3) * 4
    result = case["result"]
    assert result["passes"] == ["prune-to-signatures"] and result["verified"]
    assert result["categories_after"]["optimizer_state"] == 0
    assert result["bytes_after"] == case["bytes"]
    # As the SlimReport `modelsize slim` renders: dropped tensors by their checkpoint keys.
    report = case["report"]
    optimizer_keys = {k for k in case["source_variables"] if k.startswith("optimizer/")}
    assert len(optimizer_keys) == info["optimizer_variables"]
    assert {d["name"] for d in report["dropped"]} == optimizer_keys
    assert {k["name"] for k in report["kept"]} == {
        "w/.ATTRIBUTES/VARIABLE_VALUE", "b/.ATTRIBUTES/VARIABLE_VALUE"}
    assert report["outputs_compared"]["ok"] and report["output_bytes"] == case["bytes"]
    assert report["bytes_by_category"]["optimizer_state"]["after"] == 0
    assert "prune-to-signatures" in case["text"] and "serving_default/y" in case["text"]


def test_module_frozen_has_no_variables_and_same_outputs(slimmed: Any) -> None:
    _, _, results = slimmed
    case = _case(results, "module_freeze")
    assert case["rel"]["serving_default"] <= TOLERANCES["exact"]
    assert case["variables"] == {}
    assert "VarHandleOp" not in case["ops"] and "ReadVariableOp" not in case["ops"]


def test_saved_model_bytes_do_not_depend_on_what_ran_before(slimmed: Any) -> None:
    # TensorFlow numbers functions by a process-wide counter; the slim renumbers them from 0,
    # so the same input gives the same saved_model.pb, and it still loads and serves.
    _, _, results = slimmed
    again = _case(results, "renumbered")
    for case in ("keras_freeze", "module_default"):
        assert again[case]["same"], case
        numbers = again[case]["numbers"]
        assert numbers == list(range(len(numbers))) and len(numbers) >= 4, numbers
        assert again[case]["served"] <= TOLERANCES["exact"]


def test_keras_default_drops_the_second_copy_and_serves_both_signatures(slimmed: Any) -> None:
    root, info, results = slimmed
    case = _case(results, "keras_default")
    assert case["rel"] == {"serve": 0.0, "serving_default": 0.0}
    assert len(case["variables"]) == info["keras_variables"]
    output = formats.read(root / "out" / "keras_default").bytes_by_category
    assert output[Category.DUPLICATES] == 0


def test_keras_freeze_folds_every_batchnorm(slimmed: Any) -> None:
    _, info, results = slimmed
    case = _case(results, "keras_freeze")
    assert all(r <= TOLERANCES["exact"] for r in case["rel"].values()), case["rel"]
    assert case["variables"] == {}
    # What an inference BatchNorm becomes (Mul by scale, Rsqrt, FusedBatchNorm) is gone from
    # every function: all three were folded into the Conv2D / MatMul weights before them
    # (grappler's constant folding merges the bias-free Conv2D's itself).
    assert info["batchnorms"] == 3
    assert not {"Mul", "Rsqrt", "FusedBatchNormV3"} & set(case["ops"]), case["ops"]
    assert 1 <= case["result"]["folded_batchnorms"] <= info["batchnorms"]


def test_mobilenet_freeze_folds_depthwise_batchnorms_with_and_without_shift(
    slimmed: Any,
) -> None:
    _, info, results = slimmed
    case = _case(results, "mobilenet_freeze")
    assert all(r <= TOLERANCES["exact"] for r in case["rel"].values()), case["rel"]
    assert case["variables"] == {}
    # No BatchNorm arithmetic is left after any convolution, depthwise ones included (one
    # of them with a zero shift, where only the Mul by the scale remains to fold).
    assert not {"Mul", "Rsqrt", "FusedBatchNormV3"} & set(case["ops"]), case["ops"]
    assert {"DepthwiseConv2dNative", "Relu6"} <= set(case["ops"])
    assert info["mobilenet_depthwise"] == 2 and info["mobilenet_batchnorms"] == 6
    # Grappler merges the scale into the bias-free Conv2D's itself; the depthwise ones
    # are modelsize's.
    assert case["result"]["folded_batchnorms"] >= info["mobilenet_depthwise"]
    assert case["bytes"] < case["result"]["bytes_before"]


def test_mobilenet_dynamic_range_tflite_within_tolerance(slimmed: Any) -> None:
    _, _, results = slimmed
    case = _case(results, "mobilenet_dynamic")
    assert case["signatures"] == ["serving_default"]
    assert case["rel"]["serving_default"] <= TOLERANCES["dynamic"]
    assert case["bytes"] < case["result"]["bytes_before"]


@pytest.mark.parametrize(("case", "bound"), [
    ("keras_tflite", TOLERANCES["tflite"]),
    ("keras_dynamic", TOLERANCES["dynamic"]),
    ("keras_float16", TOLERANCES["float16"]),
    ("keras_int8", TOLERANCES["int8"]),
])
def test_tflite_loads_in_the_interpreter_within_tolerance(
    slimmed: Any, case: str, bound: float
) -> None:
    _, _, results = slimmed
    found = _case(results, case)
    assert found["signatures"] == ["serving_default"]
    assert found["rel"]["serving_default"] <= bound
    assert found["result"]["bytes_after"] == found["bytes"]
    assert found["result"]["verified"]


def test_int8_is_smaller_than_float_tflite(slimmed: Any) -> None:
    _, _, results = slimmed
    assert _case(results, "keras_int8")["bytes"] < _case(results, "keras_tflite")["bytes"]


def test_over_tolerance_writes_nothing(slimmed: Any) -> None:
    _, _, results = slimmed
    case = _case(results, "mismatch")
    assert "tolerance" in case["message"]
    assert "strict.tflite" not in case["left"]
    assert not [n for n in case["left"] if "modelsize-tmp" in n]


def test_force_replaces_the_output_folder_and_inputs_stay_untouched(slimmed: Any) -> None:
    _, _, results = slimmed
    assert "stale.txt" not in _case(results, "force")["files"]
    assert results["_inputs_untouched"]


def test_dry_run_plans_without_writing(slimmed: Any) -> None:
    _, info, results = slimmed
    case = _case(results, "dry_run")
    assert not case["written"]
    result = case["result"]
    assert result["dry_run"] and not result["verified"] and result["bytes_after"] is None
    assert len(result["kept"]) == len(info["module_variables"])
    assert len(result["dropped"]) == info["optimizer_variables"]


def test_through_slim_options_with_the_default_name(slimmed: Any) -> None:
    _, _, results = slimmed
    report = _case(results, "options")["report"]
    assert _case(results, "options")["exists"]
    assert report["output"].endswith("keras_bn.tflite") and report["output_format"] == "tflite"
    assert report["outputs_compared"]["kind"] == "float16"
    assert report["outputs_compared"]["max_rel"] <= TOLERANCES["float16"]
    assert report["passes"][0]["name"] == "tflite"


# ------------------------------------------------------------------------------------------
# Refusals (main venv: they happen before TensorFlow is needed)
# ------------------------------------------------------------------------------------------
def test_printed_fix_of_a_saved_model_runs_as_printed(tmp_path: Path) -> None:
    # inspect's fix for a SavedModel (here Keras' second copy of every variable) is a plain
    # `modelsize slim DIR -o DIR.slim`: the flags that pick tensors do not apply to one.
    import shutil

    from modelsize.findings import fix_command
    from modelsize.inspection import inspect

    src = tmp_path / "saved_model"
    shutil.copytree(REPO / "tests/fixtures/tensorflow/saved_model", src)
    report = inspect(src)
    assert report.inventory.bytes_by_category[Category.DUPLICATES] > 0
    command = fix_command(report.inventory, list(report.findings))
    assert command == f"modelsize slim {src} -o {src}.slim"
    before = _tree_digest(src)
    proc = run_printed_in_tf(command, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Verified" in proc.stdout
    assert _tree_digest(src) == before
    after = formats.read(tmp_path / "saved_model.slim").bytes_by_category
    assert after[Category.DUPLICATES] == 0
    assert after[Category.WEIGHTS] == report.inventory.bytes_by_category[Category.WEIGHTS]


#: A copy of module_adam whose object graph links its optimizer to a slot variable, as a Keras 2
#: optimizer's does: TensorFlow then revives the slot with Optimizer.add_slot, which the
#: revived optimizer lacks. Prints what plain TensorFlow and the slim make of it.
_KERAS2_SLOTS = r"""
import json, shutil, sys
from pathlib import Path
import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2
from modelsize.slimming.graph.tf_savedmodel import slim_saved_model

root = Path(sys.argv[1])
src = root / "keras2_slots"
shutil.copytree(root / "module_adam", src)
model = saved_model_pb2.SavedModel()
model.ParseFromString((src / "saved_model.pb").read_bytes())
nodes = model.meta_graphs[0].object_graph_def.nodes
child = lambda node, name: next(c.node_id for c in node.children if c.local_name == name)
optimizer = nodes[child(nodes[0], "optimizer")]
slot = next(c.node_id for c in optimizer.children
            if nodes[c.node_id].WhichOneof("kind") == "variable")
ref = optimizer.slot_variables.add()
ref.original_variable_node_id, ref.slot_name, ref.slot_variable_node_id = (
    child(nodes[0], "w"), "m", slot)
(src / "saved_model.pb").write_bytes(model.SerializeToString())
try:
    tf.saved_model.load(str(src))
    plain = "loaded"
except Exception as exc:
    plain = str(exc)
result = slim_saved_model(src, root / "out" / "keras2_slots_out")
x = np.ones((2, 4), "float32")
a = tf.saved_model.load(str(root / "module_adam")).signatures["serving_default"](x=x)
b = tf.saved_model.load(str(root / "out" / "keras2_slots_out")).signatures["serving_default"](x=x)
print(json.dumps({"plain": plain, "notes": list(result.notes), "verified": result.verified,
                  "same": bool(np.array_equal(a["y"].numpy(), b["y"].numpy())),
                  "kept": sorted(result.kept),
                  "view_left": [p.name for p in Path(src).iterdir()]}))
"""


def test_keras2_optimizer_slots_are_read_without_reviving_the_optimizer(built: Any) -> None:
    root, _ = built
    (root / "out").mkdir(exist_ok=True)
    proc = run_in_tf(_tf_env_code(_KERAS2_SLOTS), str(root))
    case = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "add_slot" in case["plain"]  # what TensorFlow alone says of it
    assert case["verified"] and case["same"]
    assert case["kept"] == ["b/.ATTRIBUTES/VARIABLE_VALUE", "w/.ATTRIBUTES/VARIABLE_VALUE"]
    assert any("Optimizer.add_slot" in n for n in case["notes"])
    # The input is as it was: no view left inside it.
    assert sorted(case["view_left"]) == sorted(p.name for p in (root / "module_adam").iterdir())


#: Two SavedModels whose constant folding grows the graph, frozen. ``table``: a 512x512 table
#: computed from a fill and a range (folded, 1 MB of constant). ``kernels``: one 64x36 kernel,
#: scaled, read by four conv1d, each of which expands it (folded, four equal constants).
_FOLDING_GROWS = r"""
import json, sys
from collections import Counter
from pathlib import Path
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2
from modelsize.slimming.graph.tf_savedmodel import slim_saved_model

root = Path(sys.argv[1])

class Table(tf.Module):
    def __init__(self):
        self.v = tf.Variable(tf.ones([1, 512]))
    @tf.function(input_signature=[tf.TensorSpec([None, 512], tf.float32, name="x")])
    def serve(self, x):
        table = tf.fill([512, 512], 0.5) * self.v + tf.range(512, dtype=tf.float32)[:, None]
        return {"y": tf.matmul(x, table)}

class Kernels(tf.Module):
    def __init__(self):
        self.k = tf.Variable(tf.cos(tf.range(64.0)[:, None] * tf.range(36.0)[None, :] / 9.0))
    @tf.function(input_signature=[tf.TensorSpec([None, 100, 1], tf.float32, name="x")])
    def serve(self, x):
        k = (self.k * 0.5)[:, None, :]
        ys = [tf.nn.conv1d(x[:, i:i + 90], k, 1, "VALID") for i in range(4)]
        return {"y": tf.add_n(ys)}

out = {}
for name, module in (("table", Table()), ("kernels", Kernels())):
    tf.saved_model.save(module, str(root / name), signatures={"serving_default": module.serve})
    result = slim_saved_model(root / name, root / "out" / (name + "_frozen"), freeze=True)
    model = saved_model_pb2.SavedModel()
    model.ParseFromString((root / "out" / (name + "_frozen") / "saved_model.pb").read_bytes())
    library = model.meta_graphs[0].graph_def.library.function
    values = Counter(n.attr["value"].SerializeToString(deterministic=True)
                     for f in library for n in f.node_def if n.op == "Const")
    out[name] = {"notes": list(result.notes), "verified": result.verified,
                 "worst": max(d.max_rel for d in result.diffs),
                 "pb": (root / "out" / (name + "_frozen") / "saved_model.pb").stat().st_size,
                 "largest_const": max(len(v) for v in values),
                 "repeated_consts": sum(n - 1 for v, n in values.items() if len(v) > 1024)}
print(json.dumps(out))
"""


def test_freeze_never_keeps_what_constant_folding_grew(built: Any) -> None:
    root, _ = built
    (root / "out").mkdir(exist_ok=True)
    proc = run_in_tf(_tf_env_code(_FOLDING_GROWS), str(root))
    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    table, kernels = cases["table"], cases["kernels"]
    # The 1 MB table is not written: the frozen graph stays unfolded, and says so.
    assert table["verified"] and table["worst"] <= TOLERANCES["exact"]
    assert table["largest_const"] < 512 * 4 * 2 and table["pb"] < 100_000
    assert any("constant folding made the frozen graph larger" in n for n in table["notes"])
    # The folded kernel is written once, not once for each convolution.
    assert kernels["verified"] and kernels["worst"] <= TOLERANCES["exact"]
    assert kernels["largest_const"] >= 64 * 36 * 4 and kernels["repeated_consts"] == 0
    assert "merged" in kernels["notes"][0], kernels["notes"]
    assert not any("made the frozen graph larger" in n for n in kernels["notes"])


def test_missing_or_not_a_saved_model(tmp_path: Path) -> None:
    with pytest.raises(PathNotFoundError):
        slim_saved_model(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnknownFormatError, match=r"saved_model\.pb"):
        slim_saved_model(tmp_path / "empty", tmp_path / "out")


def test_corrupt_saved_model_pb(slimmed: Any) -> None:
    _, _, results = slimmed
    case = _case(results, "corrupt")
    assert case["exit_code"] == 2 and not case["written"]
    assert "corrupt" in case["message"] and "\n" not in case["message"]


def test_existing_output_and_bad_options_are_refused(built: Any, tmp_path: Path) -> None:
    root, _ = built
    existing = tmp_path / "out"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(UsageError, match="--force"):
        slim_saved_model(root / "module_adam", existing)
    assert (existing / "keep.txt").read_text() == "mine"
    with pytest.raises(UsageError, match="--to tflite"):
        slim_saved_model(root / "module_adam", tmp_path / "q", quantize="int8")
    with pytest.raises(UsageError, match="--quantize"):
        slim_saved_model(root / "module_adam", tmp_path / "q.tflite", to="tflite",
                         quantize="int4")
    with pytest.raises(UsageError, match="--to"):
        slim_saved_model(root / "module_adam", tmp_path / "q", to="onnx")


def test_options_that_pick_tensors_are_refused(built: Any, tmp_path: Path) -> None:
    root, _ = built
    inv = formats.read(root / "module_adam")
    for options in (SlimOptions(drop=frozenset({"optimizer_state"})), SlimOptions(dedupe=True),
                    SlimOptions(cast="float16"), SlimOptions(keep=("w*",))):
        with pytest.raises(UsageError, match="SavedModel"):
            slim_from_options(inv, tmp_path / "out", options, dry_run=False, force=False)
    assert os.listdir(tmp_path) == []


def test_without_tensorflow_one_clear_error(built: Any, tmp_path: Path) -> None:
    try:
        import tensorflow  # noqa: F401 (only its absence is tested)
    except ImportError:
        pass
    else:
        pytest.skip("TensorFlow is importable here")
    root, _ = built
    with pytest.raises(MissingDependencyError, match=r"modelsize\[tf\]") as caught:
        slim_saved_model(root / "module_adam", tmp_path / "out")
    assert "--to safetensors" in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()
    assert os.listdir(tmp_path) == []
