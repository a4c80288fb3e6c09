"""Slimming a TensorFlow SavedModel: keep what its serving signatures compute, check by running.

Unlike the checkpoint writers, this needs TensorFlow (``pip install 'modelsize[tf]'``): a
SavedModel's signatures are graphs, and only TensorFlow can say which variables they read and
run them. TensorFlow is imported inside :func:`slim_saved_model`; without it the call raises
:class:`~modelsize.errors.MissingDependencyError` (one line, exit 2).

Modes (:func:`slim_saved_model`):

* default, ``prune-to-signatures``: a new root object that tracks only the variables the
  signatures capture, saved with those signatures. Everything else the source's object graph
  held goes: optimizer slots and step counters of a module that kept its optimizer, Keras
  metrics, a second copy of each variable (``model.export()`` saves every variable twice).
  Exact: the very same functions run on the very same values.
* ``freeze``: each signature's variables become constants
  (``convert_variables_to_constants_v2``); grappler's ``constfold`` computes each inference
  BatchNorm's ``scale = gamma / sqrt(var + eps)`` and ``shift`` (and itself merges the scale
  into a bias-free ``Conv2D``); ``fold-batchnorm`` folds the ``(W x [+ b]) * scale [+ shift]``
  left after a ``Conv2D``, ``DepthwiseConv2dNative`` or ``MatMul`` into new weights and a
  bias (the shift is gone when it is zero, as in a fresh BatchNorm; only when nothing else
  reads the intermediate results; before grappler's ``arithmetic`` regroups the adds of a
  residual around it); then grappler's ``pruning``,
  ``constfold``, ``arithmetic`` and ``dependency`` (Identity removal, folding, pruning to the
  signature's outputs). Grappler's ``remap`` is not run: it writes CPU-only ``_Fused*`` ops
  into the saved graph. Signatures with identical frozen graphs share one function. Exact up
  to float rounding. The constants live in ``saved_model.pb`` (protobuf's 2 GiB limit).
* ``to="tflite"``: TensorFlow's own converter on the source (``quantize``: ``dynamic``
  int8 weights, ``float16`` weights, or ``int8`` full-integer kernels with float inputs and
  outputs, calibrated on the same seeded random inputs the verification uses).

Verification runs the source's signatures and the output's (the SavedModel's signatures, or
the TFLite interpreter's signature runners) on the same seeded random inputs (float: standard
normal; integer: 0..9; bool: random; dimensions unknown in the signature: 2 for the first,
8 for the others) and reports, per output, ``max_abs`` = max |a - b| and ``max_rel`` =
max_abs / max |a| (relative to the output's scale, so that outputs near zero do not make it
meaningless). The output is committed only when every ``max_rel`` is within the tolerance
(:data:`TOLERANCES`, overridable); otherwise :class:`OutputMismatchError` (exit 1) and
nothing is written. Known limitations: string inputs are refused (no inputs to make up);
``int8`` calibration on random inputs measures the error on random inputs only.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
import warnings
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from modelsize import formats
from modelsize.categories import Category
from modelsize.errors import (
    CorruptFileError,
    MissingDependencyError,
    PathNotFoundError,
    UnknownFormatError,
    UsageError,
    VerificationError,
    printable,
)
from modelsize.formats.base import real_path
from modelsize.inventory import Inventory
from modelsize.slimming.graph.report import Comparison, GraphSlimReport
from modelsize.slimming.graph.report import OutputDiff as NamedDiff
from modelsize.slimming.output import Output, staged
from modelsize.slimming.plan import SlimOptions
from modelsize.slimming.result import Dropped, KeptTensor

FORMAT = "tensorflow SavedModel"
#: Seed of the verification (and int8 calibration) inputs.
SEED = 0
#: Calibration samples for ``quantize="int8"``.
CALIBRATION_SAMPLES = 16


class Target(str, Enum):
    """What ``slim_saved_model`` writes."""

    SAVED_MODEL = "saved_model"
    TFLITE = "tflite"


class Quantize(str, Enum):
    """TFLite quantization modes (TensorFlow's converter does the work)."""

    DYNAMIC = "dynamic"
    FLOAT16 = "float16"
    INT8 = "int8"


#: Default bound on ``max_rel`` per mode. The SavedModel passes are exact up to float rounding;
#: TFLite's float kernels reassociate sums; the quantized bounds were measured with margin on
#: the models of benchmarks/slim_graphs_tf.py. ``dynamic`` is ONNX's bound for the same scheme
#: (int8 weights, activations quantized at run time by the hybrid kernels): MobileNetV2 moves
#: by 0.065 to 0.081 there, over the 5e-2 the smaller models allowed.
TOLERANCES: dict[str, float] = {
    "exact": 1e-5,
    "tflite": 1e-4,
    Quantize.FLOAT16.value: 1e-2,
    Quantize.DYNAMIC.value: 2e-1,
    Quantize.INT8.value: 1e-1,
}


class OutputMismatchError(VerificationError):
    """The slimmed model's outputs differ from the source's by more than the tolerance."""


@dataclass(frozen=True)
class OutputDiff:
    """How far one output of one signature moved: ``max_abs`` and ``max_abs / max|source|``."""

    signature: str
    output: str
    max_abs: float
    max_rel: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"signature": self.signature, "output": self.output,
                "max_abs": self.max_abs, "max_rel": self.max_rel}


@dataclass(frozen=True)
class GraphSlimResult:
    """What a SavedModel slim did: passes, bytes before and after, and the measured outputs.

    ``bytes_*`` are the sizes of every file of the source and output; ``source_inventory`` and
    ``output_inventory`` are modelsize's own reading of them (the output's is ``None`` for a
    TFLite file, which modelsize does not read, and after a dry run). ``kept`` are the
    checkpoint keys, in the source, of the variables the signatures capture (frozen into
    constants by ``freeze``); ``dropped`` the source's other tensors.
    """

    source: Path
    target: Path
    output_format: str
    passes: tuple[str, ...]
    signatures: tuple[str, ...]
    source_inventory: Inventory
    output_inventory: Inventory | None
    kept: tuple[str, ...]
    dropped: tuple[str, ...]
    diffs: tuple[OutputDiff, ...]
    tolerance: float
    verified: bool
    dry_run: bool
    seconds: float
    bytes_after: int | None = None
    notes: tuple[str, ...] = field(default=())
    folded_batchnorms: int = 0

    @property
    def bytes_before(self) -> int:
        """Bytes of every file of the source."""
        return self.source_inventory.file_bytes

    @property
    def categories_before(self) -> dict[Category, int]:
        """The source's bytes by category."""
        return dict(self.source_inventory.bytes_by_category)

    @property
    def categories_after(self) -> dict[Category, int] | None:
        """The output's bytes by category (``None`` for TFLite and dry runs)."""
        inv = self.output_inventory
        return None if inv is None else dict(inv.bytes_by_category)

    @property
    def worst(self) -> OutputDiff | None:
        """The output that moved most (relative), if any was measured."""
        return max(self.diffs, key=lambda d: d.max_rel, default=None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        def cats(c: dict[Category, int] | None) -> dict[str, int] | None:
            return None if c is None else {k.value: v for k, v in c.items()}

        return {
            "source": str(self.source), "target": str(self.target),
            "output_format": self.output_format, "passes": list(self.passes),
            "signatures": list(self.signatures), "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after, "categories_before": cats(self.categories_before),
            "categories_after": cats(self.categories_after),
            "kept": list(self.kept), "dropped": list(self.dropped),
            "diffs": [d.to_dict() for d in self.diffs], "tolerance": self.tolerance,
            "verified": self.verified, "dry_run": self.dry_run, "seconds": self.seconds,
            "notes": list(self.notes), "folded_batchnorms": self.folded_batchnorms,
        }


def is_saved_model(path: Path) -> bool:
    """A directory holding ``saved_model.pb`` (how ``slim`` routes its input here)."""
    return path.is_dir() and (path / "saved_model.pb").is_file()


def tolerance_for(to: Target, quantize: Quantize | None) -> float:
    """The default bound on ``max_rel`` for a mode (see :data:`TOLERANCES`)."""
    if quantize is not None:
        return TOLERANCES[quantize.value]
    return TOLERANCES["tflite" if to is Target.TFLITE else "exact"]


def slim_saved_model(
    src: Path,
    out: Path,
    *,
    freeze: bool = False,
    to: str | None = None,
    quantize: str | None = None,
    tolerance: float | None = None,
    force: bool = False,
    dry_run: bool = False,
) -> GraphSlimResult:
    """Write ``out``: the SavedModel ``src`` reduced to its serving signatures, checked by running.

    ``to="tflite"`` writes a TFLite file instead (``quantize``: ``dynamic``, ``float16`` or
    ``int8``); ``freeze`` turns variables into constants and optimizes the graph. ``src`` is
    never written; ``out`` appears only once verified (an existing one needs ``force``).
    Raises :class:`~modelsize.errors.InputError` for bad arguments or input,
    :class:`MissingDependencyError` without TensorFlow, :class:`OutputMismatchError` when the
    outputs moved more than ``tolerance``.
    """
    started = time.perf_counter()
    src, out = Path(src), Path(out)
    target = _target(to)
    mode = _quantize(quantize)
    if mode is not None and target is not Target.TFLITE:
        raise UsageError("--quantize on a SavedModel needs --to tflite")
    if freeze and target is Target.TFLITE:
        raise UsageError("--freeze and --to tflite do not combine (the converter freezes)")
    if tolerance is not None and not tolerance >= 0:
        raise UsageError(f"--tolerance must be a number >= 0, got {tolerance}")
    bound = tolerance_for(target, mode) if tolerance is None else tolerance
    source_inventory = _check_source(src)
    output = Output(out, directory=target is Target.SAVED_MODEL, force=force, inputs=(src,))
    output.check([] if target is Target.SAVED_MODEL else [out.name])
    tf = _import_tensorflow(src)

    with contextlib.ExitStack() as stack:
        return _slim(tf, src, out, stack, output=output, source_inventory=source_inventory,
                     freeze=freeze, target=target, mode=mode, bound=bound, dry_run=dry_run,
                     started=started)


def _slim(tf: Any, src: Path, out: Path, stack: contextlib.ExitStack, *, output: Output,
          source_inventory: Inventory, freeze: bool, target: Target, mode: Quantize | None,
          bound: float, dry_run: bool, started: float) -> GraphSlimResult:
    loaded, readable = _load_source(tf, src, stack)
    notes: list[str] = []
    if readable != src:
        notes.append("TensorFlow cannot revive this SavedModel's optimizer (saved by Keras 2: "
                     "its slot variables need Optimizer.add_slot); read without the links "
                     "from the optimizer to its slots, which are dropped anyway")
    signatures = dict(loaded.signatures)
    if not signatures:
        raise UsageError(f"{printable(str(src))}: the SavedModel has no signatures; nothing "
                         "to serve, so nothing to keep")
    variables = _captured_variables(signatures)
    keys = _checkpoint_keys(tf, loaded)
    kept = tuple(keys.get(id(v), v.name) for v in variables)
    kept_set = set(kept)
    dropped = tuple(t.name for t in source_inventory.tensors
                    if t.name not in kept_set and t.category is not Category.METADATA)
    passes = _passes(freeze, target, mode)
    common: dict[str, Any] = dict(
        source=src, target=out, output_format=target.value, passes=passes,
        signatures=tuple(signatures), source_inventory=source_inventory, kept=kept,
        dropped=dropped, tolerance=bound,
    )
    if dry_run:
        return GraphSlimResult(**common, output_inventory=None, diffs=(), verified=False,
                               dry_run=True, seconds=time.perf_counter() - started)

    inputs = {k: _seeded_inputs(tf, fn, SEED) for k, fn in signatures.items()}
    expected = {k: _run_signature(fn, inputs[k]) for k, fn in signatures.items()}
    folded = 0
    with staged(output):
        if target is Target.TFLITE:
            flatbuffer = _to_tflite(tf, readable, list(signatures), mode, signatures,
                                    shown=src)
            output.open(out.name).write(flatbuffer)
            output.seal()
            got = _run_tflite(tf, flatbuffer, inputs)
            missing = [k for k in signatures if k not in got]
            if len(missing) == len(signatures):
                raise OutputMismatchError(f"{printable(str(src))}: the TFLite file holds none "
                                          "of the signatures; nothing was written")
            if missing:
                notes.append(f"the converter kept signature(s) {', '.join(got)} and left out "
                             f"{', '.join(missing)}")
                expected = {k: v for k, v in expected.items() if k in got}
            output_inventory = None
        else:
            stage = output.staged_path()
            if freeze:
                frozen = _frozen(tf, signatures)
                root, exported, folded = frozen.root, frozen.exported, frozen.folded
                notes.append(f"froze {len(variables)} variables into constants; folded "
                             f"{folded} BatchNorm(s) into the weights before them"
                             + (f"; merged {frozen.merged} constants equal to another"
                                if frozen.merged else ""))
                notes += frozen.notes
            else:
                root, exported = _pruned_root(tf, variables), signatures
                notes.append(f"kept the {len(variables)} variables the signatures read; "
                             f"dropped {len(dropped)} other tensors")
            tf.saved_model.save(root, str(stage), signatures=exported)
            renumber_functions(stage)
            _fsync_tree(stage)
            reloaded = _load(tf, stage)
            got = {k: _run_signature(reloaded.signatures[k], inputs[k]) for k in signatures}
            output_inventory = formats.read(stage)
        diffs = _diffs(expected, got)
        worst = max(diffs, key=lambda d: d.max_rel, default=None)
        if worst is not None and not worst.max_rel <= bound:
            raise OutputMismatchError(
                f"{printable(str(src))}: output {worst.signature}/{worst.output} moved by "
                f"{worst.max_rel:.3g} of its scale (max abs {worst.max_abs:.3g}), over the "
                f"tolerance {bound:g} for {'/'.join(passes)}; {out.name} was not written "
                "(raise it with --tolerance if that is acceptable)"
            )
        after = _tree_bytes(output.staged_path())
        output.commit(main=None if target is Target.SAVED_MODEL else out.name)
    return GraphSlimResult(
        **common, bytes_after=after, output_inventory=output_inventory,
        diffs=tuple(diffs), verified=True, dry_run=False, notes=tuple(notes),
        seconds=time.perf_counter() - started, folded_batchnorms=folded,
    )


# --------------------------------------------------------------------------------------
# As a SlimReport (what ``modelsize slim`` renders)
# --------------------------------------------------------------------------------------
class PassName(str, Enum):
    """The modes, as the report's pass table names them."""

    PRUNE = "prune-to-signatures"
    FREEZE = "freeze+grappler+fold-batchnorm"
    TFLITE = "tflite"


@dataclass(frozen=True)
class PassRow:
    """One row of the report's pass table: a mode is measured as a whole, not pass by pass."""

    name: PassName
    changes: int
    bytes_before: int
    bytes_after: int
    applied: bool = True
    note: str = ""

    @property
    def saved_bytes(self) -> int:
        """Bytes the mode saves."""
        return self.bytes_before - self.bytes_after

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"name": self.name.value, "changes": self.changes,
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
                "applied": self.applied, "saved_bytes": self.saved_bytes, "note": self.note}


def to_slim_report(result: GraphSlimResult) -> GraphSlimReport:
    """``result`` as the :class:`SlimReport` every ``slim`` returns (kept and dropped tensors
    named by their checkpoint keys in the source)."""
    records = {t.name: t for t in result.source_inventory.tensors}
    kept = tuple(
        KeptTensor(name=k, source_name=k, dtype=records[k].dtype, source_dtype=records[k].dtype,
                   shape=records[k].shape, nbytes=records[k].nbytes)
        for k in result.kept if k in records
    )
    reason = "not read by any serving signature"
    dropped = tuple(Dropped(n, records[n].category, records[n].stored_nbytes, reason)
                    for n in result.dropped)
    name = (PassName.TFLITE if result.output_format == Target.TFLITE.value else
            PassName.FREEZE if "freeze" in result.passes else PassName.PRUNE)
    changes = result.folded_batchnorms if name is PassName.FREEZE else len(result.dropped)
    after = result.bytes_after
    rows = (PassRow(name, changes, result.bytes_before,
                    after if after is not None else result.bytes_before,
                    note="+".join(p for p in result.passes if p != name.value)),)
    runner = ("the TFLite interpreter and TensorFlow" if name is PassName.TFLITE
              else "TensorFlow")
    kind = next((p.removeprefix("quantize-") for p in result.passes
                 if p.startswith("quantize-")), "tflite" if name is PassName.TFLITE else "exact")
    comparison = None if result.dry_run else Comparison(
        tuple(NamedDiff(f"{d.signature}/{d.output}", d.max_abs, d.max_rel)
              for d in result.diffs), result.tolerance, kind, runner)
    files = ((result.target, after),) if after is not None else ()
    return GraphSlimReport(
        source=result.source_inventory, target=result.target,
        output_format=("tensorflow" if result.output_format == "saved_model" else "tflite"),
        dry_run=result.dry_run, predicted_bytes=None, kept=kept, dropped=dropped,
        notes=result.notes, output=result.output_inventory, output_files=files,
        verified=result.verified, passes=rows, comparison=comparison,
    )


def slim_from_options(inv: Inventory, out: str | Path | None, options: SlimOptions, *,
                      dry_run: bool, force: bool) -> GraphSlimReport:
    """What :func:`modelsize.slim` calls for a SavedModel kept as one (``to="same"``) or
    converted to TFLite (``to="tflite"``); the options that pick tensors do not apply."""
    flags = [flag for flag, used in (
        ("--drop", options.drop is not None), ("--keep", bool(options.keep)),
        ("--dedupe", options.dedupe), ("--cast", options.cast is not None)) if used]
    if flags:
        raise UsageError(
            f"{printable(str(inv.path))}: {', '.join(flags)} do(es) not apply to a SavedModel, "
            "which keeps what its signatures read (--to safetensors writes its tensors instead)")
    to = Target.TFLITE if options.to == Target.TFLITE.value else Target.SAVED_MODEL
    result = slim_saved_model(
        inv.path, default_target(inv.path, to) if out is None else Path(out),
        freeze=options.freeze, to=to.value, quantize=options.quantize,
        tolerance=options.tolerance, force=force, dry_run=dry_run)
    return to_slim_report(result)


def default_target(src: Path, to: Target) -> Path:
    """``NAME.slim`` (a SavedModel folder) or ``NAME.tflite`` beside the source folder."""
    return src.with_name(src.name + (".tflite" if to is Target.TFLITE else ".slim"))


# --------------------------------------------------------------------------------------
# Arguments and input
# --------------------------------------------------------------------------------------
def _target(to: str | None) -> Target:
    if to is None:
        return Target.SAVED_MODEL
    try:
        return Target(to)
    except ValueError:
        choices = ", ".join(t.value for t in Target)
        raise UsageError(f"--to {printable(to)}: expected one of {choices}") from None


def _quantize(quantize: str | None) -> Quantize | None:
    if quantize is None:
        return None
    try:
        return Quantize(quantize)
    except ValueError:
        choices = ", ".join(q.value for q in Quantize)
        raise UsageError(f"--quantize {printable(quantize)}: expected one of {choices}") from None


def _passes(freeze: bool, target: Target, mode: Quantize | None) -> tuple[str, ...]:
    if target is Target.TFLITE:
        return ("tflite",) + ((f"quantize-{mode.value}",) if mode is not None else ())
    if freeze:
        return ("freeze", "grappler", "fold-batchnorm")
    return ("prune-to-signatures",)


def _check_source(src: Path) -> Any:
    """The source's inventory (modelsize's own reader: corrupt files fail here, before TF)."""
    if not src.exists():
        raise PathNotFoundError(src)
    if not is_saved_model(src):
        raise UnknownFormatError(src, "not a SavedModel directory (no saved_model.pb)")
    return formats.read(src)


def _import_tensorflow(src: Path) -> Any:
    try:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import tensorflow as tf
    except ImportError:
        raise MissingDependencyError(
            "tensorflow", f"slimming {printable(str(src))}, a TensorFlow SavedModel (its "
            "graph; --to safetensors writes its tensors without TensorFlow),", extra="tf",
        ) from None
    return tf


def _load_source(tf: Any, src: Path, stack: contextlib.ExitStack) -> tuple[Any, Path]:
    """``src`` loaded, and the path TensorFlow loads it from: ``src``, or, when TensorFlow
    cannot revive the optimizer whose slot variables the object graph names (a Keras 2
    optimizer under Keras 3: ``'_UserObject' object has no attribute 'add_slot'``), a
    temporary view of it whose ``saved_model.pb`` has those links taken out and whose other
    files are links to ``src``'s (kept until ``stack`` closes). The slots are then read as
    plain variables that no signature reads. ``src`` is not written."""
    try:
        return _load(tf, src), src
    except CorruptFileError as exc:
        if "add_slot" not in str(exc):
            raise
        first = exc
    from tensorflow.core.protobuf import saved_model_pb2

    model = saved_model_pb2.SavedModel()
    model.ParseFromString((src / "saved_model.pb").read_bytes())
    nodes = [n for meta in model.meta_graphs for n in meta.object_graph_def.nodes
             if n.slot_variables]
    if not nodes:
        raise first
    for node in nodes:
        del node.slot_variables[:]
    view = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="modelsize-view-")))
    (view / "saved_model.pb").write_bytes(model.SerializeToString())
    for entry in src.iterdir():
        if entry.name not in ("saved_model.pb", "fingerprint.pb"):
            (view / entry.name).symlink_to(real_path(entry, must_exist=False), entry.is_dir())
    try:
        return _load(tf, view), view
    except CorruptFileError:
        raise first from None


def _load(tf: Any, path: Path) -> Any:
    try:
        return tf.saved_model.load(str(path))
    except Exception as exc:  # TF raises a zoo of errors for a bad graph or bundle
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CorruptFileError(path, FORMAT, f"TensorFlow cannot load it: {reason}") from exc


def _checkpoint_keys(tf: Any, root: Any) -> dict[int, str]:
    """``id(variable) -> checkpoint key`` for every variable reachable from ``root``.

    A TF2 checkpoint key is the first (breadth-first) path of object-graph edges to the
    variable plus ``/.ATTRIBUTES/VARIABLE_VALUE``: what ``tf.train.list_variables`` shows.
    """
    keys: dict[int, str] = {}
    seen = {id(root)}
    queue: deque[tuple[Any, str]] = deque([(root, "")])
    while queue:
        obj, path = queue.popleft()
        try:
            children = obj._trackable_children(save_type="checkpoint")
        except Exception:  # an object TF cannot walk holds no variables we can name
            continue
        for name, child in children.items():
            if id(child) in seen:
                continue
            seen.add(id(child))
            here = f"{path}/{_escape(name)}" if path else _escape(name)
            if isinstance(child, tf.Variable):
                keys[id(child)] = f"{here}/.ATTRIBUTES/VARIABLE_VALUE"
            queue.append((child, here))
    return keys


def _escape(name: str) -> str:
    # tensorflow/python/trackable/trackable_utils.py::escape_local_name
    return name.replace(".", "..").replace("/", ".S")


def _captured_variables(signatures: dict[str, Any]) -> list[Any]:
    """The variables the signatures read, each once, in first-seen order."""
    seen: dict[int, Any] = {}
    for fn in signatures.values():
        for v in fn.variables:
            seen.setdefault(id(v), v)
    return list(seen.values())


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------
def _seeded_inputs(tf: Any, fn: Any, seed: int) -> dict[str, Any]:
    """Seeded random inputs for one signature, by argument name."""
    import numpy as np

    rng = np.random.default_rng(seed)
    result: dict[str, Any] = {}
    for name, spec in sorted(fn.structured_input_signature[1].items()):
        dims = spec.shape.as_list() if spec.shape.rank is not None else [2]
        shape = [d if d is not None else (2 if i == 0 else 8) for i, d in enumerate(dims)]
        dtype = spec.dtype
        if dtype.is_floating:
            value = rng.standard_normal(shape).astype(dtype.as_numpy_dtype)
        elif dtype.is_integer:
            value = rng.integers(0, 10, shape).astype(dtype.as_numpy_dtype)
        elif dtype == tf.bool:
            value = rng.integers(0, 2, shape).astype(bool)
        else:
            raise UsageError(f"signature input {printable(name)} is {dtype.name}: cannot make "
                             "up inputs to verify the output with, so slim does not write one")
        result[name] = value
    return result


def _run_signature(fn: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v.numpy() for k, v in fn(**inputs).items()}


def _diffs(expected: dict[str, dict[str, Any]],
           got: dict[str, dict[str, Any]]) -> list[OutputDiff]:
    import numpy as np

    diffs = []
    for sig, outputs in expected.items():
        for name, a in sorted(outputs.items()):
            b = got.get(sig, {}).get(name)
            if b is None or np.shape(b) != np.shape(a):
                raise OutputMismatchError(
                    f"output {printable(sig)}/{printable(name)} of the slimmed model is missing "
                    f"or has another shape ({None if b is None else np.shape(b)} vs "
                    f"{np.shape(a)}); nothing was written"
                )
            a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
            max_abs = float(np.max(np.abs(a64 - b64))) if a64.size else 0.0
            scale = float(np.max(np.abs(a64))) if a64.size else 0.0
            max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
            diffs.append(OutputDiff(sig, name, max_abs, max_rel))
    return diffs


# --------------------------------------------------------------------------------------
# Default: only what the signatures capture
# --------------------------------------------------------------------------------------
def _pruned_root(tf: Any, variables: list[Any]) -> Any:
    """A new root tracking only ``variables``, keyed by their names (made unique)."""
    root = tf.Module()
    named: dict[str, Any] = {}
    for v in variables:
        base = v.name.split(":")[0] or "variable"
        key, n = base, 1
        while key in named:
            n += 1
            key = f"{base}_{n}"
        named[key] = v
    root.variables_by_name = named
    return root


# --------------------------------------------------------------------------------------
# Freeze: constants, grappler, BatchNorm folding
# --------------------------------------------------------------------------------------
_GRAPPLER_PASSES = ("pruning", "constfold", "arithmetic", "dependency")


@dataclass
class _Frozen:
    """What :func:`_frozen` made: the root and its signature functions, how many BatchNorms it
    folded and constants it merged, and what it has to say."""

    root: Any
    exported: dict[str, Any]
    folded: int = 0
    merged: int = 0
    notes: list[str] = field(default_factory=list)


def _frozen(tf: Any, signatures: dict[str, Any]) -> _Frozen:
    """Signature functions computing each signature from constants, optimized; a signature
    whose optimized graph is larger than the frozen graph only pruned keeps that one
    (constant folding can materialise a broadcast or a computed table)."""
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2,
    )

    result = _Frozen(tf.Module(), {})
    functions: list[Any] = []
    by_graph: dict[bytes, Any] = {}
    for key, fn in signatures.items():
        frozen = convert_variables_to_constants_v2(fn)
        ends = [t.name for t in list(frozen.inputs) + list(frozen.outputs)]
        fetches = [t.name for t in frozen.outputs]
        plain = frozen.graph.as_graph_def()
        # Constant folding first makes a BatchNorm's scale and shift constants; they are
        # folded before the arithmetic optimizer regroups the adds around them (residuals).
        graph_def = _grappler(tf, plain, ends, ("constfold",))
        graph_def, folded = fold_batchnorm(tf, graph_def, fetches)
        graph_def = _grappler(tf, graph_def, ends, _GRAPPLER_PASSES)
        graph_def, merged = merge_constants(graph_def, fetches)
        # Each pass must pay for itself: measured against the same graph only pruned.
        pruned, pruned_merged = merge_constants(
            _grappler(tf, plain, ends, ("pruning", "dependency")), fetches)
        if graph_def.ByteSize() > pruned.ByteSize():
            result.notes.append(
                f"{key}: constant folding made the frozen graph larger "
                f"({pruned.ByteSize():,} -> {graph_def.ByteSize():,} bytes); kept it "
                "unfolded, pruned")
            graph_def, merged, folded = pruned, pruned_merged, 0
        signature = graph_def.SerializeToString(deterministic=True)
        if signature in by_graph:
            result.exported[key] = by_graph[signature]
            continue
        result.folded += folded
        result.merged += merged
        concrete = _function_from_graph(tf, graph_def, fn, frozen)
        functions.append(concrete)
        by_graph[signature] = result.exported[key] = concrete
    result.root.functions = functions
    return result


def merge_constants(graph_def: Any, fetches: list[str]) -> tuple[Any, int]:
    """One ``Const`` node for each distinct constant: equal ``dtype`` and ``value`` (and no
    inputs), read through the first of them; how many were merged away.

    Constant folding evaluates what the variables made constant feed: a kernel computed once
    and expanded for each of 20 convolutions becomes 20 equal constants (basic-pitch's CQT
    layer: 746 kB of constants, 145 kB of them distinct). Fetched nodes stay as they are.
    """
    graph = type(graph_def)()
    graph.CopyFrom(graph_def)
    kept: set[str] = {f.split(":")[0] for f in fetches}
    first: dict[bytes, str] = {}
    alias: dict[str, str] = {}
    for node in graph.node:
        if node.op != "Const" or node.input or node.name in kept:
            continue
        key = (node.attr["dtype"].SerializeToString(deterministic=True)
               + node.attr["value"].SerializeToString(deterministic=True))
        if key in first:
            alias[node.name] = first[key]
        else:
            first[key] = node.name
    if not alias:
        return graph, 0
    for node in graph.node:
        for i, name in enumerate(node.input):
            control = name.startswith("^")
            src, _, port = name.lstrip("^").partition(":")
            if src in alias:
                node.input[i] = ("^" if control else "") + alias[src] + (f":{port}" if port
                                                                        else "")
        if len(set(node.input)) < len(node.input):  # ^a and ^b both became ^a
            unique: list[str] = []
            for i in node.input:
                if not i.startswith("^") or i not in unique:
                    unique.append(i)
            del node.input[:]
            node.input.extend(unique)
    nodes = [n for n in graph.node if n.name not in alias]
    del graph.node[:]
    graph.node.extend(nodes)
    return graph, len(alias)


def _grappler(tf: Any, graph_def: Any, ends: list[str], passes: tuple[str, ...]) -> Any:
    """``graph_def`` after grappler's ``passes``, keeping the tensors ``ends``."""
    from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
    from tensorflow.python.grappler import tf_optimizer

    with tf.Graph().as_default() as graph:
        tf.graph_util.import_graph_def(graph_def, name="")
    meta = tf.compat.v1.train.export_meta_graph(graph_def=graph_def, graph=graph)
    fetch = meta_graph_pb2.CollectionDef()
    fetch.node_list.value.extend(ends)
    meta.collection_def["train_op"].CopyFrom(fetch)  # what grappler must keep
    config = config_pb2.ConfigProto()
    rewrite = config.graph_options.rewrite_options
    rewrite.optimizers.extend(passes)
    rewrite.meta_optimizer_iterations = 2  # ONE = 1, TWO = 2 in RewriterConfig
    return tf_optimizer.OptimizeGraph(config, meta)


def _function_from_graph(tf: Any, graph_def: Any, fn: Any, frozen: Any) -> Any:
    """A concrete function with ``fn``'s named inputs and outputs, running ``graph_def``."""
    wrapped = tf.compat.v1.wrap_function(
        lambda: tf.compat.v1.import_graph_def(graph_def, name=""), [])
    pruned = wrapped.prune(feeds=[t.name for t in frozen.inputs],
                           fetches=[t.name for t in frozen.outputs])
    specs = fn.structured_input_signature[1]
    names = sorted(specs)  # tf.nest flattens dicts in key order, as fn.inputs are
    structure = fn.structured_outputs

    def serve(**kwargs: Any) -> Any:
        return tf.nest.pack_sequence_as(structure, list(pruned(*[kwargs[n] for n in names])))

    # autograph=False: nothing to convert, and autograph cannot parse a nested function's
    # source (it warns on stderr).
    wrapper = tf.function(serve, autograph=False)
    return wrapper.get_concrete_function(**{n: specs[n] for n in names})


_FOLDABLE = frozenset({"Conv2D", "DepthwiseConv2dNative", "MatMul"})


def fold_batchnorm(tf: Any, graph_def: Any, fetches: list[str]) -> tuple[Any, int]:
    """Fold ``(W x [+ b]) * s [+ t]`` (``W, b, s, t`` constant, per channel) into ``W' x + b'``.

    This is what an inference BatchNorm becomes once its statistics are constants and folded
    (``Mul`` by ``gamma / sqrt(var + eps)``, ``Add`` of ``beta - mean * that``; grappler's
    constant folding drops the ``Add`` when the shift is zero, as in a BatchNorm fresh from
    initialisation). ``W x`` is a ``Conv2D``, ``DepthwiseConv2dNative`` or ``MatMul``. Only
    chains whose intermediate results nothing else reads are folded. Returns the new graph and
    how many chains were folded.
    """
    import numpy as np

    graph = type(graph_def)()
    graph.CopyFrom(graph_def)
    nodes = {n.name: n for n in graph.node}

    def readers() -> tuple[dict[str, int], dict[str, list[Any]]]:
        """How many inputs (and fetches) read each node, and the nodes reading each."""
        count: dict[str, int] = {}
        users: dict[str, list[Any]] = {}
        for n in graph.node:
            for i in n.input:
                src = i.lstrip("^").split(":")[0]
                count[src] = count.get(src, 0) + 1
                users.setdefault(src, []).append(n)
        for f in fetches:
            src = f.split(":")[0]
            count[src] = count.get(src, 0) + 1
        return count, users

    def const(name: str) -> Any:
        node = nodes.get(name.split(":")[0])
        if node is None or node.op != "Const" or (":" in name and not name.endswith(":0")):
            return None
        return tf.make_ndarray(node.attr["value"].tensor)

    def split(node: Any) -> tuple[str, Any] | None:
        """(the non-constant input, the constant) of a binary node, or None."""
        if len(node.input) != 2 or any(i.startswith("^") for i in node.input):
            return None
        for a, b in ((0, 1), (1, 0)):
            value = const(node.input[b])
            if value is not None and const(node.input[a]) is None:
                return node.input[a], value
        return None

    def channel_vector(value: Any, channels: int, rank: int) -> Any:
        """``value`` as a per-channel vector when it broadcasts only along the last axis of a
        rank-``rank`` result (and does not raise its rank)."""
        if value.ndim > rank:
            return None
        if value.size != channels or (value.ndim and value.shape[-1] != channels):
            return None if value.size != 1 else np.full(channels, value.reshape(()))
        return value.reshape(channels)

    def single(name: str, count: dict[str, int]) -> Any:
        """The node producing ``name`` (its first output) when exactly one input reads it."""
        node = nodes.get(name)
        return node if node is not None and count.get(name) == 1 else None

    folded = 0
    changed = True
    while changed:  # a pass folds disjoint chains; the next sees what they became
        changed = False
        count, users = readers()
        dead: set[str] = set()
        touched: set[str] = set()
        for mul in list(graph.node):
            if mul.op != "Mul" or mul.name in touched:
                continue
            mparts = split(mul)
            if mparts is None:
                continue
            prev = single(mparts[0], count)
            if prev is None:
                continue
            bias_node, bias = None, None
            if prev.op == "BiasAdd":
                bparts = split(prev)
                if bparts is None or bparts[0] != prev.input[0] or ":" in prev.input[1]:
                    continue
                if prev.attr["data_format"].s not in (b"", b"NHWC"):
                    continue
                bias_node, bias = prev, bparts[1]
                conv = single(prev.input[0], count)
            else:
                conv = prev
            if conv is None or conv.op not in _FOLDABLE or len(conv.input) != 2:
                continue
            if touched & {prev.name, conv.name}:
                continue
            weights = const(conv.input[1])
            if weights is None or weights.dtype.kind != "f":
                continue
            if conv.op == "MatMul":
                if conv.attr["transpose_a"].b or conv.attr["transpose_b"].b:
                    continue
            elif conv.attr["data_format"].s not in (b"", b"NHWC"):
                continue
            depthwise = conv.op == "DepthwiseConv2dNative"
            channels = weights.shape[2] * weights.shape[3] if depthwise else weights.shape[-1]
            rank = 2 if conv.op == "MatMul" else 4
            scale = channel_vector(mparts[1], channels, rank)
            if scale is None:
                continue
            if bias is not None:
                bias = channel_vector(bias, channels, rank)
                if bias is None:
                    continue
            # The shift: an Add of a constant that only the Mul's result feeds.
            end, shift = mul, None
            after = users.get(mul.name, [])
            if count.get(mul.name) == 1 and len(after) == 1 and after[0].op in ("AddV2", "Add"):
                aparts = split(after[0])
                if aparts is not None and aparts[0] == mul.name:
                    shift = channel_vector(aparts[1], channels, rank)
                    end = mul if shift is None or after[0].name in touched else after[0]
            dtype = weights.dtype
            if depthwise:
                new_w = weights * scale.reshape(weights.shape[2], weights.shape[3])
            else:
                new_w = weights * scale
            consts = [(f"{conv.name}/folded_weights", new_w)]
            if bias is not None or shift is not None:
                new_b = (np.zeros(channels, dtype) if bias is None else bias) * scale
                consts.append((f"{end.name}/folded_bias",
                               new_b if shift is None else new_b + shift))
            for name, value in consts:
                node = graph.node.add()
                node.name, node.op = name, "Const"
                node.attr["dtype"].type = conv.attr["T"].type
                node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value.astype(dtype)))
                nodes[name] = node
            conv.input[1] = consts[0][0]
            # The chain's last node keeps its name (its readers stay as they are) and becomes
            # the BiasAdd of the new bias, or an Identity when there is none.
            t_attr = end.attr["T"].type
            del end.input[:]
            end.input.append(conv.name)
            end.attr.clear()
            end.attr["T"].type = t_attr
            if len(consts) == 2:
                end.op = "BiasAdd"
                end.input.append(consts[1][0])
                end.attr["data_format"].s = b"NHWC"
            else:
                end.op = "Identity"
            dead |= ({mul.name} - {end.name}) | (
                {bias_node.name} if bias_node is not None else set())
            touched |= {mul.name, prev.name, conv.name, end.name}
            folded += 1
            changed = True
        if dead:
            kept = [n for n in graph.node if n.name not in dead]
            del graph.node[:]
            graph.node.extend(kept)
            nodes = {n.name: n for n in graph.node}
    # Constants no longer read (the old weights, scale, shift) go.
    count, _ = readers()
    kept = [n for n in graph.node if n.op != "Const" or count.get(n.name)]
    del graph.node[:]
    graph.node.extend(kept)
    return graph, folded


# --------------------------------------------------------------------------------------
# TFLite
# --------------------------------------------------------------------------------------
def _to_tflite(tf: Any, src: Path, keys: list[str], mode: Quantize | None,
               signatures: dict[str, Any], shown: Path | None = None) -> bytes:
    """The TFLite flatbuffer of the SavedModel at ``src`` (``shown``: its name in errors)."""
    converter = tf.lite.TFLiteConverter.from_saved_model(str(src), signature_keys=keys)
    if mode is not None:
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
    if mode is Quantize.FLOAT16:
        converter.target_spec.supported_types = [tf.float16]
    elif mode is Quantize.INT8:
        # The converter merges signatures that share a function (Keras' ``serve`` and
        # ``serving_default``); calibration must name only those it keeps, which a float
        # conversion tells.
        kept = _interpreter(tf, _to_tflite(tf, src, keys, None, signatures)).get_signature_list()
        calibrated = {k: fn for k, fn in signatures.items() if k in kept}

        def dataset() -> Iterator[Any]:
            for i in range(CALIBRATION_SAMPLES):
                for key, fn in calibrated.items():
                    sample = _seeded_inputs(tf, fn, SEED + 1 + i)
                    # One signature: its inputs by name; several: (signature key, inputs).
                    yield sample if len(calibrated) == 1 else (key, sample)

        converter.representative_dataset = dataset
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    try:
        with _quiet():
            return bytes(converter.convert())
    except Exception as exc:  # the converter's errors are many and long
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"{printable(str(shown or src))}: TensorFlow's TFLite converter "
                         "refused it: "
                         f"{printable(first)}") from exc


def _interpreter(tf: Any, flatbuffer: bytes) -> Any:
    try:
        from ai_edge_litert.interpreter import Interpreter

        return Interpreter(model_content=flatbuffer)
    except ImportError:
        with warnings.catch_warnings():  # tf.lite.Interpreter warns that it is deprecated
            warnings.simplefilter("ignore", UserWarning)
            return tf.lite.Interpreter(model_content=flatbuffer)


def _run_tflite(tf: Any, flatbuffer: bytes,
                inputs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    interpreter = _interpreter(tf, flatbuffer)
    present = interpreter.get_signature_list()
    with _quiet():
        return {key: dict(interpreter.get_signature_runner(key)(**feed))
                for key, feed in inputs.items() if key in present}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """TensorFlow's converter prints to the process's stderr; keep it off the user's."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


# --------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------
_NUMBERED = re.compile(r"(.*_)(\d+)")


def renumber_functions(path: Path) -> int:
    """Number the functions of the SavedModel at ``path`` from 0, in the order TensorFlow
    numbered them; how many were renamed.

    ``tf.saved_model.save`` names each function after a process-wide counter
    (``__inference_serve_27341``), names captured inputs after it too, and writes the
    function library in no fixed order, so the same model saved after other work in the
    process gives other bytes and another size. Renumbered, and the library in name order,
    a slim's ``saved_model.pb`` is the same for the same input whatever ran before it
    (``fingerprint.pb`` is rewritten for it, with TensorFlow's random ``uuid``). Every
    string of the proto equal to an old name is replaced (library, calls, function
    attributes, the object graph's keys); TensorFlow renames functions again when it loads
    them. Left as it is when the new names would collide with a name that stays.
    """
    from tensorflow.core.protobuf import saved_model_pb2

    pb = path / "saved_model.pb"
    model = saved_model_pb2.SavedModel()
    model.ParseFromString(pb.read_bytes())
    names = [f.signature.name for meta in model.meta_graphs
             for f in meta.graph_def.library.function]
    numbered = sorted((int(m.group(2)), m.group(1), name) for name in set(names)
                      if (m := _NUMBERED.fullmatch(name)))
    rename = {old: f"{stem}{i}" for i, (_, stem, old) in enumerate(numbered)}
    if not rename or len(set(rename.values()) | (set(names) - set(rename))) != len(set(names)):
        return 0
    _rename_strings(model, rename)
    for meta in model.meta_graphs:  # TensorFlow writes the library in no fixed order
        library = meta.graph_def.library
        functions = sorted(library.function, key=lambda f: f.signature.name)
        del library.function[:]
        library.function.extend(functions)
    # A captured input's placeholder is named after a counter too ("18305"), in no fixed
    # order; the name only names the placeholder when the function is loaded. Numbered in
    # the order they appear.
    numbers: dict[bytes, bytes] = {}
    for key, m in _messages(model):
        if key == "_user_specified_name" and m.WhichOneof("value") == "s" and m.s.isdigit():
            m.s = numbers.setdefault(m.s, str(len(numbers)).encode())
    pb.write_bytes(model.SerializeToString(deterministic=True))
    fingerprint = path / "fingerprint.pb"
    if fingerprint.exists():
        from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting

        fingerprint.write_bytes(fingerprinting.CreateFingerprintDef(str(path)))
    return len(rename)


def _messages(message: Any, key: Any = None) -> Iterator[tuple[Any, Any]]:
    """Every message inside ``message`` (itself first), with the map key it is under."""
    from google.protobuf.descriptor import FieldDescriptor

    yield key, message
    for desc, value in message.ListFields():
        if desc.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        if desc.message_type.GetOptions().map_entry:
            if desc.message_type.fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE:
                for k in sorted(value):
                    yield from _messages(value[k], k)
        elif _repeated(desc):
            for item in value:
                yield from _messages(item)
        else:
            yield from _messages(value)


def _repeated(desc: Any) -> bool:
    # protobuf 5.26+ says is_repeated; label is gone from 6.
    if hasattr(desc, "is_repeated"):
        return bool(desc.is_repeated)
    return bool(desc.label == desc.LABEL_REPEATED)


def _rename_strings(message: Any, rename: dict[str, str]) -> None:
    """Replace, everywhere in ``message``, each string (and string map key) in ``rename``."""
    from google.protobuf.descriptor import FieldDescriptor

    # _messages yields a message before it walks into it: its map keys, renamed here, are
    # those the walk then follows.
    for _, m in _messages(message):
        for desc, value in m.ListFields():
            if desc.type == FieldDescriptor.TYPE_STRING:
                if _repeated(desc):
                    value[:] = [rename.get(v, v) for v in value]
                elif value in rename:
                    setattr(m, desc.name, rename[value])
            elif desc.type == FieldDescriptor.TYPE_MESSAGE and \
                    desc.message_type.GetOptions().map_entry:
                entry = desc.message_type.fields_by_name["value"].type
                for key in list(value):
                    if entry == FieldDescriptor.TYPE_STRING and value[key] in rename:
                        value[key] = rename[value[key]]
                    if isinstance(key, str) and key in rename:
                        if entry == FieldDescriptor.TYPE_MESSAGE:
                            value[rename[key]].CopyFrom(value[key])
                        else:
                            value[rename[key]] = value[key]
                        del value[key]


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _fsync_tree(path: Path) -> None:
    """fsync every file TensorFlow wrote under ``path``, then the folders."""
    for p in sorted(path.rglob("*"), reverse=True):
        with contextlib.suppress(OSError):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
