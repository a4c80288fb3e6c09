"""Ground truth for one corpus file, computed by the file's own framework, printed as JSON.

    python truth.py JOBS.json OUT.json       # JOBS: [[framework, path], ...]

Run in a subprocess (by ``test_realfiles.py``), never imported: it loads the files, and some of
them are pickles. Only files from the pinned wheels of ``fetch.py`` (and modelsize's slimmed
copies of them) are given to it. A framework is one of ``torch``
(``torch.load(weights_only=True)``), ``torchscript`` (``torch.jit.load``), ``onnx``
(``onnx.load``, then ``onnx.checker`` and an onnxruntime session), ``safetensors``
(``load_file``), ``keras-h5`` (h5py), ``keras`` (``keras.models.load_model``: the TF venv),
``tensorflow`` (``tf.train.load_checkpoint`` and the SavedModel's own object graph: the TF
venv), ``tflite`` (``tf.lite.Interpreter`` and TensorFlow's flatbuffer schema: the TF venv),
``numpy`` (``np.load``), ``npz`` (``np.load``) or ``pickle`` (``pickle.load`` whose
classes outside NumPy and the standard library are inert stand-ins: NumPy rebuilds every
array, nothing else runs).

OUT maps each path to ``{"tensors": [{"name", "dtype", "shape", "nbytes", "storage",
"digest"}], "storage_bytes": int | null, ...}`` (``storage`` groups tensors that share memory,
``digest`` is the SHA-1 of the tensor's values in C order; format-specific keys follow), or
to ``{"error": str}``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any


def _digest(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _record(name: str, dtype: str, shape: Any, nbytes: int, storage: str, digest: str | None,
            **extra: Any) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": [int(d) for d in shape], "nbytes": int(nbytes),
            "storage": storage, "digest": digest, **extra}


# -- PyTorch ---------------------------------------------------------------------------------
def _torch_dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def _torch_record(name: str, t: Any) -> dict[str, Any]:
    import torch

    storage = t.untyped_storage()
    size = t.element_size()
    data, span = b"", 0  # span: elements from the first the view reaches to the last
    if t.numel():
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return _record(name, _torch_dtype(t), t.shape, t.numel() * size,
                   str(storage.data_ptr()) if storage.nbytes() else f"empty:{name}",
                   _digest(data), storage_nbytes=storage.nbytes(),
                   reach=[t.storage_offset() * size, (t.storage_offset() + span) * size])


def _walk(obj: Any, prefix: str, out: dict[str, Any], seen: set[int]) -> None:
    """Every tensor reachable from a loaded object, named by its dotted path."""
    import torch

    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return
    for key, value in items:
        _walk(value, f"{prefix}.{key}" if prefix else str(key), out, seen)


def _storage_bytes(records: list[dict[str, Any]]) -> int:
    return sum({r["storage"]: r["storage_nbytes"] for r in records}.values())


def torch_truth(path: str) -> dict[str, Any]:
    import torch

    obj = torch.load(path, map_location="cpu", weights_only=True)
    found: dict[str, Any] = {}
    _walk(obj, "", found, set())
    records = [_torch_record(n, t) for n, t in found.items()]
    return {"tensors": records, "storage_bytes": _storage_bytes(records)}


def torchscript_truth(path: str) -> dict[str, Any]:
    import torch

    module = torch.jit.load(path, map_location="cpu")
    # Every attribute of every submodule: parameters, buffers and plain tensor attributes
    # (silero's ``_state``) alike; ``state_dict()`` shows only the first two.
    attributes = torch._C._jit_debug_module_iterators(module._c)["named_attributes_r"]
    records = [_torch_record(n, t) for n, t in attributes if isinstance(t, torch.Tensor)]
    return {"tensors": records, "storage_bytes": _storage_bytes(records),
            "state_dict": sorted(module.state_dict())}


# -- ONNX ------------------------------------------------------------------------------------
def onnx_truth(path: str) -> dict[str, Any]:
    """Every TensorProto of the model: initializers of every graph, node attribute tensors.

    Names follow modelsize's scheme: a tensor's own name, prefixed in a subgraph with
    ``<node output>.<attr>/``; a node's tensor without a name of its own (or with one already
    taken) is named after the node's first output (``.attr`` unless the attribute is ``value``).
    """
    import onnx
    from onnx import numpy_helper

    model = onnx.load(path, load_external_data=False)
    records: list[dict[str, Any]] = []
    unused: list[str] = []
    taken: set[str] = set()
    bare_count = 0

    def tensor(t: Any, name: str, used: bool = True) -> None:
        taken.add(name)
        array = numpy_helper.to_array(t)
        dtype = "string" if array.dtype.kind in "OSU" else array.dtype.name
        nbytes = 0 if dtype == "string" else array.nbytes
        digest = None if dtype == "string" else _digest(array.tobytes())
        records.append(_record(name, dtype, t.dims, nbytes, name, digest))
        if not used:
            unused.append(name)

    def graph(g: Any, scope: str, outer: set[str]) -> set[str]:
        """Record ``g``'s tensors; return the names it reads from enclosing scopes."""
        nonlocal bare_count
        reads: set[str] = {o.name for o in g.output}
        defined = {i.name for i in g.initializer} | {i.name for i in g.input}
        for node in g.node:
            reads.update(node.input)
            base = scope + (next((o for o in node.output if o), "") or node.name or "node")
            for attr in node.attribute:
                name = base if attr.name == "value" else f"{base}.{attr.name}"
                inner = [*([attr.t] if attr.HasField("t") else []), *attr.tensors]
                for i, t in enumerate(inner):
                    own = scope + t.name
                    tensor(t, own if t.name and own not in taken else
                           name if len(inner) == 1 else f"{name}[{i}]")
                subgraphs = [*([attr.g] if attr.HasField("g") else []), *attr.graphs]
                for i, sub in enumerate(subgraphs):
                    label = name if len(subgraphs) == 1 else f"{name}[{i}]"
                    reads |= graph(sub, f"{label}/", outer | defined)
            defined.update(node.output)
        for init in g.initializer:
            if not init.name:
                bare_count += 1
            tensor(init, scope + (init.name or f"initializer_{bare_count}"),
                   used=init.name in reads)
        for sparse in g.sparse_initializer:
            tensor(sparse.values, scope + sparse.values.name)
            tensor(sparse.indices, f"{scope}{sparse.values.name}.indices")
        return reads - defined

    graph(model.graph, "", set())
    onnx.checker.check_model(model)
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # it warns of the unused initializers the test checks
    onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    return {"tensors": records, "storage_bytes": None, "unused": unused}


# -- safetensors, NumPy ----------------------------------------------------------------------
def safetensors_truth(path: str) -> dict[str, Any]:
    from safetensors.numpy import load_file

    arrays = load_file(path)
    records = [_record(n, a.dtype.name, a.shape, a.nbytes, n, _digest(a.tobytes()))
               for n, a in arrays.items()]
    return {"tensors": records, "storage_bytes": sum(r["nbytes"] for r in records)}


def _array_record(name: str, a: Any) -> dict[str, Any]:
    import numpy as np

    c = np.ascontiguousarray(a)
    return _record(name, a.dtype.name, a.shape, a.nbytes, name, _digest(c.tobytes()))


def numpy_truth(path: str) -> dict[str, Any]:
    """A plain array, or the arrays inside an object array (``allow_pickle``: pinned files)."""
    import numpy as np

    array = np.load(path, mmap_mode="r", allow_pickle=False) if _plain_npy(path) else None
    if array is not None:
        return {"tensors": [_array_record("array", array)], "storage_bytes": array.nbytes,
                "object": False}
    obj = np.load(path, allow_pickle=True)
    found: list[dict[str, Any]] = []

    def walk(o: Any, prefix: str) -> None:
        if isinstance(o, np.ndarray) and o.dtype != object:
            found.append(_array_record(prefix, o))
        elif isinstance(o, np.ndarray):
            for i, item in enumerate(o.flat):
                walk(item, f"{prefix}[{i}]" if o.ndim else prefix)
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{prefix}.{k}")
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                walk(v, f"{prefix}.{i}")

    walk(obj, "array")
    return {"tensors": found, "storage_bytes": None, "object": True}


def npz_truth(path: str) -> dict[str, Any]:
    import numpy as np

    with np.load(path, allow_pickle=False) as z:
        records = [_array_record(n, z[n]) for n in z.files]
    return {"tensors": records, "storage_bytes": sum(r["nbytes"] for r in records)}


def _plain_npy(path: str) -> bool:
    import numpy as np

    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                  else np.lib.format.read_array_header_2_0)(f)
    return not header[2].hasobject


def load_pickle(path: str) -> tuple[Any, list[Any]]:
    """``pickle.load`` with inert stand-ins for every class outside NumPy and the standard
    library (so it runs no code of the pickle's author); also returns every array NumPy built.
    """
    import pickle

    built: list[Any] = []
    safe_modules = ("numpy", "_codecs", "collections", "builtins", "copyreg", "__builtin__",
                    "copy_reg")
    stand_ins: dict[tuple[str, str], type] = {}

    def keep(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            a = fn(*args, **kwargs)
            built.append(a)
            return a
        return wrapper

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module.split(".")[0] in safe_modules:
                found = super().find_class(module, name)
                if name in ("_reconstruct", "_frombuffer", "frombuffer"):
                    return keep(found)
                return found
            if (module, name) not in stand_ins:
                stand_ins[module, name] = type(name, (_StandIn,), {"__module__": module})
            return stand_ins[module, name]

    with open(path, "rb") as f:
        obj = Unpickler(f, encoding="latin1").load()
    return obj, built


def pickle_truth(path: str) -> dict[str, Any]:
    """Every NumPy array the pickle builds, as NumPy builds it (shared ones once)."""
    import numpy as np

    _, built = load_pickle(path)
    unique = {id(a): a for a in built if isinstance(a, np.ndarray) and a.dtype != object}
    records = [_array_record(f"array_{i}", a) for i, a in enumerate(unique.values())]
    return {"tensors": records, "storage_bytes": sum(r["nbytes"] for r in records)}


class _StandIn:
    """An inert object for a class the pickle names: keeps its arguments and state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


# -- Keras HDF5, TensorFlow (the TF venv) ----------------------------------------------------
def h5_truth(path: str) -> dict[str, Any]:
    """Every HDF5 dataset (h5py)."""
    import h5py

    records: list[dict[str, Any]] = []

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset):
            a = obj[()]
            records.append(_record(name, obj.dtype.name, obj.shape, obj.size * obj.dtype.itemsize,
                                   name, _digest(a.tobytes()) if hasattr(a, "tobytes") else None))

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return {"tensors": records, "storage_bytes": sum(r["nbytes"] for r in records)}


def keras_truth(path: str) -> dict[str, Any]:
    """The weights Keras loads as the model (``load_model``, no compile)."""
    import keras

    model = keras.models.load_model(path, compile=False)
    records = [
        _record(w.path, w.dtype, w.shape, w.numpy().nbytes, w.path, _digest(w.numpy().tobytes()),
                trainable=bool(w.trainable))
        for w in model.weights]
    return {"tensors": records, "storage_bytes": None}


def tensorflow_truth(path: str) -> dict[str, Any]:
    """A SavedModel: every checkpoint entry (``tf.train.load_checkpoint``), and which ones
    the SavedModel's object graph says are trainable variables."""
    import tensorflow as tf
    from tensorflow.core.protobuf import saved_model_pb2, trackable_object_graph_pb2

    reader = tf.train.load_checkpoint(f"{path}/variables/variables")
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    records = []
    for name in sorted(shapes):
        value = reader.get_tensor(name)
        dtype = dtypes[name].name
        if dtype == "string":  # the object graph: one serialized proto
            records.append(_record(name, dtype, shapes[name], 0, name,
                                   _digest(value) if isinstance(value, bytes) else None))
        else:
            records.append(_record(name, dtype, shapes[name], value.nbytes, name,
                                   _digest(value.tobytes())))
    saved = saved_model_pb2.SavedModel()
    with open(f"{path}/saved_model.pb", "rb") as f:
        saved.ParseFromString(f.read())
    objects = saved.meta_graphs[0].object_graph_def.nodes
    trackable = trackable_object_graph_pb2.TrackableObjectGraph()
    trackable.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    variables = {}
    # The checkpoint's object graph lists the SavedModel's first nodes in the same order.
    # (a wrong pairing would show as a shape or dtype that differs from the checkpoint's).
    for obj, node in zip(objects, trackable.nodes, strict=False):
        if obj.WhichOneof("kind") != "variable":
            continue
        key = next(a.checkpoint_key for a in node.attributes if a.name == "VARIABLE_VALUE")
        v = obj.variable
        shape, dtype = [d.size for d in v.shape.dim], tf.dtypes.as_dtype(v.dtype).name
        if (shape, dtype) != (list(shapes[key]), dtypes[key].name):
            raise ValueError(f"object graph variable {v.name} is not checkpoint entry {key}")
        variables[key] = {"trainable": v.trainable, "name": v.name}
    return {"tensors": records, "storage_bytes": None, "variables": variables}


def tflite_truth(path: str) -> dict[str, Any]:
    """A TFLite model: every constant tensor (one whose buffer holds bytes, as TensorFlow's
    own flatbuffer schema reads it) with the interpreter's name, dtype and shape; tensors of
    subgraph ``s > 0`` named ``<subgraph name>/<name>``, a repeated name suffixed ``#2``..."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.lite.python import schema_py_generated as schema

    with open(path, "rb") as f:
        data = f.read()
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(data, 0))
    buffers = [bytes(b.data) if b.data is not None and len(b.data) else
               data[b.offset:b.offset + b.size] if (b.offset or 0) > 1 else b""
               for b in model.buffers]
    interpreter = tf.lite.Interpreter(model_path=path)
    records, seen, quant_bytes = [], {}, 0
    for s, subgraph in enumerate(model.subgraphs):
        details = {d["index"]: d for d in interpreter.get_tensor_details(subgraph_index=s)}
        prefix = "" if s == 0 else f"{(subgraph.name or b'').decode() or f'subgraph{s}'}/"
        for i, t in enumerate(subgraph.tensors):
            raw = buffers[t.buffer]
            if not raw:
                continue
            d = details[i]
            dtype = np.dtype(d["dtype"])
            name = prefix + d["name"]
            seen[name] = seen.get(name, 0) + 1
            if seen[name] > 1:
                name = f"{name}#{seen[name]}"
            q = t.quantization
            arrays = ((q.scale, 4), (q.zeroPoint, 8), (q.min, 4), (q.max, 4)) if q else ()
            for values, item in arrays:
                if values is not None:  # each vector: its length prefix and its items
                    quant_bytes += 4 + len(values) * item
            records.append(_record(name, dtype.name, d["shape"],
                                   int(np.prod(d["shape"])) * dtype.itemsize,
                                   f"buffer {t.buffer}", _digest(raw),
                                   scales=len(d["quantization_parameters"]["scales"])))
    used = {int(r["storage"].split()[1]) for r in records}
    return {"tensors": records, "storage_bytes": sum(len(buffers[b]) for b in used),
            "quant_bytes": quant_bytes,
            "metadata": {m.name.decode(): len(buffers[m.buffer]) for m in model.metadata or []}}


TRUTHS = {
    "torch": torch_truth, "torchscript": torchscript_truth, "onnx": onnx_truth,
    "safetensors": safetensors_truth, "numpy": numpy_truth, "npz": npz_truth,
    "pickle": pickle_truth, "keras-h5": h5_truth, "keras": keras_truth,
    "tensorflow": tensorflow_truth, "tflite": tflite_truth,
}


def main(jobs_path: str, out_path: str) -> None:
    with open(jobs_path) as f:
        jobs = json.load(f)
    out: dict[str, Any] = {}
    for framework, path in jobs:
        try:
            out[f"{framework}:{path}"] = TRUTHS[framework](path)
        except Exception as exc:  # reported per file; the test names it
            out[f"{framework}:{path}"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
