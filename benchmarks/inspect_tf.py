"""Inspect speed and memory on TensorFlow and Keras files: modelsize vs the frameworks' own ways.

Builds, with real TensorFlow and Keras 3, a stack of ``Dense(2048)`` layers trained for one
Adam step, saved two ways: a TF2 object-based checkpoint (``tf.train.Checkpoint(model=,
optimizer=).write``) and a ``.keras`` archive (``model.save``), each holding the weights and
twice as much optimizer state. Then it measures, each in a fresh subprocess: wall time of the
operation, wall time of the whole process (interpreter start and imports included) and peak
RSS (ru_maxrss), for

* ``modelsize inspect --json``     (run by this interpreter, which has no TensorFlow)
* ``tf.train.list_variables``       on the checkpoint (names and shapes, no bytes)
* ``keras.models.load_model``       on the ``.keras`` archive

TensorFlow and Keras are not modelsize dependencies: they run from ``--framework-python``, an
interpreter that has them. Page cache and bytecode caches are warm for every run (one
unmeasured run of each way first).

    python -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install tensorflow-cpu
    .venv/bin/python benchmarks/inspect_tf.py --framework-python /tmp/tfvenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import write_section

_BUILD = r"""
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, tensorflow as tf, keras
folder, layers = sys.argv[1], int(sys.argv[2])
d = 2048
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((d,))] + [keras.layers.Dense(d) for _ in range(layers)])
model.compile(optimizer="adam", loss="mse")
rng = np.random.default_rng(0)
model.fit(rng.random((8, d), dtype=np.float32), rng.random((8, d), dtype=np.float32),
          epochs=1, verbose=0)
model.save(os.path.join(folder, "bench.keras"))
tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
    os.path.join(folder, "ckpt", "bench"))
weights = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
print(weights, len(model.trainable_variables), tf.__version__, keras.__version__)
"""

_MEASURE = r"""
import contextlib, io, json, os, resource, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
t0 = time.perf_counter()
which, path = sys.argv[1], sys.argv[2]
if which == "modelsize":
    from modelsize.cli import main
    t1 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = main(["inspect", path, "--json"])
    assert rc == 0
    result = json.loads(out.getvalue())
    detail = {"tensors": result["tensor_count"], "categories": result["bytes_by_category"]}
elif which == "tf.train.list_variables":
    import tensorflow as tf
    t1 = time.perf_counter()
    listing = tf.train.list_variables(path)
    detail = {"tensors": len(listing)}
else:
    import keras
    t1 = time.perf_counter()
    model = keras.models.load_model(path)
    detail = {"tensors": len(model.weights)}
t2 = time.perf_counter()
print(json.dumps({"op_s": t2 - t1, "import_s": t1 - t0,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "detail": detail}))
"""


#: Measured processes may cache bytecode, as any installed package does.
_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def measure(python: str, which: str, path: Path) -> dict[str, object]:
    """One fresh process: operation time, whole-process wall time, peak RSS."""
    t0 = time.perf_counter()
    proc = subprocess.run([python, "-c", _MEASURE, which, str(path)],
                          capture_output=True, text=True, check=True, env=_ENV)
    wall = time.perf_counter() - t0
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_s"] = wall
    return out


def _median(runs: list[dict[str, object]]) -> dict[str, object]:
    return {
        "op_s": statistics.median(float(r["op_s"]) for r in runs),  # type: ignore[arg-type]
        "process_s": statistics.median(float(r["process_s"]) for r in runs),  # type: ignore[arg-type]
        "rss_mb": max(float(r["rss_mb"]) for r in runs),  # type: ignore[arg-type]
        "detail": runs[0]["detail"],
    }


def _warm(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb") as fh:
            while fh.read(1 << 24):
                pass


def bench(fw_python: str, folder: Path, layers: int, repeat: int) -> list[dict[str, object]]:
    """Build both files and time every way on them."""
    t0 = time.perf_counter()
    built = subprocess.run([fw_python, "-c", _BUILD, str(folder), str(layers)],
                           capture_output=True, text=True, check=True).stdout.split()
    weights, n_vars, tf_version, keras_version = int(built[0]), int(built[1]), built[2], built[3]
    print(f"built files in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    targets = (
        ("TF2 checkpoint", folder / "ckpt" / "bench", "tf.train.list_variables",
         f"tensorflow {tf_version}"),
        (".keras", folder / "bench.keras", "keras.models.load_model", f"keras {keras_version}"),
    )
    for label, path, way, lib in targets:
        files = sorted(path.parent.glob(path.name + "*")) if label.startswith("TF2") else [path]
        size = sum(f.stat().st_size for f in files)
        _warm(files)
        for python, which in ((sys.executable, "modelsize"), (fw_python, way)):
            measure(python, which, path)  # warm-up: page cache and bytecode caches
        ms = _median([measure(sys.executable, "modelsize", path) for _ in range(repeat)])
        fw = _median([measure(fw_python, way, path) for _ in range(repeat)])
        detail = ms["detail"]
        assert isinstance(detail, dict)
        cats = detail["categories"]
        assert sum(cats.values()) == size, (cats, size)
        assert cats["weights"] == weights, (cats["weights"], weights)
        assert cats["optimizer_state"] >= 2 * weights
        rows.append({"file": label, "bytes": size, "way": way, "lib": lib, "vars": n_vars,
                     "categories": cats, "modelsize": ms, "framework": fw})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def render(rows: list[dict[str, object]], repeat: int, argv: str) -> str:
    """The RESULTS.md section."""
    lines = [
        "## inspect speed on TensorFlow and Keras: modelsize inspect vs the frameworks",
        "",
        "Files built by TensorFlow/Keras 3 (a stack of `Dense(2048)` layers after one Adam step; "
        f"see the script's docstring); warm page cache; median of {repeat} fresh processes, peak "
        f"RSS is the max. Machine: {platform.machine()}, Python {platform.python_version()}, "
        "shared CPU (timings are noisy to ~20%).",
        "",
        "| file | size | way | operation (s) | whole process (s) | peak RSS (MB) |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        for label, key in (("`modelsize inspect --json`", "modelsize"),
                           (f"`{r['way']}` ({r['lib']})", "framework")):
            m = r[key]
            assert isinstance(m, dict)
            lines.append(
                f"| {r['file']} | {int(r['bytes']) / 1e6:,.0f} MB | {label} "  # type: ignore[call-overload]
                f"| {m['op_s']:.3f} | {m['process_s']:.2f} | {m['rss_mb']:.0f} |"
            )
    lines += ["", "Ratios (framework / modelsize):", ""]
    for r in rows:
        ms, fw = r["modelsize"], r["framework"]
        assert isinstance(ms, dict) and isinstance(fw, dict)
        cats = r["categories"]
        assert isinstance(cats, dict)
        lines.append(
            f"- {r['file']}, {int(r['bytes']) / 1e6:,.0f} MB: whole process "  # type: ignore[call-overload]
            f"**{fw['process_s'] / ms['process_s']:.0f}x** faster (operation alone "
            f"{fw['op_s']:.3f} s vs {ms['op_s']:.3f} s), peak RSS "
            f"**{fw['rss_mb'] / ms['rss_mb']:.1f}x** "
            f"less. modelsize says: weights {cats['weights']:,} B, optimizer_state "
            f"{cats['optimizer_state']:,} B, metadata {cats['metadata']:,} B, graph "
            f"{cats['graph']:,} B."
        )
    lines += [
        "",
        "`tf.train.list_variables` gives names and shapes only (no bytes, no categories); its "
        "cost is the TensorFlow import. `load_model` also allocates every variable. modelsize "
        "reads the bundle index (a sorted table) or the HDF5 metadata inside the zip in place, "
        "so its time and memory do not grow with the tensor data.",
        "",
        f"Reproduce: `{argv}`",
    ]
    return "\n".join(lines)


def main() -> None:
    """Build, measure, print, and write the ``inspect_tf`` section of RESULTS.md."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--framework-python", default=sys.executable,
                    help="an interpreter with tensorflow and keras installed")
    ap.add_argument("--layers", type=int, default=4,
                    help="Dense(2048) layers: 16.8 MB of weights each, three times that saved")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to build the files (default: a temp dir)")
    ap.add_argument("--no-write", action="store_true", help="print, do not update RESULTS.md")
    args = ap.parse_args()
    probe = subprocess.run([args.framework_python, "-c", "import tensorflow, keras"],
                           capture_output=True)
    if probe.returncode:
        print(f"nothing measured: {args.framework_python} cannot import tensorflow and keras")
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = bench(args.framework_python, Path(tmp), args.layers, args.repeat)
    argv = ".venv/bin/python benchmarks/inspect_tf.py --framework-python /tmp/tfvenv/bin/python"
    if args.layers != 4:
        argv += f" --layers {args.layers}"
    text = render(rows, args.repeat, argv)
    print(text)
    if not args.no_write:
        write_section("inspect_tf", text)


if __name__ == "__main__":
    main()
