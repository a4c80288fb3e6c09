"""The original and the slimmed model run by onnxruntime on the same seeded random inputs.

Inputs: floats from a standard normal, integers in ``[0, 2)`` (valid token ids, indices and
lengths for any vocabulary), booleans at random; a dimension without a fixed size is 1 unless
``dims`` names it. Per output the report gives the largest absolute difference and the largest
*relative* difference, which is that absolute difference divided by the largest magnitude of
the original's output (elementwise ratios are meaningless next to zeros). The slim fails when
a relative difference exceeds the tolerance: :data:`TOLERANCES` per kind of pass, overridable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from modelsize.errors import UsageError, VerificationError, printable
from modelsize.slimming.graph.report import Comparison, OutputDiff

#: Largest relative output difference accepted, by the most approximate pass applied.
TOLERANCES: dict[str, float] = {
    "exact": 1e-5,        # folding and removal: float rounding only
    "cast-float16": 1e-2,  # float16 weights: about 2**-11 per weight, accumulated
    "quantize-int8": 1e-1,  # weight-only int8, per channel
    "quantize-dynamic": 2e-1,  # int8 weights and activations quantized at run time
}
SEED = 0


_NUMPY = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_, "tensor(int16)": np.int16,
}


def random_inputs(session: Any, seed: int = SEED,
                  dims: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Seeded inputs for every input of an onnxruntime session."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for arg in session.get_inputs():
        dtype = _NUMPY.get(arg.type)
        if dtype is None:
            raise ValueError(f"input {arg.name!r} has type {arg.type}, which verification "
                             "cannot make up")
        shape = [d if isinstance(d, int) and d >= 0 else (dims or {}).get(str(d), 1)
                 for d in arg.shape]
        if np.issubdtype(dtype, np.floating):
            feeds[arg.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype is np.bool_:
            feeds[arg.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[arg.name] = rng.integers(0, 2, shape).astype(dtype)
    return feeds


def session(path: Path) -> Any:
    """An onnxruntime CPU session for the model at ``path`` (external data beside it)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def compare(original: Path, slimmed: Path, kind: str, tolerance: float | None = None,
            seed: int = SEED) -> Comparison:
    """Run both models on the same inputs; differences per output of the original."""
    try:
        a = session(original)
        feeds = random_inputs(a, seed)
    except Exception as exc:  # onnxruntime's own exception types: the input is at fault
        raise UsageError(f"{printable(str(original))}: onnxruntime cannot run it to verify "
                         f"the slimmed model ({printable(str(exc), 200)}); --no-graph slims "
                         "without running it") from exc
    names = [o.name for o in a.get_outputs()]
    want = a.run(names, feeds)
    del a  # one model in memory at a time
    try:
        b = session(slimmed)
    except Exception as exc:
        raise VerificationError(f"the slimmed model does not load in onnxruntime "
                                f"({printable(str(exc), 200)}); nothing was written "
                                "(a modelsize bug: please report it)") from exc
    b_inputs = {i.name for i in b.get_inputs()}
    got = b.run(names, {k: v for k, v in feeds.items() if k in b_inputs})
    diffs = []
    for name, x, y in zip(names, want, got, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape:
            diffs.append(OutputDiff(name, float("inf"), float("inf")))
            continue
        if x.dtype.kind in "fc" or y.dtype.kind in "fc":
            xf, yf = x.astype(np.float64), y.astype(np.float64)
            diff = np.abs(xf - yf)
            both_nan = np.isnan(xf) & np.isnan(yf)
            diff = np.where(both_nan, 0.0, diff)
            max_abs = float(np.max(diff, initial=0.0))
            scale = float(np.max(np.abs(np.nan_to_num(xf)), initial=0.0))
            max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
        else:
            same = bool(np.array_equal(x, y))
            max_abs = 0.0 if same else float(np.max(np.abs(x.astype(np.float64)
                                                           - y.astype(np.float64))))
            max_rel = 0.0 if same else float("inf")
        diffs.append(OutputDiff(name, max_abs, max_rel))
    tol = TOLERANCES[kind] if tolerance is None else tolerance
    return Comparison(tuple(diffs), tol, kind)
