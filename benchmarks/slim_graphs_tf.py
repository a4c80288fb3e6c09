"""``modelsize slim`` of TensorFlow SavedModels: size, time and output difference per mode.

Builds, with real TensorFlow and Keras 3, two SavedModels:

* ``resnet_bn``: a small ResNet-style CNN (Conv2D + BatchNorm + ReLU, three residual stages),
  trained two epochs with Adam on random data and exported with ``model.export`` (Keras'
  way to a SavedModel: it stores every variable twice);
* ``mlp_adam``: a ``tf.Module`` holding three dense layers and the Adam optimizer that
  trained them one step, saved with ``tf.saved_model.save`` and a serving signature (the
  bundle carries Adam's slots and step counter beside the weights).

For each model and each mode of :func:`modelsize.slimming.graph.tf_savedmodel.slim_saved_model`
(default prune-to-signatures, ``freeze``, ``to="tflite"`` plain and with each ``quantize``)
it records the output's bytes, the median wall time of ``--repeats`` runs (TensorFlow already
imported; the source loaded by each run) and the max relative output difference the slim
measured. TensorFlow's own ways, run on the same inputs for comparison:

* ``tf.saved_model.save(loaded)``: re-saving the loaded SavedModel as it is;
* ``TFLiteConverter.from_saved_model`` with defaults (what ``to="tflite"`` calls, without the
  verification and atomic write).

Run it with the Python that has TensorFlow, modelsize's source on the path:

    PYTHONPATH=src .venv-tf/bin/python benchmarks/slim_graphs_tf.py
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from _results import write_section

MODES: list[tuple[str, dict[str, Any]]] = [
    ("prune-to-signatures", {}),
    ("freeze", {"freeze": True}),
    ("tflite", {"to": "tflite"}),
    ("tflite dynamic", {"to": "tflite", "quantize": "dynamic"}),
    ("tflite float16", {"to": "tflite", "quantize": "float16"}),
    ("tflite int8", {"to": "tflite", "quantize": "int8"}),
]


def build(folder: Path) -> dict[str, str]:
    """Write the two SavedModels under ``folder``; a description of each."""
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    inp = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(inp)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    for width in (32, 64, 128):
        shortcut = x if x.shape[-1] == width else keras.layers.Conv2D(width, 1)(x)
        y = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(x)
        y = keras.layers.ReLU()(keras.layers.BatchNormalization()(y))
        y = keras.layers.Conv2D(width, 3, padding="same")(y)
        y = keras.layers.BatchNormalization()(y)
        x = keras.layers.ReLU()(keras.layers.Add()([shortcut, y]))
        x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    out = keras.layers.Dense(10)(x)
    model = keras.Model(inp, out)
    model.compile("adam", "mse")
    rng = np.random.default_rng(0)
    model.fit(rng.standard_normal((32, 32, 32, 3)).astype("float32"),
              rng.standard_normal((32, 10)).astype("float32"), epochs=2, verbose=0)
    model.export(str(folder / "resnet_bn"), verbose=False)
    params = sum(int(np.prod(v.shape)) for v in model.weights)
    batchnorms = sum(isinstance(la, keras.layers.BatchNormalization) for la in model.layers)

    class MLP(tf.Module):
        def __init__(self) -> None:
            sizes = [256, 512, 512, 10]
            self.kernels = [tf.Variable(tf.random.stateless_normal([a, b], seed=[i, 0]) * 0.05)
                            for i, (a, b) in enumerate(itertools.pairwise(sizes))]
            self.biases = [tf.Variable(tf.zeros([b])) for b in sizes[1:]]
            self.optimizer = keras.optimizers.Adam()

        @tf.function(input_signature=[tf.TensorSpec([None, 256], tf.float32, name="x")])
        def serve(self, x: Any) -> Any:
            for i, (k, b) in enumerate(zip(self.kernels, self.biases, strict=True)):
                x = tf.matmul(x, k) + b
                x = tf.nn.relu(x) if i < len(self.kernels) - 1 else x
            return {"logits": x}

    mlp = MLP()
    variables = mlp.kernels + mlp.biases
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(mlp.serve(tf.ones([4, 256]))["logits"] ** 2)
    mlp.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
    tf.saved_model.save(mlp, str(folder / "mlp_adam"),
                        signatures={"serving_default": mlp.serve})
    mlp_params = sum(int(np.prod(v.shape)) for v in variables)
    return {
        "resnet_bn": f"Keras ResNet-style CNN, {params:,} values ({batchnorms} BatchNorms), "
                     "model.export",
        "mlp_adam": f"tf.Module MLP 256-512-512-10 ({mlp_params:,} values) holding its Adam, "
                    "tf.saved_model.save",
    }


def tree_bytes(path: Path) -> int:
    """Bytes of a file, or of every file under a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def batchnorm_ops(path: Path) -> int:
    """Ops of an unfolded inference BatchNorm (Mul, Rsqrt, FusedBatchNorm*) in a SavedModel."""
    from tensorflow.core.protobuf import saved_model_pb2

    sm = saved_model_pb2.SavedModel()
    sm.ParseFromString((path / "saved_model.pb").read_bytes())
    graph = sm.meta_graphs[0].graph_def
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    return sum(n.op in ("Mul", "Rsqrt") or n.op.startswith("FusedBatchNorm") for n in nodes)


def peers(src: Path, work: Path, repeats: int) -> list[tuple[str, int, float]]:
    """TensorFlow's own ways: (name, bytes, median seconds)."""
    import tensorflow as tf

    rows = []
    times, size = [], 0
    for i in range(repeats):
        out = work / f"resave{i}"
        t = time.perf_counter()
        tf.saved_model.save(tf.saved_model.load(str(src)), str(out))
        times.append(time.perf_counter() - t)
        size = tree_bytes(out)
    rows.append(("tf.saved_model.save(loaded)", size, statistics.median(times)))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        flat = tf.lite.TFLiteConverter.from_saved_model(str(src)).convert()
        times.append(time.perf_counter() - t)
    rows.append(("TFLiteConverter defaults", len(flat), statistics.median(times)))
    return rows


def main() -> None:
    """Build, slim every way, write the RESULTS.md section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import tensorflow as tf

    from modelsize.slimming.graph.tf_savedmodel import slim_saved_model

    lines = [
        "## slim of TensorFlow SavedModels (`benchmarks/slim_graphs_tf.py`)",
        "",
        f"TensorFlow {tf.__version__}, {platform.machine()}, Python "
        f"{platform.python_version()}; median of {args.repeats} runs, TensorFlow already "
        "imported. max rel: the largest max |a - b| / max |a| over the outputs, on seeded "
        "random inputs (the slim's own verification).",
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        described = build(root)
        for name, text in described.items():
            src = root / name
            before = tree_bytes(src)
            lines += [f"### {name}: {text}", "", f"source: {before:,} bytes", "",
                      "| mode | bytes after | saved | seconds | max rel |",
                      "|---|---:|---:|---:|---:|"]
            bn_note = ""
            for mode, kwargs in MODES:
                times, result = [], None
                for i in range(args.repeats):
                    suffix = ".tflite" if kwargs.get("to") == "tflite" else ""
                    out = root / "out" / f"{name}-{mode.replace(' ', '-')}-{i}{suffix}"
                    out.parent.mkdir(exist_ok=True)
                    t = time.perf_counter()
                    result = slim_saved_model(src, out, **kwargs)
                    times.append(time.perf_counter() - t)
                assert result is not None and result.bytes_after is not None
                worst = result.worst
                saved = 1 - result.bytes_after / before
                lines.append(
                    f"| {mode} | {result.bytes_after:,} | {saved:.0%} | "
                    f"{statistics.median(times):.2f} | "
                    f"{worst.max_rel if worst else 0:.2e} |"
                )
                if mode == "freeze":
                    bn_note = (f"freeze: Mul, Rsqrt and FusedBatchNorm ops in saved_model.pb "
                               f"(its functions included): {batchnorm_ops(src)} in the source, "
                               f"{batchnorm_ops(out)} in the output.")
                print(name, mode, result.bytes_after, f"{statistics.median(times):.2f}s",
                      worst.max_rel if worst else 0, result.notes, flush=True)
            for peer, size, seconds in peers(src, root / "peer" / name, args.repeats):
                lines.append(f"| peer: {peer} | {size:,} | {1 - size / before:.0%} | "
                             f"{seconds:.2f} | - |")
            lines += ["", bn_note, ""]
    load = os.getloadavg()
    lines.append(f"Load average while measuring (1/5/15 min): {load[0]:.1f}/{load[1]:.1f}/"
                 f"{load[2]:.1f} on {os.cpu_count()} cores shared with other jobs.")
    write_section("slim_graphs_tf", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
