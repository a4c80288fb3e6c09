"""``modelsize.slim(path, out, ...)``: read, plan, write streamed and staged, verify, commit."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from modelsize import formats, inputs
from modelsize.errors import LimitError, MissingDependencyError, UsageError, printable
from modelsize.inventory import FileInfo, Inventory, LazyInventory, TensorRecord
from modelsize.slimming import writers
from modelsize.slimming.output import Output, write_verified
from modelsize.slimming.plan import Plan, SlimOptions, make_plan, parse_drop
from modelsize.slimming.result import (
    DroppedTable,
    KeptTable,
    SlimReport,
    growth_notes,
    unsafe_note,
)
from modelsize.slimming.source import Sources, StorageDecoder, TensorSource
from modelsize.slimming.verify import verify
from modelsize.slimming.writers.base import Meter, Written

#: Input formats whose tensors are pieces of the model's tensors (partitions, chunks): a module
#: of :mod:`modelsize.slimming` with ``logical_tensors(inv, decoder)`` puts them back together.
CONSOLIDATORS: dict[str, str] = {
    "deepspeed": "consolidate",
    "torch-dcp": "consolidate",
}

LogicalTensors = tuple[Sequence[TensorRecord], Callable[[TensorRecord], TensorSource]]


def _sources(inv: Inventory) -> LogicalTensors:
    """The tensors to plan with and where their bytes come from."""
    reader = formats.registry().get(inv.format)
    decoder: StorageDecoder | None = getattr(reader, "storage_chunks", None)
    module = CONSOLIDATORS.get(inv.format)
    if module is not None:
        found = importlib.import_module(f"modelsize.slimming.{module}").logical_tensors(
            inv, decoder)
        if found is not None:
            return found

    return inv.tensors, Sources(inv, decoder)


def plan_slim(inv: Inventory, options: SlimOptions) -> Plan:
    """The plan for slimming an inventory already read."""
    found = _sources(inv)
    tensors, source_of = found
    plan = make_plan(inv, options, source_of, tensors)
    plan.notes.extend(getattr(found, "notes", ()))
    return plan


@inputs.watched  # the input's files are held still from before the read to the commit
def slim(
    path: str | Path,
    out: str | Path | None = None,
    *,
    drop: Iterable[str] | None = None,
    dedupe: bool = False,
    cast: str | None = None,
    to: str = "same",
    keep: Sequence[str] = (),
    dry_run: bool = False,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    graph: bool = False,
    quantize: str | None = None,
    freeze: bool = False,
    tolerance: float | None = None,
    external_data: str = "auto",
) -> SlimReport:
    """Write a smaller copy of the checkpoint at ``path`` and verify it.

    With no ``drop``, ``dedupe`` or ``cast`` it drops what inference does not need
    (optimizer state, gradients, cached activations, unused storage, duplicates) and keeps the
    input's format. ``drop`` names categories (and ``ema``); ``dedupe`` stores identical
    tensors once; ``cast`` narrows floating tensors (``float32``, ``float16``, ``bfloat16``);
    ``to`` is ``same``, ``safetensors``, ``pytorch`` or ``npz``; ``keep`` globs keep matching
    entries whatever their category (and the checkpoint's top-level layout, for torch files).

    ``out`` defaults to ``NAME.slim.EXT`` beside the input. The input is never modified; an
    existing ``out`` is refused without ``force``, and so is an ``out`` whose extension names
    another format than the one written (``x.slim.pkl`` for an npz). With nothing to slim
    (every tensor kept as it is) and no smaller rewrite, the output is the input byte for byte
    (``SlimReport.copied``); an output larger than the input says why in its notes. The
    output is written to an unnamed file, read back by modelsize's own reader and checked
    tensor by tensor (name, dtype, shape, CRC-32 of its bytes) before it gets its name.
    ``dry_run`` plans without writing. ``progress(bytes written, bytes planned)`` is called as
    data streams.

    ``graph`` runs the exact graph passes on ONNX input (constant and BatchNorm folding, dead
    code, duplicate and unused initializers; ``modelsize slim`` turns it on), ``quantize``
    (``int8``, ``float16``, ``dynamic``) adds an approximate one; the original and the output
    are then run on the same seeded inputs, and an output further than ``tolerance``
    (relative, default by pass) is not written (:mod:`modelsize.slimming.graph`).
    ``external_data`` (``auto``, ``always``, ``never``) places an ONNX output's tensors: one
    file when it fits under protobuf's 2 GB limit, ``OUT.data`` when not (``auto``).
    """
    options = SlimOptions(
        drop=parse_drop(drop) if drop is not None else None, dedupe=dedupe, cast=cast, to=to,
        keep=tuple(keep), graph=graph, quantize=quantize, freeze=freeze, tolerance=tolerance,
    )
    inv = inputs.read(path)
    if inv.facts.get("layout") == "saved_model" and options.to in ("same", "tflite"):
        from modelsize.slimming.graph.tf_savedmodel import slim_from_options as slim_tf

        return slim_tf(inv, out, options, dry_run=dry_run, force=force)
    if _graph_slim(inv, options):
        from modelsize.slimming.graph.onnx_slim import slim_onnx

        return slim_onnx(inv, out, options, dry_run=dry_run, force=force,
                         external_data=external_data)
    if options.quantize is not None or options.freeze:
        flag = "--quantize" if options.quantize is not None else "--freeze"
        raise UsageError(f"{printable(str(inv.path))}: {flag} does not apply to "
                         f"{inv.format} input")
    writer = writers.for_input(inv.format, options.to)
    if inv.format in ("npz", "keras") and not dry_run:
        # Read through against the members' CRC-32, as np.load checks them, whatever is
        # written: an output's own checksums would pass damaged bytes on as sound.
        from modelsize.slimming.loadable import refuse_unloadable

        refuse_unloadable(inv, whole=True)
    plan = plan_slim(inv, options)
    if not len(plan):
        what = ("holds no tensor data to write" if not plan.dropped else
                f"nothing would be left to write: all {len(plan.dropped)} tensors are dropped "
                f"({', '.join(sorted({d.reason.split(' (')[0] for d in plan.dropped}))})")
        raise UsageError(f"{printable(str(inv.path))}: {what}")
    target = Path(out) if out is not None else writer.default_target(plan, inv.path)
    noted = len(plan.notes)
    copyable = writers.copyable(plan, out)  # asked before a writer's prepare changes the plan
    try:
        job = writer.prepare(plan, target)
    except UsageError as exc:
        if str(inv.path) in str(exc):
            raise
        raise UsageError(f"{printable(str(inv.path))}: {exc}") from exc
    # Nothing to slim and no smaller rewrite: the input byte for byte, never a rewrite of
    # the same tensors that is larger (issue 18); and never an output named as another
    # format than the one written.
    copy = writers.for_plan(plan, job.predicted_bytes) if copyable else None
    if copy is not None:
        del plan.notes[noted:]  # what the rewrite would have done
        writer = copy
        target = Path(out) if out is not None else writer.default_target(plan, inv.path)
        job = writer.prepare(plan, target)
    writers.check_name(writer, target)
    output = Output(target, directory=job.directory, force=force,
                    inputs=tuple(f.path for f in inv.files))
    stored = plan.output_bytes()  # tensor bytes the output holds (one pass, no source made)
    output.check(job.files, needed=job.predicted_bytes if job.predicted_bytes else stored)
    if dry_run:
        return _report(plan, writer.name, target, job.predicted_bytes, {}, None, (), dry=True)
    meter = Meter(stored, progress)
    written: list[Mapping[str, Written]] = [{}]

    def write(o: Output) -> None:
        written[0] = job.write(o, meter)

    own_check = getattr(job, "verify", None)  # a copy checks its files' CRC-32 itself

    def check(staged: Path) -> Inventory:
        try:
            out: Inventory = (own_check(staged) if own_check is not None
                              else verify(plan, job, written[0], staged, output.early_crcs))
        except LimitError as exc:
            # Named as OUT, never as its hidden staging path.
            raise LimitError(target, f"reading the output back to verify it: {exc.reason}",
                             exc.env) from None
        return out

    out_inv = write_verified(output, write, check, main=job.main)
    base = target if job.directory else target.parent
    files = tuple((base / name, (base / name).stat().st_size) for name in job.files)
    predicted = job.predicted_bytes
    if isinstance(out_inv, LazyInventory):
        # Verified without reading its records: they are read from OUT if ever asked for.
        out_inv = out_inv.relabel(tuple(FileInfo(p, n) for p, n in files), target,
                                  functools.partial(formats.read, target))
    sources = getattr(plan.row(0), "_source", None) if len(plan) else None
    if isinstance(sources, Sources):
        sources.forget()  # the map of storages served the writer
    return _report(plan, writer.name, target, predicted, written[0], out_inv, files)


def _graph_slim(inv: Inventory, options: SlimOptions) -> bool:
    """Whether the graph passes slim this input (ONNX kept as ONNX, the ``onnx`` package
    installed; without it, the wire-level writer does what it can unless a quantization
    needs the passes)."""
    if inv.format != "onnx" or options.to != "same":
        return False
    if options.quantize is None and (not options.graph or options.keep
                                     or options.drop is not None
                                     or options.cast not in (None, "float16")):
        return False
    try:
        import onnx  # noqa: F401  (an optional dependency: only its presence matters here)
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        if options.quantize is None:
            return False
        raise MissingDependencyError("onnx and onnxruntime", "--quantize on ONNX models",
                                     "onnx") from exc
    return True


def _report(plan: Plan, fmt: str, target: Path, predicted: int | None,
            written: Mapping[str, Written], out_inv: Inventory | None,
            files: tuple[tuple[Path, int], ...], dry: bool = False) -> SlimReport:
    copied = fmt == "copy"
    kept = KeptTable(plan, written, copied)
    notes = list(plan.notes)
    if copied:
        if plan.container:  # the copy keeps the checkpoint's names
            notes = [n for n in notes if not n.startswith("tensors renamed")]
        notes.insert(0, "nothing to slim: every tensor is kept as it is, so the output is a "
                     "byte-for-byte copy of the input (a rewrite could only be larger)")
    notes += unsafe_note(plan, copied)
    if out_inv is not None and not copied:
        notes += growth_notes(plan, fmt, out_inv)
    overflow = [k for k in kept.with_errors() if k.overflow]
    if overflow:
        notes.append(f"{len(overflow)} tensor(s) had values out of range for "
                     f"{overflow[0].dtype}: they became infinity "
                     f"({', '.join(k.name for k in overflow[:3])})")
    return SlimReport(
        source=plan.inventory, target=target,
        output_format=(out_inv.format if out_inv is not None else
                       plan.inventory.format if copied else fmt), dry_run=dry,
        predicted_bytes=predicted, kept=kept, dropped=DroppedTable(plan.dropped),
        notes=tuple(notes), output=out_inv, output_files=files,
        verified=out_inv is not None, copied=copied,
    )
