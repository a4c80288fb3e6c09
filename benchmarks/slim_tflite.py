"""``modelsize slim --cast float16`` of TFLite models vs TensorFlow's own float16 quantization.

Builds, with real TensorFlow and Keras 3, two models and converts each to a float32 TFLite file
(``TFLiteConverter.from_keras_model``, defaults):

* ``cnn_bn``: a small CNN (Conv2D + BatchNorm + ReLU, a depthwise convolution, two dense
  layers) at 32x32x3, BatchNorm statistics set from a seeded batch;
* ``mobilenet_v2``: ``keras.applications.MobileNetV2(weights=None)`` at 224x224x3, width 1.0
  (random init, nothing downloaded), its logits (``classifier_activation=None``: the softmax
  of a random-init model is flat to float32 rounding, which would hide any difference).

For each, the rows compare the float32 file, what ``modelsize slim --cast float16`` writes from
it (float16 buffers behind DEQUANTIZE operators), and the peer: the same Keras model converted
again by TensorFlow with ``optimizations=[DEFAULT]`` and ``target_spec.supported_types=
[float16]`` (TensorFlow's documented float16 post-training quantization; it needs the source
model, modelsize needs only the ``.tflite``). Each file is run by ``tf.lite.Interpreter`` on
``--seeds`` seeded input batches; "max rel" is max |y - y32| / max |y32| against the float32
file's output, the worst over the batches; "vs TF f16" is the largest |y - y_tf16| between
modelsize's output and the peer's. The slim time is the median of ``--repeats`` runs of
``modelsize.slim`` (read, plan, write, verify), TensorFlow imported.

Run it with the Python that has TensorFlow, modelsize's source on the path:

    PYTHONPATH=src .venv-tf/bin/python benchmarks/slim_tflite.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from _results import write_section  # type: ignore[import-not-found]


def _models(tf: Any) -> dict[str, tuple[str, Any]]:
    keras = tf.keras
    keras.utils.set_random_seed(0)
    inp = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(32, 3, padding="same")(inp)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.DepthwiseConv2D(3, padding="same")(x)
    x = keras.layers.Conv2D(64, 1)(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(128, activation="relu")(x)
    cnn = keras.Model(inp, keras.layers.Dense(10)(x))
    batch = np.random.default_rng(0).standard_normal((8, 32, 32, 3)).astype("f4")
    for layer in cnn.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            acts = keras.Model(cnn.input, layer.input)(batch).numpy()
            gamma, beta, _, _ = layer.get_weights()
            layer.set_weights([gamma, beta, acts.mean((0, 1, 2)), acts.var((0, 1, 2)) + 1e-3])
    mobilenet = keras.applications.MobileNetV2(weights=None, input_shape=(224, 224, 3),
                                               classifier_activation=None)
    return {
        "cnn_bn": ("small CNN 32x32x3 (Conv2D+BN+ReLU, depthwise, 2 dense)", cnn),
        "mobilenet_v2": ("keras.applications.MobileNetV2(weights=None), 224x224x3, logits",
                         mobilenet),
    }


def _convert(tf: Any, model: Any, float16: bool) -> bytes:
    c = tf.lite.TFLiteConverter.from_keras_model(model)
    if float16:
        c.optimizations = [tf.lite.Optimize.DEFAULT]
        c.target_spec.supported_types = [tf.float16]
    return bytes(c.convert())


def _outputs(tf: Any, path: Path, seeds: int) -> list[np.ndarray]:
    it = tf.lite.Interpreter(model_path=str(path))
    it.allocate_tensors()
    [inp] = it.get_input_details()
    out = []
    for seed in range(seeds):
        x = np.random.default_rng(seed).standard_normal(inp["shape"]).astype(np.float32)
        it.set_tensor(inp["index"], x)
        it.invoke()
        out.append(it.get_tensor(it.get_output_details()[0]["index"]).astype(np.float64))
    return out


def _max_rel(ys: list[np.ndarray], refs: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(y - r)) / max(float(np.max(np.abs(r))), 1e-30))
               for y, r in zip(ys, refs, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print, do not edit RESULTS.md")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import tensorflow as tf

    import modelsize

    lines = [
        "## slim --cast float16 of TFLite models (`benchmarks/slim_tflite.py`)",
        "",
        "TensorFlow " + tf.__version__ + f"; {args.seeds} seeded batches per model; slim time: "
        f"median of {args.repeats} runs.",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, (what, model) in _models(tf).items():
            f32, tf16, ours = root / f"{name}.tflite", root / f"{name}.tf16.tflite", root / (
                f"{name}.f16.tflite")
            f32.write_bytes(_convert(tf, model, False))
            tf16.write_bytes(_convert(tf, model, True))
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                report = modelsize.slim(f32, ours, cast="float16", force=True)
                times.append(time.perf_counter() - start)
            assert report.verified
            ref = _outputs(tf, f32, args.seeds)
            y_tf, y_ours = _outputs(tf, tf16, args.seeds), _outputs(tf, ours, args.seeds)
            vs_tf = max(float(np.max(np.abs(a - b))) for a, b in zip(y_ours, y_tf, strict=True))
            lines += [
                "", f"### {name}: {what}", "",
                "| file | bytes | max rel vs float32 | vs TF f16 | time |",
                "|---|---:|---:|---:|---:|",
                f"| float32 (converter) | {f32.stat().st_size:,} | - | - | - |",
                f"| TF float16 quantization | {tf16.stat().st_size:,} | "
                f"{_max_rel(y_tf, ref):.2e} | - | - |",
                f"| modelsize slim --cast float16 | {ours.stat().st_size:,} | "
                f"{_max_rel(y_ours, ref):.2e} | {vs_tf:.1e} | "
                f"{statistics.median(times):.2f} s |",
            ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("slim_tflite", text)


if __name__ == "__main__":
    main()
