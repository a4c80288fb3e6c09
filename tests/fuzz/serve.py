"""The fuzz target's worker processes: one JSON request per line on stdin, one answer per line.

``python -m tests.fuzz.serve ROLE`` (from the repository root, modelsize importable):

* ``runner``: runs ``modelsize`` commands in this process, as the CLI does
  (:func:`modelsize.cli.main`), with the process's stdout and stderr (file descriptors 1 and 2)
  sent to a file per command, and measures each command's peak RSS: ``VmHWM`` after writing 5
  to ``/proc/self/clear_refs``, which sets the high-water mark back to the current RSS. The
  peak is the process's, modules imported by earlier commands included, so it can only
  overstate a fresh CLI's (the harness re-runs a case over the limit in a fresh process).
* ``check``: loads a file with its framework in this venv (:data:`LOADERS`).
* ``tf``: the same for TensorFlow's formats (Keras ``load_model``/``load_weights``,
  ``tf.train.load_checkpoint``, ``tf.lite.Interpreter``) in TensorFlow's venv; and writes the
  TFLite seed.

The answers go to a duplicate of the original stdout; everything the frameworks print goes
elsewhere (``/dev/null``, or the command's capture file), so it never corrupts the protocol.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# -- runner ------------------------------------------------------------------------------------


def _status(key: str) -> int:
    """A ``/proc/self/status`` value in bytes (``VmHWM``, ``VmRSS``)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def run_command(argv: list[str], capture: Path) -> dict[str, Any]:
    """``modelsize ARGV`` in this process: exit code, what it printed on stderr, seconds, the
    RSS before and the peak RSS during it."""
    from modelsize.cli import main

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(2)
    with open(capture, "w+b") as fh:
        os.dup2(fh.fileno(), 2)
        base = _status("VmRSS")
        reset = _reset_peak()
        t0 = time.monotonic()
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse's exit
            rc = exc.code if isinstance(exc.code, int) else 2
        except BaseException:  # what escapes main() is the failure
            traceback.print_exc()
            rc = -1
        secs = time.monotonic() - t0
        sys.stdout.flush()
        sys.stderr.flush()
        peak = _status("VmHWM")
        os.dup2(saved, 2)
        os.close(saved)
        fh.seek(0)
        err = fh.read().decode("utf-8", "replace")
    return {"rc": rc, "stderr": err[-4000:], "secs": round(secs, 3), "rss_before": base,
            "peak": peak if reset else max(peak, base), "peak_reset": reset}


def serve_runner(request: dict[str, Any]) -> dict[str, Any]:
    capture = Path(tempfile.gettempdir()) / f"modelsize-fuzz-{os.getpid()}.err"
    out: dict[str, Any] = {}
    for step in ("inspect", "slim", "reread"):
        argv = request.get(step)
        if not argv or (step == "reread" and out.get("slim", {}).get("rc") != 0):
            continue
        out[step] = run_command(argv, capture)
    return out


# -- framework loads (this venv) -----------------------------------------------------------------


def load_torch(path: Path) -> None:
    import torch

    torch.load(path, map_location="cpu", weights_only=True)


def load_safetensors(path: Path) -> None:
    from safetensors import safe_open

    try:
        import torch  # noqa: F401 - bfloat16 and friends need the pt framework
        framework = "pt"
    except ImportError:
        framework = "np"
    with safe_open(str(path), framework) as f:
        for key in f.keys():  # noqa: SIM118 - a safe_open handle, not a dict
            f.get_tensor(key)
        f.metadata()


def load_npz(path: Path) -> None:
    import numpy as np

    loaded = np.load(path, allow_pickle=False)
    if hasattr(loaded, "files"):
        with loaded:
            for name in loaded.files:
                loaded[name]


def load_pickle(path: Path) -> None:
    """A pickle of NumPy arrays, through an unpickler that finds only what such a pickle
    needs (no code from the file runs)."""
    import pickle

    allowed = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray",
                                                            "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar"), ("collections", "OrderedDict")}

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) not in allowed:
                raise pickle.UnpicklingError(f"{module}.{name} is not allowed")
            return super().find_class(module, name)

    with open(path, "rb") as fh:
        Restricted(fh).load()


def load_onnx(path: Path) -> None:
    """The checker on the file, then an onnxruntime session of the model with its external
    data read in (``onnx.load`` reads each external tensor's range; onnxruntime cannot infer
    shapes from a constant that stays external)."""
    import onnx
    import onnxruntime as ort

    onnx.checker.check_model(str(path))
    model = onnx.load(str(path))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def load_gguf(path: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        t.data.tobytes()  # reads every tensor's bytes


def load_t7(path: Path) -> None:
    """``torchfile.load``, taught HalfTensors (torch7's IEEE halves; ``--cast float16`` writes
    them and torchfile has no reader for them)."""
    import numpy as np
    import torchfile

    torchfile.add_tensor_reader(b"torch.HalfTensor", np.float16)
    torchfile.add_storage_reader(b"torch.HalfStorage", np.float16)
    torchfile.load(str(path))


def load_directory(path: Path, original: Path | None = None) -> None:
    """Each file of an output folder that is not its input's file byte for byte, by its
    extension."""
    by_ext: dict[str, Callable[[Path], None]] = {
        ".safetensors": load_safetensors, ".pt": load_torch, ".bin": load_torch,
        ".pth": load_torch, ".json": lambda p: json.loads(p.read_bytes())}
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        twin = original / f.relative_to(path) if original else None
        if twin is not None and twin.is_file() and twin.read_bytes() == f.read_bytes():
            continue
        load = by_ext.get(f.suffix)
        if load is not None:
            try:
                load(f)
            except Exception as exc:
                raise RuntimeError(f"{f.name}: {type(exc).__name__}: {exc}") from exc


LOADERS: dict[str, Callable[[Path], None]] = {
    "torch": load_torch, "safetensors": load_safetensors, "npz": load_npz,
    "pickle": load_pickle, "onnx": load_onnx, "gguf": load_gguf, "t7": load_t7,
}


def serve_check(request: dict[str, Any]) -> dict[str, Any]:
    path = Path(request["path"])
    try:
        if request["loader"] == "directory":
            load_directory(path, Path(request["original"]) if request.get("original") else None)
        else:
            LOADERS[request["loader"]](path)
    except Exception as exc:  # any refusal of the framework is the answer
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    return {"ok": True}


# -- TensorFlow's formats (its venv) ---------------------------------------------------------------


def serve_tf(request: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if "tflite_seed" in request:
        from tests.fuzz.seeds import TFLITE_SEED_CODE

        sys.argv = ["tflite-seed", request["tflite_seed"]]
        exec(compile(TFLITE_SEED_CODE, "tflite_seed", "exec"), {"__name__": "tflite_seed"})
        return {"ok": True}
    import keras
    import tensorflow as tf

    path, loader = request["path"], request["loader"]
    # Keras names a layer whose name is missing from a global counter: without a fresh
    # session each load would see the names the loads before it took (a model loads on a
    # second try that fails in a fresh process, and an output checked after its input
    # answers differently)
    keras.backend.clear_session()
    try:
        if loader == "keras":
            keras.saving.load_model(path, compile=False)
        elif loader == "keras-weights":
            keras.saving.load_model(request["extra"], compile=False).load_weights(path)
        elif loader == "checkpoint":
            # RestoreV2 reads every tensor of every dtype (the Python reader refuses half)
            # and checks each one's CRC, as restoring a model does.
            dtypes = tf.train.load_checkpoint(path).get_variable_to_dtype_map()
            names = sorted(dtypes)
            tf.raw_ops.RestoreV2(prefix=path, tensor_names=names,
                                 shape_and_slices=[""] * len(names),
                                 dtypes=[dtypes[n] for n in names])
        elif loader == "tflite":
            tf.lite.Interpreter(model_path=path).allocate_tensors()
        else:
            raise ValueError(f"no loader {loader}")
    except Exception as exc:  # any refusal of the framework is the answer
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    return {"ok": True}


ROLES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "runner": serve_runner, "check": serve_check, "tf": serve_tf}


def main(role: str) -> None:
    handler = ROLES[role]
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    if role != "runner":
        os.dup2(devnull, 2)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = handler(json.loads(line))
        except Exception as exc:  # the harness sees it as this request's answer
            answer = {"error": f"{type(exc).__name__}: {exc}", "worker_failed": True}
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
