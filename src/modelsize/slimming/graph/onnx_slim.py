"""ONNX slim with graph passes: load, pass, write staged, run both models, commit.

The model is loaded without its external data (``load_external_data=False``): external tensors
stay where they are until written, copied a chunk at a time into ``OUT.data``, back to back
(no alignment padding, which would make the output larger than its input; two tensors on the
same bytes keep sharing them). New tensors a pass makes (folded weights) go to the data
file too when the input had one. The output is verified by running the original and the staged
output on the same seeded inputs (:mod:`.verify_onnx`); outputs too far apart mean nothing is
committed and the slim fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from modelsize import formats
from modelsize.errors import CorruptFileError, VerificationError, printable
from modelsize.formats.onnx import ONNX_DTYPES
from modelsize.inventory import Inventory
from modelsize.slimming.graph import onnx_passes as passes
from modelsize.slimming.graph.verify_onnx import Comparison, compare
from modelsize.slimming.output import Output, write_verified
from modelsize.slimming.plan import SlimOptions
from modelsize.slimming.result import Dropped, KeptTensor, SlimReport
from modelsize.slimming.writers.base import slim_name

MAX_PROTO = (1 << 31) - (1 << 20)
_CHUNK = 1 << 22


@dataclass(frozen=True)
class GraphSlimReport(SlimReport):
    """A :class:`SlimReport` with the graph passes run and the outputs compared."""

    passes: tuple[passes.PassResult, ...] = ()
    comparison: Comparison | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: the slim report plus ``passes`` and ``outputs_compared``."""
        out = super().to_dict()
        out["passes"] = [p.to_dict() for p in self.passes]
        out["outputs_compared"] = None if self.comparison is None else self.comparison.to_dict()
        return out


def _load(path: Path) -> Any:
    import onnx

    try:
        return onnx.load_model(str(path), load_external_data=False)
    except Exception as exc:  # protobuf DecodeError and friends: the file is at fault
        raise CorruptFileError(path, "onnx", f"onnx cannot parse it ({exc})") from exc


def _check_locations(model: Any, path: Path) -> bool:
    """Whether the model has external data; refuses locations outside its folder."""
    found = False
    for t in passes.all_tensors(model.graph):
        ext = passes.external_info(t)
        if ext is None:
            continue
        loc = ext.get("location", "")
        p = PurePosixPath(loc)
        if not loc or p.is_absolute() or ".." in p.parts:
            raise CorruptFileError(path, "onnx", f"tensor {printable(t.name)!r} points at "
                                   f"external data {printable(loc)!r} outside the model's folder")
        found = True
    try:
        passes.external_sources(model, path.parent)
    except ValueError as exc:
        raise CorruptFileError(path, "onnx", str(exc)) from exc
    return found


def _copy_range(src: Path, offset: int, length: int, out: Any) -> None:
    with open(src, "rb") as fh:
        fh.seek(offset)
        left = length
        while left > 0:
            chunk = fh.read(min(left, _CHUNK))
            if not chunk:
                raise OSError(f"{src}: ends before the tensor's {length} bytes")
            out.write(chunk)
            left -= len(chunk)


def _write(model: Any, base_dir: Path, out: Output, main: str, data_name: str | None) -> None:
    """The model file and, with ``data_name``, every external or large new tensor into it."""
    import onnx

    if data_name is not None:
        fh = out.open(data_name)
        pos = 0
        placed: dict[tuple[str, int, int], int] = {}
        for t in passes.all_tensors(model.graph):
            ext = passes.external_info(t)
            if ext is not None:
                key = (ext.get("location", ""), int(ext.get("offset", 0) or 0),
                       int(ext.get("length", 0) or 0))
                length = key[2]
                offset = placed.get(key)
                if offset is None:
                    _copy_range(base_dir / key[0], key[1], length, fh)
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


def _kept(model: Any) -> tuple[KeptTensor, ...]:
    out = []
    for t in model.graph.initializer:
        dtype = ONNX_DTYPES.get(t.data_type, str(t.data_type))
        ext = passes.external_info(t)
        nbytes = int(ext.get("length", 0) or 0) if ext is not None else t.ByteSize()
        out.append(KeptTensor(t.name, t.name, dtype, dtype, tuple(t.dims), nbytes))
    return tuple(out)


def slim_onnx(inv: Inventory, out: str | Path | None, options: SlimOptions, *,
              dry_run: bool, force: bool) -> GraphSlimReport:
    """Graph passes on the ONNX model of ``inv``, written to ``out`` and verified."""
    path = inv.files[0].path
    target = Path(out) if out is not None else slim_name(inv.path)
    model = _load(path)
    external = _check_locations(model, path)
    names = passes.select(options.cast, options.quantize)
    model, results = passes.run_passes(model, path.parent, names)
    applied = [r.name for r in results if r.applied]
    kind = next((n.value for n in reversed(applied) if n in passes.APPROXIMATE), "exact")
    external = external or passes.model_bytes(model) > MAX_PROTO
    data_name = f"{target.name}.data" if external else None
    output = Output(target, force=force, inputs=tuple(f.path for f in inv.files))
    output.check([target.name, *([data_name] if data_name else [])])
    kept = _kept(model)
    out_names = {k.name for k in kept}
    why = "removed or replaced (folded, merged, quantized) by the graph passes"
    dropped = tuple(Dropped(t.name, t.category, t.stored_nbytes, why)
                    for t in inv.tensors if t.name not in out_names)
    notes: list[str] = []
    if options.drop is not None or options.keep:
        notes.append("--drop and --keep do not apply to graph passes (use --no-graph)")
    common: dict[str, Any] = dict(source=inv, target=target, output_format="onnx",
                                  kept=kept, dropped=dropped, passes=tuple(results))
    if dry_run:
        return GraphSlimReport(dry_run=True, predicted_bytes=passes.model_bytes(model),
                               notes=tuple(notes), **common)
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

    cmp, out_inv = write_verified(
        output, lambda o: _write(model, path.parent, o, target.name, data_name), verify,
        main=target.name)
    files = tuple((target.parent / n, (target.parent / n).stat().st_size)
                  for n in [target.name, *([data_name] if data_name else [])])
    return GraphSlimReport(dry_run=False, predicted_bytes=passes.model_bytes(model),
                           notes=tuple(notes), output=out_inv, output_files=files,
                           verified=True, comparison=cmp, **common)
