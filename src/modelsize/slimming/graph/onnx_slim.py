"""ONNX slim with graph passes: load, pass, write staged, run both models, commit.

The model is loaded without its external data (``load_external_data=False``): external tensors
stay where they are until written. The output's layout is chosen for the output, not copied
from the input (:class:`ExternalData`): by default one self-contained file whenever the model
fits under protobuf's 2 GB limit (what onnxslim and onnx-simplifier write, and smaller: an
external tensor costs its location, offset and length), ``OUT.data`` beside it only when it
does not. In ``OUT.data`` tensors of :data:`~.onnx_passes.EXTERNAL_MIN` bytes and more lie back
to back, copied a chunk at a time (no alignment padding, which would make the output larger
than its input; two tensors on the same bytes keep sharing them). A one-file output that
replaces (``--force``) an output whose ``OUT.data`` it no longer needs removes that file once
committed, so no orphan is left. The output is verified by running the original and the
staged output on the same seeded inputs (:mod:`.verify_onnx`); outputs too far apart mean
nothing is committed and the slim fails.
"""

from __future__ import annotations

import contextlib
import tempfile
from enum import Enum
from pathlib import Path, PurePosixPath
from typing import Any

from modelsize import formats, inputs
from modelsize.errors import CorruptFileError, UsageError, VerificationError, printable
from modelsize.formats.base import real_path
from modelsize.formats.onnx import ONNX_DTYPES
from modelsize.inventory import Inventory
from modelsize.slimming.graph.report import Comparison, GraphSlimReport
from modelsize.slimming.output import Output, write_verified
from modelsize.slimming.plan import SlimOptions
from modelsize.slimming.result import Dropped, KeptTensor
from modelsize.slimming.writers._protowire import varint
from modelsize.slimming.writers.base import slim_name

#: The largest one-file output: protobuf's 2 GiB limit less a 1 MiB margin.
MAX_PROTO = (1 << 31) - (1 << 20)
_CHUNK = 1 << 22


class ExternalData(str, Enum):
    """Where the output's tensors go (``--external-data``)."""

    AUTO = "auto"
    """One file when the model fits under :data:`MAX_PROTO`, ``OUT.data`` when it does not."""
    ALWAYS = "always"
    """``OUT.data`` for every tensor of ``EXTERNAL_MIN`` bytes and more."""
    NEVER = "never"
    """One file; a model over :data:`MAX_PROTO` is refused."""

    def __str__(self) -> str:
        return self.value


def choose_layout(choice: ExternalData, nbytes: int, path: Path) -> bool:
    """Whether the output of ``nbytes`` (its proto and data together) gets a data file."""
    if choice == ExternalData.ALWAYS:
        return True
    if nbytes <= MAX_PROTO:
        return False
    if choice == ExternalData.NEVER:
        raise UsageError(f"{printable(str(path))}: the slimmed model is {nbytes:,} bytes, over "
                         f"the {MAX_PROTO:,} one protobuf file can hold; use --external-data "
                         "auto or always")
    return True


def _load(path: Path) -> Any:
    import onnx

    try:
        return onnx.load_model(str(path), load_external_data=False)
    except Exception as exc:  # protobuf DecodeError and friends: the file is at fault
        raise CorruptFileError(path, "onnx", f"onnx cannot parse it ({exc})") from exc


def _load_checked(path: Path) -> Any:
    """The model at ``path`` (without external data), its external locations checked."""
    model = _load(path)
    _check_locations(model, path)
    return model


def _check_locations(model: Any, path: Path) -> None:
    """Refuses external data outside the model's folder or shorter than its tensors."""
    from modelsize.slimming.graph import onnx_passes as passes

    for t in passes.all_tensors(model.graph):
        ext = passes.external_info(t)
        if ext is None:
            continue
        loc = ext.get("location", "")
        p = PurePosixPath(loc)
        if not loc or p.is_absolute() or ".." in p.parts:
            raise CorruptFileError(path, "onnx", f"tensor {printable(t.name)!r} points at "
                                   f"external data {printable(loc)!r} outside the model's folder")
    try:
        passes.external_sources(model, path.parent)
    except ValueError as exc:
        raise CorruptFileError(path, "onnx", str(exc)) from exc


def _copy_range(src: Path, offset: int, length: int, out: Any) -> None:
    """``length`` bytes of ``src`` from ``offset`` to ``out``, through one reused buffer."""
    view = memoryview(bytearray(min(length, _CHUNK)))
    with inputs.open_input(src, buffering=0) as fh:
        fh.seek(offset)
        left = length
        while left > 0:
            n = fh.readinto(view[:min(left, len(view))])
            if not n:
                raise OSError(f"{src}: ends before the tensor's {length} bytes")
            out.write(view[:n])
            left -= n


def _external_range(ext: dict[str, str], base_dir: Path) -> tuple[Path, int, int]:
    """File, offset and length of an external tensor (no ``length``: to the end of the file)."""
    src = base_dir / ext.get("location", "")
    offset = int(ext.get("offset", 0) or 0)
    if "length" not in ext:
        return src, offset, max(0, src.stat().st_size - offset)
    return src, offset, int(ext["length"] or 0)


def _read_range(src: Path, offset: int, length: int) -> bytes:
    with inputs.open_input(src) as fh:
        fh.seek(offset)
        data = fh.read(length)
    if len(data) != length:
        raise OSError(f"{src}: ends before the tensor's {length} bytes")
    return data


def _inline(t: Any, src: Path, offset: int, length: int) -> None:
    """An external tensor's bytes read into the tensor itself."""
    t.raw_data = _read_range(src, offset, length)
    del t.external_data[:]
    t.ClearField("data_location")


def _write_one_file(model: Any, base_dir: Path, fh: Any) -> None:
    """The model as one protobuf file, a weight at a time: the model and its graph without
    their initializers, then each initializer, its bytes streamed from memory or from its
    external file. Protobuf reads a message's fields in any order, so the initializers may
    follow the rest of the graph; the file has the size ``SerializeToString`` would give,
    without the weights ever held twice (or, from external data, at all)."""
    import onnx

    from modelsize.slimming.graph import onnx_passes as passes

    top = {id(t) for t in model.graph.initializer}
    for t in passes.all_tensors(model.graph):  # in attributes and subgraphs: small, inlined
        ext = passes.external_info(t)
        if ext is not None and id(t) not in top:
            _inline(t, *_external_range(ext, base_dir))
    parts: list[tuple[bytes, Any, tuple[Path, int, int] | None, int]] = []
    for t in model.graph.initializer:
        header = passes.copy_except(t, onnx.TensorProto(), "raw_data", "external_data",
                                    "data_location").SerializeToString()
        ext = passes.external_info(t)
        where = _external_range(ext, base_dir) if ext is not None else None
        raw = next((len(v) for fd, v in t.ListFields() if fd.name == "raw_data"), None)
        length = where[2] if where is not None else raw
        size = len(header) + (passes.field_bytes(length) if length is not None else 0)
        parts.append((header, t, where, size))
    graph = passes.copy_except(model.graph, onnx.GraphProto(), "initializer").SerializeToString()
    fh.write(passes.copy_except(model, onnx.ModelProto(), "graph").SerializeToString())
    fh.write(b"\x3a" + varint(len(graph) + sum(passes.field_bytes(p[3]) for p in parts)))
    fh.write(graph)  # ModelProto.graph is field 7, GraphProto.initializer 5, raw_data 9
    for header, t, where, size in parts:
        fh.write(b"\x2a" + varint(size) + header)
        if where is not None:
            fh.write(b"\x4a" + varint(where[2]))
            _copy_range(*where, fh)
        elif len(header) < size:
            data = t.raw_data
            fh.write(b"\x4a" + varint(len(data)) + data)
            del data


def _write(model: Any, base_dir: Path, out: Output, main: str, data_name: str | None) -> None:
    """The model file and, with ``data_name``, every tensor of ``EXTERNAL_MIN`` bytes and more
    in that data file; without, every tensor in the one file."""
    import onnx

    from modelsize.slimming.graph import onnx_passes as passes

    if data_name is None:
        _write_one_file(model, base_dir, out.open(main))
        return
    fh = out.open(data_name)
    pos = 0
    placed: dict[tuple[str, int, int], int] = {}
    for t in passes.all_tensors(model.graph):
        ext = passes.external_info(t)
        if ext is not None:
            src, start, length = _external_range(ext, base_dir)
            if length < passes.EXTERNAL_MIN:
                _inline(t, src, start, length)
                continue
            key = (str(src), start, length)
            offset = placed.get(key)
            if offset is None:
                _copy_range(src, start, length, fh)
                offset = placed[key] = pos
                pos += length
        elif t.HasField("raw_data") and len(t.raw_data) >= passes.EXTERNAL_MIN:
            data = t.raw_data
            length = len(data)
            fh.write(data)
            offset = pos
            pos += length
            t.ClearField("raw_data")
        else:
            continue
        del t.external_data[:]
        for k, v in (("location", data_name), ("offset", str(offset)),
                     ("length", str(length))):
            entry = t.external_data.add()
            entry.key, entry.value = k, v
        t.data_location = onnx.TensorProto.EXTERNAL
    out.open(main).write(model.SerializeToString())


def _stale_data(target: Path, inputs: tuple[Path, ...]) -> Path | None:
    """``OUT.data`` when the ``OUT`` a one-file output replaces reads it and no input does:
    it would be left orphaned."""
    from modelsize.slimming.graph import onnx_passes as passes

    data = target.parent / f"{target.name}.data"
    if not target.is_file() or not data.is_file() or any(
            real_path(data) == real_path(p, must_exist=False) for p in inputs):
        return None
    try:
        old = _load(target)
    except CorruptFileError:
        return None
    for t in passes.all_tensors(old.graph):
        ext = passes.external_info(t)
        if ext is not None and real_path(target.parent / ext.get("location", ""),
                                        must_exist=False) == real_path(data):
            return data
    return None


def _kept_dropped(inv: Inventory, out: Inventory | None,
                  model: Any) -> tuple[tuple[KeptTensor, ...], tuple[Dropped, ...]]:
    """The output's tensors and the input's tensors it does not have, both as the ONNX
    reader names them (initializers, ``Constant`` values, subgraphs' tensors); without the
    output's inventory (a dry run of a model with external data), the initializers of
    ``model``'s main graph."""
    why = "removed or replaced (folded, merged, quantized) by the graph passes"
    if out is None:
        kept = _kept(model)
    else:
        kept = tuple(KeptTensor(t.name, t.name, t.dtype, t.dtype, tuple(t.shape),
                                t.stored_nbytes) for t in out.tensors)
    names = {k.name for k in kept}
    dropped = tuple(Dropped(t.name, t.category, t.stored_nbytes, why)
                    for t in inv.tensors if t.name not in names)
    return kept, dropped


def _predicted_inventory(model: Any, predicted: int) -> Inventory | None:
    """The inventory of ``model`` as it would be written in one file, read from a temporary
    copy; ``None`` when it keeps external data or would not fit in one."""
    from modelsize.slimming.graph import onnx_passes as passes

    if predicted > MAX_PROTO or any(passes.external_info(t) is not None
                                         for t in passes.all_tensors(model.graph)):
        return None
    with tempfile.TemporaryDirectory(prefix="modelsize-dry-") as tmp:
        path = Path(tmp) / "model.onnx"
        path.write_bytes(model.SerializeToString())
        return formats.read(path)


def _kept(model: Any) -> tuple[KeptTensor, ...]:
    from modelsize.slimming.graph import onnx_passes as passes
    out = []
    for t in model.graph.initializer:
        dtype = ONNX_DTYPES.get(t.data_type, str(t.data_type))
        ext = passes.external_info(t)
        nbytes = int(ext.get("length", 0) or 0) if ext is not None else t.ByteSize()
        out.append(KeptTensor(t.name, t.name, dtype, dtype, tuple(t.dims), nbytes))
    return tuple(out)


def slim_onnx(inv: Inventory, out: str | Path | None, options: SlimOptions, *,
              dry_run: bool, force: bool,
              external_data: ExternalData | str = ExternalData.AUTO) -> GraphSlimReport:
    """Graph passes on the ONNX model of ``inv``, written to ``out`` and verified;
    ``external_data`` chooses the output's layout (:class:`ExternalData`)."""
    from modelsize.slimming.graph import onnx_passes as passes
    from modelsize.slimming.graph.verify_onnx import compare

    try:
        layout = ExternalData(external_data)
    except ValueError:
        raise UsageError(f"--external-data {external_data!r}: expected one of "
                         f"{', '.join(e.value for e in ExternalData)}") from None
    from modelsize.slimming.loadable import refuse_unloadable

    refuse_unloadable(inv)  # what onnxruntime refuses whatever the passes, said as that
    path = inv.files[0].path
    target = Path(out) if out is not None else slim_name(inv.path)
    names = passes.select(options.cast, options.quantize)
    # The loaded model is a temporary: a pass that replaces it frees it.
    model, results = passes.run_passes(_load_checked(path), path.parent, names)
    applied = [r.name for r in results if r.applied]
    kind = next((n.value for n in reversed(applied) if n in passes.APPROXIMATE), "exact")
    predicted = passes.model_bytes(model)
    external = choose_layout(layout, predicted, target)
    data_name = f"{target.name}.data" if external else None
    output = Output(target, force=force, inputs=tuple(f.path for f in inv.files))
    output.check([target.name, *([data_name] if data_name else [])], needed=predicted)
    stale = None if external else _stale_data(target, tuple(f.path for f in inv.files))
    notes: list[str] = []
    if options.drop is not None or options.keep:
        notes.append("--drop and --keep do not apply to graph passes (use --no-graph)")
    common: dict[str, Any] = dict(source=inv, target=target, output_format="onnx",
                                  passes=tuple(results))
    if dry_run:
        kept, dropped = _kept_dropped(inv, _predicted_inventory(model, predicted), model)
        return GraphSlimReport(dry_run=True, predicted_bytes=predicted, kept=kept,
                               dropped=dropped, notes=tuple(notes), **common)
    if not applied:
        notes.append("no graph pass made the model smaller: the output is the same graph")

    def verify(staged: Path) -> tuple[Comparison, Inventory]:
        cmp = compare(path, staged, kind, options.tolerance)
        if not cmp.ok:
            worst = max(cmp.outputs, key=lambda o: o.max_rel)
            raise VerificationError(
                f"{printable(str(inv.path))}: the slimmed model's output "
                f"{printable(worst.name)!r} differs by {worst.max_rel:.3g} relative "
                f"({worst.max_abs:.3g} absolute), over the {kind} tolerance "
                f"{cmp.tolerance:g}; nothing was written (--tolerance raises the bound)")
        return cmp, formats.read(staged)

    box = [model]
    del model

    def write(o: Output) -> None:
        # The model goes once written: both models run in onnxruntime next.
        _write(box.pop(), path.parent, o, target.name, data_name)

    cmp, out_inv = write_verified(output, write, verify, main=target.name)
    if stale is not None:
        with contextlib.suppress(OSError):
            stale.unlink()
    files = tuple((target.parent / n, (target.parent / n).stat().st_size)
                  for n in [target.name, *([data_name] if data_name else [])])
    kept, dropped = _kept_dropped(inv, out_inv, None)
    return GraphSlimReport(dry_run=False, predicted_bytes=predicted, kept=kept,
                           dropped=dropped, notes=tuple(notes), output=out_inv,
                           output_files=files, verified=True, comparison=cmp, **common)
