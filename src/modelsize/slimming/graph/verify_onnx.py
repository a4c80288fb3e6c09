"""The original and the slimmed model run by onnxruntime on the same seeded random inputs.

Inputs: floats from a standard normal, integers in ``[0, 2)`` (valid token ids, indices and
lengths for any vocabulary), booleans at random; a dimension without a fixed size is 1 unless
``dims`` names it. When onnxruntime cannot run the original on those (a reflect pad wants
more than one sample; a branch wants a sample rate it knows), the free dimensions are made
longer (:data:`FREE_SIZES`), and an integer input the graph compares with a constant
(silero-vad's ``sr == 16000``) is also given that constant; the first inputs the original runs
on are used for both models. Per output the report gives the largest absolute difference and
the largest *relative* difference, which is that absolute difference divided by the largest
magnitude of
the original's output (elementwise ratios are meaningless next to zeros). The slim fails when
a relative difference exceeds the tolerance: :data:`TOLERANCES` per kind of pass, overridable.
"""

from __future__ import annotations

from collections.abc import Iterator
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


#: Sizes tried, in order, for the dimensions without one until the original runs.
FREE_SIZES = (1, 64, 512)
#: The most elements one made-up input may have: larger free sizes are not tried.
MAX_ELEMENTS = 1 << 24
#: Comparisons whose constant operand is a value an integer input is meant to take.
_COMPARISONS = frozenset({"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"})


def random_inputs(session: Any, seed: int = SEED, dims: dict[str, int] | None = None,
                  free: int = 1) -> dict[str, np.ndarray]:
    """Seeded inputs for every input of an onnxruntime session; ``free``: the size of a
    dimension neither fixed nor named in ``dims``."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for arg in session.get_inputs():
        dtype = _NUMPY.get(arg.type)
        if dtype is None:
            raise ValueError(f"input {arg.name!r} has type {arg.type}, which verification "
                             "cannot make up")
        shape = [d if isinstance(d, int) and d >= 0 else (dims or {}).get(str(d), free)
                 for d in arg.shape]
        if np.issubdtype(dtype, np.floating):
            feeds[arg.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype is np.bool_:
            feeds[arg.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[arg.name] = rng.integers(0, 2, shape).astype(dtype)
    return feeds


def compared_constants(path: Path) -> dict[str, list[int]]:
    """Integer scalars the main graph compares each of its inputs with (``Equal(sr, 16000)``),
    read from the model's structure (not its external data)."""
    import onnx

    from modelsize.slimming.graph.onnx_passes import Values, constants

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    inputs = {i.name for i in graph.input}
    scalars = {name: int(onnx.numpy_helper.to_array(t).reshape(()))
               for name, t in constants(graph, Values(model, path.parent)).items()
               if not t.data_location and np.prod(t.dims, dtype=np.int64) == 1
               and t.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32)}
    found: dict[str, list[int]] = {}
    for node in graph.node:
        if node.op_type in _COMPARISONS and len(node.input) == 2:
            for a, b in (node.input, node.input[::-1]):
                if a in inputs and b in scalars and scalars[b] not in found.get(a, []):
                    found.setdefault(a, []).append(scalars[b])
    return found


def candidate_inputs(session: Any, path: Path,
                     seed: int = SEED) -> Iterator[tuple[dict[str, np.ndarray], str]]:
    """Inputs to try, in order, each with how it was made ("" for the default rule)."""
    try:
        compared = compared_constants(path)
    except Exception:  # no structure to read: the made-up inputs alone
        compared = {}
    for free in FREE_SIZES:
        feeds = random_inputs(session, seed, free=free)
        if max((v.size for v in feeds.values()), default=0) > MAX_ELEMENTS:
            return
        how = "" if free == 1 else f"free dimensions {free}"
        yield feeds, how
        for name, values in compared.items():
            for value in values:
                given = {**feeds, name: np.full_like(feeds[name], value)}
                yield given, ", ".join(filter(None, [how, f"{name} = {value}"]))


def session(path: Path) -> Any:
    """An onnxruntime CPU session for the model at ``path`` (external data beside it)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 4  # a failed run is reported once, by modelsize
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def compare(original: Path, slimmed: Path, kind: str, tolerance: float | None = None,
            seed: int = SEED) -> Comparison:
    """Run both models on the same inputs; differences per output of the original."""
    def refuse(exc: Exception) -> UsageError:
        # onnxruntime's own exception types: the input is at fault
        return UsageError(f"{printable(str(original))}: onnxruntime cannot run it to verify "
                          f"the slimmed model ({printable(str(exc), 200)}); --no-graph slims "
                          "without running it")

    try:
        a = session(original)
        names = [o.name for o in a.get_outputs()]
        first: Exception | None = None
        for feeds, made in candidate_inputs(a, original, seed):
            try:
                want = a.run(names, feeds)
            except Exception as exc:
                first = first or exc
                continue
            how = made
            break
        else:
            raise refuse(first or ValueError("no inputs to try"))
    except UsageError:
        raise
    except Exception as exc:
        raise refuse(exc) from exc
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
    return Comparison(tuple(diffs), tol, kind, inputs=how)
