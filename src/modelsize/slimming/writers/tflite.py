"""TensorFlow Lite output: the input's flatbuffer, rewritten table by table.

The whole flatbuffer is read into a tree with TFLite's schema (:mod:`._tflite_schema`; a field
or union type the schema does not know is refused, not guessed at) and written back with
:class:`~._flatbuffers.Builder`: every table, option and string as it was, the buffers'
bytes last, each aligned to 16 bytes as the converter writes them (``force_align: 16``),
streamed from the input (never the whole model in memory). What changes:

* **dedupe**: a tensor whose bytes duplicate another's points to the other's buffer, and its own
  buffer goes (``--dedupe``, and the default slim);
* **unused buffers** (no tensor and no metadata entry names them) go; buffer 0, the empty
  sentinel, stays; the buffers left are renumbered in their input order;
* **metadata**: ``--drop metadata`` drops the model's metadata entries (``Model.metadata``,
  ``metadata_buffer``) and their buffers, but those a ``--keep GLOB`` names; TFLite Support's
  associated files (a zip appended after the flatbuffer) go with ``TFLITE_METADATA``; other
  bytes after the flatbuffer are kept as they are;
* **--cast float16** does what TensorFlow's float16 post-training quantization
  (``optimizations=[DEFAULT]``, ``supported_types=[float16]``) writes: each float32 constant
  becomes a float16 tensor (same index, same name, a float16 buffer), a new float32 tensor
  takes its place as the input of every operator that read it (and as subgraph or signature
  output), and a ``DEQUANTIZE`` operator at the start of the subgraph computes it; the
  ``DEQUANTIZE`` operator code (version 3: float16 input) is added to ``operator_codes``,
  ``min_runtime_version`` is raised to 1.15.0 and ``reduced_precision_support`` is
  ``fp16accfp32``, as the converter sets them. Constants that are variables, sparse,
  quantized or referenced by other tensors' quantization stay float32 (with a note); float64
  and bfloat16 have no TFLite dequantization, so ``--cast`` names only ``float16``.

A flatbuffer cannot pass 2 GB: when the output would, every buffer's bytes follow the
flatbuffer and ``Buffer.offset``/``size`` point to them (schema 3c), as the converter does
for large models; an input written so is written so. Nothing else moves: subgraphs,
operators and tensors keep their order and indices (operators refer to them by index).

When nothing changes (no duplicate, no unused buffer, nothing dropped or cast), the output is
the input, copied byte for byte. Verification reads the output back with modelsize's own
reader (every constant's name, dtype, shape and CRC-32); the tests run both models in the
TFLite interpreter.
"""

from __future__ import annotations

import fnmatch
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from modelsize.errors import CorruptFileError, UsageError, printable
from modelsize.formats import tflite as tflite_format
from modelsize.inventory import Inventory
from modelsize.slimming.loadable import refuse_unloadable
from modelsize.slimming.output import Output
from modelsize.slimming.plan import Plan, PlannedTensor
from modelsize.slimming.source import FileRange
from modelsize.slimming.verify import crc_of
from modelsize.slimming.writers import _flatbuffers as fb
from modelsize.slimming.writers._tflite_schema import SCHEMA
from modelsize.slimming.writers.base import Meter, Written, output_nbytes, slim_name, stream

#: ``BuiltinOperator.DEQUANTIZE``; version 3 takes float16 input.
DEQUANTIZE = 6
DEQUANTIZE_FLOAT16_VERSION = 3
#: ``TensorType``.
FLOAT32, FLOAT16 = 0, 1
#: What TensorFlow's float16 quantization writes into the model's metadata.
MIN_RUNTIME_VERSION = "min_runtime_version"
FLOAT16_RUNTIME = (1, 15, 0)
REDUCED_PRECISION = "reduced_precision_support"
REDUCED_PRECISION_FP16 = b"fp16accfp32"
#: TFLite Support's metadata, whose associated files are a zip appended to the model.
SUPPORT_METADATA = "TFLITE_METADATA"
#: What ``--drop`` names to drop metadata entries.
DROP_METADATA = "metadata"
#: Where a flatbuffer must switch to buffers after it (a margin under the 2 GB limit).
OFFSET_MODE_BYTES = fb.MAX_FLATBUFFER - (64 << 20)

#: Write the input as it is when the plan changes nothing (tests turn it off to have every
#: table rewritten).
COPY_WHEN_UNCHANGED = True

_RAW, _HALF = "raw", "float16"
_COPY_STEP = 64 << 20
#: Quantization details that name other tensors (their scales, zero points) by index.
_TENSOR_REFS = frozenset({"BlockwiseQuantization", "MultiAxisQuantization"})


@dataclass
class TfliteJob:
    """One ``.tflite`` file, laid out to the byte before anything is written."""

    files: list[str]
    main: str
    directory: bool
    predicted_bytes: int | None
    source: Path
    inventory: Inventory
    layout: fb.Layout | None = None
    #: Stored tensors that read back from the bytes another one streamed: name -> that name.
    sharers: dict[str, str] = field(default_factory=dict)
    #: Stored tensors whose buffer is copied as it is: name -> planned tensor.
    copied: dict[str, PlannedTensor] = field(default_factory=dict)
    #: Everything written as it is (nothing changed): the planned stored tensors.
    verbatim: list[PlannedTensor] | None = None

    def write(self, out: Output, meter: Meter) -> dict[str, Written]:
        """Stream the layout's pieces (or the whole input, when nothing changes)."""
        fh = out.open(self.main)
        written: dict[str, Written] = {}
        if self.verbatim is not None:
            _copy(FileRange(self.source, 0, self.predicted_bytes or 0), fh)
            for t in self.verbatim:
                written[t.name] = Written(*crc_of(self.inventory, t.record))
                meter.advance(written[t.name].nbytes)
        else:
            assert self.layout is not None
            for piece in self.layout.stream():
                if isinstance(piece, fb.Data):
                    self._data(fh, piece, meter, written)
                else:
                    fh.write(piece)
            for name, t in self.copied.items():
                written[name] = Written(*crc_of(self.inventory, t.record))
                meter.advance(written[name].nbytes)
            for name, streamed in self.sharers.items():
                written[name] = written[streamed]
        fh.flush()
        if self.predicted_bytes is not None and fh.tell() != self.predicted_bytes:
            raise ValueError(f"wrote {fh.tell()} bytes, laid out {self.predicted_bytes}")
        return written

    def _data(self, fh: BinaryIO, piece: fb.Data, meter: Meter,
              written: dict[str, Written]) -> None:
        src = piece.source
        if isinstance(src, PlannedTensor):
            s = stream(src, meter)
            n = s.write_to(fh)
            written[src.name] = s.written
        elif isinstance(src, FileRange):
            n = _copy(src, fh)
        else:
            fh.write(src)
            n = len(src)
        if n != piece.nbytes:
            raise ValueError(f"a buffer laid out as {piece.nbytes} bytes streamed {n}")

    def output_name(self, name: str) -> str:
        """Tensor names are kept as they are."""
        return name


def _copy(src: FileRange, fh: BinaryIO) -> int:
    """Copy a range of the input at ``fh``'s position, in the kernel where it can."""
    fh.flush()
    start = fh.tell()
    fd = os.open(src.path, os.O_RDONLY)
    try:
        pos, end = src.offset, src.offset + src.nbytes
        while pos < end:
            n = os.copy_file_range(fd, fh.fileno(), min(_COPY_STEP, end - pos), pos)
            if n <= 0:
                raise OSError(f"copy_file_range stopped at byte {pos}")
            pos += n
    except OSError:  # not between these file systems: through Python, a chunk at a time
        fh.seek(start)
        fh.truncate()
        for chunk in src.chunks():
            fh.write(chunk)
    finally:
        os.close(fd)
    fh.seek(start + src.nbytes)
    return src.nbytes


class TfliteWriter:
    """``.tflite`` (TFLite inputs only)."""

    name = "tflite"

    def default_target(self, plan: Plan, source: Path) -> Path:
        """``x.slim.tflite``."""
        return slim_name(source)

    def prepare(self, plan: Plan, target: Path) -> TfliteJob:
        """Rewrite the model's tree as the plan says and lay out every byte."""
        inv = plan.inventory
        if inv.format != "tflite" or len(inv.files) != 1:
            raise UsageError(f"the tflite writer writes TFLite inputs only, not {inv.format}")
        refuse_unloadable(inv)
        path = inv.files[0].path
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                root, end = fb.read(buf, SCHEMA, lazy=[("Buffer", "data")])
                consts = tflite_format.constants(buf)
            except fb.FlatbufferError as exc:
                raise CorruptFileError(path, "tflite", exc.reason, exc.offset) from exc
            except ValueError as exc:
                raise CorruptFileError(path, "tflite", str(exc)) from exc
            except fb.Unsupported as exc:
                raise UsageError(f"{printable(str(path))}: {exc}; slim cannot rewrite it "
                                 "without losing it") from exc
            rewrite = _Rewrite(plan, path, len(buf), root, end, consts)
            rewrite.run(buf)
        if not rewrite.changed and COPY_WHEN_UNCHANGED:
            # Nothing to drop or cast: the input is the output, byte for byte.
            return TfliteJob([target.name], target.name, False, rewrite.size, path, inv,
                             verbatim=list(plan.stored))
        layout = rewrite.layout()
        return TfliteJob([target.name], target.name, False, layout.size, path, inv, layout,
                         rewrite.sharers, rewrite.copied)


@dataclass(eq=False)
class _Request:
    """One output buffer: input buffer ``index`` as it is (``raw``) or cast (``float16``), or
    new bytes (``index`` -1)."""

    index: int
    variant: str = _RAW
    data: bytes | None = None


class _Rewrite:
    """The model's tree and what the plan does to it."""

    def __init__(self, plan: Plan, path: Path, size: int, root: fb.Table, end: int,
                 consts: list[tflite_format.Constant]) -> None:
        self.plan = plan
        self.path = path
        self.size = size
        self.root = root
        self.end = end
        self.input_end = end
        self.consts = {c.name: c for c in consts}
        self.subgraphs: list[fb.Table] = [sg.copy() for sg in root.get("subgraphs") or []]
        for sg in self.subgraphs:
            sg["tensors"] = [t.copy() for t in sg.get("tensors") or []]
            sg["operators"] = list(sg.get("operators") or [])
        self.buffers: list[fb.Table] = list(root.get("buffers") or [])
        self.offset_mode = False
        #: Input buffer -> (file offset, bytes) of its data (absent when it holds none).
        self.data: dict[int, tuple[int, int]] = {}
        for i, b in enumerate(self.buffers):
            data = b.get("data")
            if isinstance(data, fb.Data) and data.nbytes:
                self.data[i] = (int(data.source), data.nbytes)
            elif b.get("offset", 0) > 1 and b.get("size", 0):
                self.offset_mode = True
                self.data[i] = (b["offset"], b["size"])
                self.end = max(self.end, b["offset"] + b["size"])
        #: (subgraph, tensor) -> (input buffer, variant) for every tensor with a buffer.
        self.points: dict[tuple[int, int], tuple[int, str]] = {}
        for s, sg in enumerate(self.subgraphs):
            for k, t in enumerate(sg["tensors"]):
                self.points[(s, k)] = (t.get("buffer", 0), _RAW)
        self.metadata: list[tuple[fb.Table, _Request]] = [
            (m, _Request(m.get("buffer", 0))) for m in root.get("metadata") or []]
        self.metadata_buffer = list(root.ints("metadata_buffer"))
        self.opcodes = list(root.get("operator_codes") or [])
        self.sharers: dict[str, str] = {}
        self.copied: dict[str, PlannedTensor] = {}
        self.changed = False
        #: Input buffers whose bytes the output replaces (``min_runtime_version``).
        self.replaced: set[int] = set()
        self.drop_tail = False
        self.tail_data: fb.Data | None = None
        #: Output buffers in order, and (input buffer, variant) -> output buffer.
        self.order: list[_Request] = []
        self.requests: dict[tuple[int, str], int] = {}

    # -- what the plan asks -----------------------------------------------------------------
    def run(self, buf: Any) -> None:
        """Apply the plan to the tree (``buf``: the input, for the tail)."""
        plan = self.plan
        self._refuse_drops()
        by_name = {t.name: t for t in plan.tensors}
        for t in plan.tensors:
            if t.alias_of is None:
                continue
            copy, original = self._const(t), self._const(by_name[t.alias_of])
            target = self.points[(original.subgraph, original.index)][0]
            if target != copy.buffer:
                self.points[(copy.subgraph, copy.index)] = (target, _RAW)
                self.changed = True
        self._cast()
        self._metadata()
        self._renumber()
        self._tail(buf)

    def _const(self, t: PlannedTensor) -> tflite_format.Constant:
        const = self.consts.get(t.record.name)
        if const is None:
            raise ValueError(f"{t.record.name} is not a constant of {self.path.name}")
        return const

    def _refuse_drops(self) -> None:
        if self.plan.dropped:
            d = self.plan.dropped[0]
            more = f" (and {len(self.plan.dropped) - 1} more)" if len(self.plan.dropped) > 1 else ""
            raise UsageError(
                f"{printable(str(self.path))}: {printable(d.record.name)}{more} would be dropped "
                f"({d.reason}), but a TFLite model's constants are read by its operators: "
                "slim cannot drop them (--dedupe, --cast float16 and --drop metadata apply)")

    def _cast(self) -> None:
        plan = self.plan
        cast = plan.options.cast
        wanted = [t for t in plan.tensors if t.cast]
        if not wanted:
            return
        if cast != "float16":
            raise UsageError(
                f"{printable(str(self.path))}: --cast {cast} would narrow "
                f"{len(wanted)} {wanted[0].record.dtype} constant(s), which TFLite cannot "
                "dequantize; --cast float16 writes float32 weights as float16 behind DEQUANTIZE "
                "operators (TensorFlow's float16 quantization)")
        by_name = {t.name: t for t in plan.tensors}
        skipped: dict[str, list[str]] = {}
        blocked = self._uncastable()
        for t in wanted:
            if t.alias_of is not None:
                continue
            const = self._const(t)
            reason = (f"{t.record.dtype} has no float16 dequantization in TFLite"
                      if t.record.dtype != "float32" else blocked.get(
                          (const.subgraph, const.index)))
            if reason is None and t.record.nbytes == 0:
                reason = "no elements (nothing to narrow)"
            if reason is not None:
                t.dtype = t.record.dtype
                skipped.setdefault(reason, []).append(t.name)
        for t in wanted:
            if t.alias_of is not None:
                t.dtype = by_name[t.alias_of].dtype
        cast_now = [t for t in plan.tensors if t.cast]
        for t in cast_now:
            const = self._const(t)
            key = (const.subgraph, const.index)
            self.points[key] = (self.points[key][0], _HALF)
        for reason, names in skipped.items():
            shown = ", ".join(printable(n) for n in names[:3])
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            plan.notes.append(f"{len(names)} constant(s) kept as they are ({shown}{more}): "
                              f"{reason}")
        if not cast_now:
            return
        self.changed = True
        self._dequantize(sorted({(c.subgraph, c.index)
                                 for c in (self._const(t) for t in cast_now)}))
        plan.notes.append(
            f"{len(cast_now)} float32 constant(s) stored as float16, each read through a "
            "DEQUANTIZE operator, as TensorFlow's float16 quantization writes them "
            "(min_runtime_version 1.15.0, reduced_precision_support fp16accfp32)")

    def _uncastable(self) -> dict[tuple[int, int], str]:
        """Constants that must stay as they are, and why."""
        out: dict[tuple[int, int], str] = {}
        for s, sg in enumerate(self.subgraphs):
            for k in sg.ints("inputs"):
                out[(s, k)] = "subgraph inputs"
            for op in sg["operators"]:
                for k in op.ints("outputs") + op.ints("intermediates"):
                    out[(s, k)] = "written by operators"
            for k, t in enumerate(sg["tensors"]):
                q = t.get("quantization")
                if t.get("is_variable"):
                    out[(s, k)] = "variables (their initial values)"
                elif t.get("sparsity") is not None:
                    out[(s, k)] = "sparse"
                elif q is not None and (q.get("scale") or q.get("details") is not None):
                    out[(s, k)] = "quantized"
                if t.get("type", FLOAT32) != FLOAT32 and (s, k) not in out:
                    out[(s, k)] = "not float32 in the graph"
                details = q.get("details") if q is not None else None
                if details is not None and details.schema.name in _TENSOR_REFS:
                    for ref in (details.get("scales", 0), details.get("zero_points", 0)):
                        if ref >= 0:
                            out[(s, ref)] = "scales of another tensor's quantization"
        return out

    def _dequantize(self, keys: list[tuple[int, int]]) -> None:
        """Float16 constants at their index; new float32 tensors read through DEQUANTIZE."""
        opcode = self._dequantize_opcode()
        by_subgraph: dict[int, list[int]] = {}
        for s, k in keys:
            by_subgraph.setdefault(s, []).append(k)
        for s, ks in by_subgraph.items():
            sg = self.subgraphs[s]
            tensors: list[fb.Table] = sg["tensors"]
            moved: dict[int, int] = {}
            ops: list[fb.Table] = []
            for k in ks:
                half = tensors[k]
                wide = fb.Table(half.schema, {
                    name: half.values[name] for name in ("shape", "shape_signature", "has_rank")
                    if name in half.values})
                wide["name"] = (half.get("name") or f"tensor{k}".encode()) + b"/dequantize"
                wide["type"] = FLOAT32
                half["type"] = FLOAT16
                moved[k] = len(tensors)
                self.points[(s, len(tensors))] = (0, _RAW)
                tensors.append(wide)
                op = fb.Table(SCHEMA.tables["Operator"])
                op["opcode_index"] = opcode
                op.set_ints("inputs", [k])
                op.set_ints("outputs", [moved[k]])
                ops.append(op)
            for i, op in enumerate(sg["operators"]):
                inputs = op.ints("inputs")
                if any(x in moved for x in inputs):
                    op = op.copy()
                    op.set_ints("inputs", [moved.get(x, x) for x in inputs])
                    sg["operators"][i] = op
            sg["operators"] = ops + sg["operators"]
            outputs = sg.ints("outputs")
            if any(x in moved for x in outputs):
                sg.set_ints("outputs", [moved.get(x, x) for x in outputs])
            self._signature_outputs(s, moved)

    def _signature_outputs(self, s: int, moved: dict[int, int]) -> None:
        sigs = self.root.get("signature_defs") or []
        new = []
        for sig in sigs:
            if sig.get("subgraph_index", 0) == s:
                sig = sig.copy()
                for side in ("inputs", "outputs"):
                    maps = []
                    for tm in sig.get(side) or []:
                        if tm.get("tensor_index", 0) in moved:
                            tm = tm.copy()
                            tm["tensor_index"] = moved[tm.get("tensor_index", 0)]
                        maps.append(tm)
                    if side in sig:
                        sig[side] = maps
            new.append(sig)
        if sigs:
            self.root = self.root.copy()
            self.root["signature_defs"] = new

    def _dequantize_opcode(self) -> int:
        for i, code in enumerate(self.opcodes):
            builtin = max(code.get("deprecated_builtin_code", 0), code.get("builtin_code", 0))
            if (builtin == DEQUANTIZE and not code.get("custom_code")
                    and code.get("version", 1) >= DEQUANTIZE_FLOAT16_VERSION):
                return i
        code = fb.Table(SCHEMA.tables["OperatorCode"])
        code["deprecated_builtin_code"] = DEQUANTIZE
        code["builtin_code"] = DEQUANTIZE
        code["version"] = DEQUANTIZE_FLOAT16_VERSION
        self.opcodes.append(code)
        return len(self.opcodes) - 1

    def _metadata(self) -> None:
        plan = self.plan
        names = [(m.get("name") or b"").decode("utf-8", "replace") for m, _ in self.metadata]
        if DROP_METADATA in (plan.options.drop or ()):
            keep = [(m, r) for (m, r), n in zip(self.metadata, names, strict=True)
                    if _kept(n, plan.options.keep)]
            gone = [n for n in names if not _kept(n, plan.options.keep)]
            if self.metadata_buffer and not _kept("metadata_buffer", plan.options.keep):
                gone.append("metadata_buffer")
                self.metadata_buffer = []
            if gone:
                self.changed = True
                self.metadata = keep
                self.drop_tail = SUPPORT_METADATA in gone
                plan.notes.append(f"metadata dropped: {printable(', '.join(gone), 200)}")
            else:
                plan.notes.append("--drop metadata: the model has no metadata entries "
                                  "that --keep does not name")
        if not any(self.points[k][1] == _HALF for k in self.points):
            return
        names = [(m.get("name") or b"").decode("utf-8", "replace") for m, _ in self.metadata]
        for (_, req), name in zip(self.metadata, names, strict=True):
            if name == MIN_RUNTIME_VERSION and req.index in self.data:
                raised = self._runtime_version(req.index)
                if raised is not None:
                    self.replaced.add(req.index)
                    req.index, req.data = -1, raised
        if REDUCED_PRECISION not in names:
            entry = fb.Table(SCHEMA.tables["Metadata"])
            entry["name"] = REDUCED_PRECISION.encode()
            self.metadata.append((entry, _Request(-1, data=REDUCED_PRECISION_FP16)))

    def _runtime_version(self, index: int) -> bytes | None:
        """``min_runtime_version`` raised to what float16 DEQUANTIZE needs (same length)."""
        offset, nbytes = self.data[index]
        fd = os.open(self.path, os.O_RDONLY)
        try:
            raw = os.pread(fd, min(nbytes, 64), offset)
        finally:
            os.close(fd)
        text = raw.split(b"\0", 1)[0].decode("ascii", "replace")
        try:
            version = tuple(int(p) for p in text.split("."))
        except ValueError:
            return None
        if version >= FLOAT16_RUNTIME:
            return None
        new = ".".join(map(str, FLOAT16_RUNTIME)).encode()
        return new + bytes(max(nbytes, 16) - len(new))

    # -- output -----------------------------------------------------------------------------
    def _tail(self, buf: Any) -> None:
        """Bytes after everything the flatbuffer reaches (TFLite Support's zip), when kept."""
        end = self.end
        for sg in self.subgraphs:
            for op in sg["operators"]:
                off = op.get("large_custom_options_offset", 0)
                n = op.get("large_custom_options_size", 0)
                if isinstance(off, int) and off > 1 and n:
                    end = max(end, off + n)
        left = self.size - end
        if left <= 0 or (left < 16 and not any(bytes(buf[end:self.size]))):
            return  # nothing, or the flatbuffer's own alignment padding
        if self.drop_tail:
            self.changed = True
            self.plan.notes.append(f"{left:,} bytes after the flatbuffer (TFLite Support's "
                                   "associated files) dropped with TFLITE_METADATA")
            return
        self.tail_data = fb.Data(left, 1, FileRange(self.path, end, left))

    def _renumber(self) -> None:
        """Which input buffers the output keeps (and cast), in their input order."""
        wanted: set[tuple[int, str]] = set(self.points.values())
        wanted |= {(r.index, _RAW) for _, r in self.metadata if r.index >= 0}
        wanted |= {(i, _RAW) for i in self.metadata_buffer}
        self.order = [_Request(0)]
        self.requests = {(0, _RAW): 0}
        for i in range(len(self.buffers)):
            for variant in (_RAW, _HALF):
                if (i, variant) in wanted and (i, variant) not in self.requests:
                    self.requests[(i, variant)] = len(self.order)
                    self.order.append(_Request(i, variant))
        self.order += [r for _, r in self.metadata if r.index < 0]
        dropped = [i for i in self.data if (i, _RAW) not in wanted and (i, _HALF) not in wanted
                   and i not in self.replaced]
        if dropped:
            self.changed = True
            nbytes = sum(self.data[i][1] for i in dropped)
            self.plan.notes.append(f"{len(dropped)} buffer(s) that no tensor or metadata entry "
                                   f"reads any more dropped ({nbytes:,} bytes)")

    def layout(self) -> fb.Layout:
        """The new tree, its buffers attached to their bytes, laid out."""
        stored = sum(n for _, n in self.data.values())
        total = sum(self.data.get(r.index, (0, 0))[1] if r.data is None else len(r.data)
                    for r in self.order)
        offset_mode = self.offset_mode or self.end - stored + total > OFFSET_MODE_BYTES
        sources = self._sources()
        model = self.root.copy()
        model["buffers"] = [self._buffer(r, sources, offset_mode) for r in self.order]
        model["operator_codes"] = self.opcodes
        for s, sg in enumerate(self.subgraphs):
            for k, t in enumerate(sg["tensors"]):
                index = self.requests[self.points[(s, k)]]
                if index != t.get("buffer", 0):
                    if index:
                        t["buffer"] = index
                    else:
                        t.pop("buffer")
            self._large_options(sg)
        model["subgraphs"] = self.subgraphs
        metadata = []
        for m, r in self.metadata:
            m = m.copy()
            m["buffer"] = (self.requests[(r.index, _RAW)] if r.index >= 0
                           else self.order.index(r))
            metadata.append(m)
        if metadata or "metadata" in model:
            model["metadata"] = metadata
        if self.metadata_buffer or "metadata_buffer" in model:
            model.set_ints("metadata_buffer",
                           [self.requests[(i, _RAW)] for i in self.metadata_buffer])
        return fb.Builder(SCHEMA).build(model, self.tail_data)

    def _large_options(self, sg: fb.Table) -> None:
        ops = sg["operators"]
        for j, op in enumerate(ops):
            off = op.get("large_custom_options_offset", 0)
            n = op.get("large_custom_options_size", 0)
            if isinstance(off, int) and off > 1 and n:
                data = fb.Data(n, 16, FileRange(self.path, off, n), external=True)
                op = op.copy()
                op["large_custom_options_offset"] = fb.DataOffset(data)
                op["large_custom_options_size"] = fb.DataSize(data)
                ops[j] = op

    def _sources(self) -> dict[tuple[int, str], tuple[PlannedTensor | None, int]]:
        """For each (input buffer, variant): the stored tensor that streams it, and bytes."""
        inv = self.plan.inventory
        storages = {st.key: st for st in inv.storages}
        out: dict[tuple[int, str], tuple[PlannedTensor | None, int]] = {}
        encoded: set[int] = set()
        users: dict[tuple[int, str], list[PlannedTensor]] = {}
        for t in self.plan.stored:
            const = self._const(t)
            key = self.points[(const.subgraph, const.index)]
            st = storages.get(t.record.storage or "")
            if st is not None and st.compressed:
                encoded.add(key[0])
            users.setdefault(key, []).append(t)
        for key, ts in users.items():
            if key[0] in encoded:
                out[key] = (None, self.data[key[0]][1])
                for t in ts:
                    self.copied[t.name] = t
                continue
            best = max(ts, key=lambda t: t.record.nbytes)
            out[key] = (best, output_nbytes(best))
            for t in ts:
                if t is not best:
                    if (t.dtype, t.record.nbytes) == (best.dtype, best.record.nbytes):
                        self.sharers[t.name] = best.name
                    else:
                        self.copied[t.name] = t
        return out

    def _buffer(self, r: _Request, sources: dict[tuple[int, str],
                                                 tuple[PlannedTensor | None, int]],
                offset_mode: bool) -> fb.Table:
        table = fb.Table(SCHEMA.tables["Buffer"])
        src: Any
        if r.data is not None:
            src, nbytes = r.data, len(r.data)
        elif r.index in self.data:
            tensor, nbytes = sources.get((r.index, r.variant), (None, self.data[r.index][1]))
            offset, stored = self.data[r.index]
            src = tensor if tensor is not None else FileRange(self.path, offset, stored)
        else:
            return table
        data = fb.Data(nbytes, 16, src, external=offset_mode)
        if offset_mode:
            table["offset"] = fb.DataOffset(data)
            table["size"] = fb.DataSize(data)
        else:
            table["data"] = data
        return table


def _kept(name: str, globs: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in globs)
