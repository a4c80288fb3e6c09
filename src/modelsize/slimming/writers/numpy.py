"""NumPy output: ``.npz`` archives (``--to npz`` and slimmed ``.npz``) and single ``.npy`` arrays.

Each array is written as NumPy writes it: the ``\\x93NUMPY`` magic, version 1.0 (2.0 for
headers over 64 KiB), the header dict padded with spaces to a multiple of 64 bytes and ending
in a newline, then the data in C order, little-endian. An ``.npz`` holds one stored member per
array (``name.npy``); a compressed input (``np.savez_compressed``) gives a compressed output,
whose size is then known only once written. NumPy has no ``bfloat16``: such tensors need
``--to safetensors`` (or ``--cast float16``). Deduplicated aliases are stored once (an archive
cannot share bytes between members); the report names them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from modelsize.errors import UsageError, printable
from modelsize.slimming.output import Output
from modelsize.slimming.plan import Plan, PlannedTensor
from modelsize.slimming.writers.base import Meter, Written, output_nbytes, slim_name, stream
from modelsize.slimming.zipwriter import Member, ZipWriter, plan_sizes

#: canonical dtype -> NumPy type string.
DESCR: dict[str, str] = {
    "float64": "<f8", "float32": "<f4", "float16": "<f2", "int64": "<i8", "int32": "<i4",
    "int16": "<i2", "int8": "|i1", "uint64": "<u8", "uint32": "<u4", "uint16": "<u2",
    "uint8": "|u1", "bool": "|b1", "complex64": "<c8", "complex128": "<c16",
}


def descr(t: PlannedTensor) -> str:
    """The NumPy type string of a planned tensor, or a :class:`UsageError` saying why none."""
    name = t.dtype
    if name in DESCR:
        return DESCR[name]
    for prefix, code, bits in (("bytes", "|S", 8), ("str", "<U", 32), ("void", "|V", 8)):
        rest = name[len(prefix):]
        if name.startswith(prefix) and rest.isdigit():
            return f"{code}{int(rest) // bits}"
    for prefix, code in (("datetime64", "<M8"), ("timedelta64", "<m8")):
        if name.startswith(prefix):
            return code + name[len(prefix):]
    hint = " or --cast float16" if name == "bfloat16" else ""
    raise UsageError(
        f"{printable(t.name)}: NumPy files cannot hold {name} tensors; use --to safetensors{hint}"
    )


def npy_header(dtype_descr: str, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` header NumPy's ``write_array`` would write."""
    text = f"{{'descr': {dtype_descr!r}, 'fortran_order': False, 'shape': {shape!r}, }}"
    raw = text.encode("latin1")
    for version, pre, fmt in ((1, 10, "<H"), (2, 12, "<I")):
        pad = -(pre + len(raw) + 1) % 64
        length = len(raw) + pad + 1
        if length < 2 ** (8 * struct.calcsize(fmt)):
            return (b"\x93NUMPY" + bytes([version, 0]) + struct.pack(fmt, length) + raw
                    + b" " * pad + b"\n")
    raise UsageError("array header too long for the .npy format")


@dataclass
class NpzJob:
    """An ``.npz`` archive or a single ``.npy`` file."""

    files: list[str]
    main: str
    directory: bool
    predicted_bytes: int | None
    tensors: list[tuple[PlannedTensor, bytes]]
    single: bool
    deflate: bool

    def write(self, out: Output, meter: Meter) -> dict[str, Written]:
        """Each array's header and data, streamed."""
        fh = out.open(self.main)
        written: dict[str, Written] = {}
        if self.single:
            t, header = self.tensors[0]
            fh.write(header)
            s = stream(t, meter)
            for chunk in s.chunks():
                fh.write(chunk)
            written[t.name] = s.written
            return written
        zw = ZipWriter(fh)
        for t, header in self.tensors:
            s = stream(t, meter)
            member = Member(f"{t.name}.npy", len(header) + output_nbytes(t),
                            deflate=self.deflate)
            zw.write_member(member, _prefixed(header, s.chunks()))
            written[t.name] = s.written
        zw.close()
        return written

    def output_name(self, name: str) -> str:
        """A single ``.npy`` is named after its file; archive members keep their names."""
        return Path(self.main).stem if self.single else name


def _prefixed(header: bytes, chunks):  # type: ignore[no-untyped-def]  # a generator
    yield header
    yield from chunks


def _was_compressed(path: Path) -> bool:
    """Whether an input ``.npz`` was written by ``np.savez_compressed`` (deflated members)."""
    import zipfile

    with zipfile.ZipFile(path) as zf:
        return any(i.compress_type == zipfile.ZIP_DEFLATED for i in zf.infolist())


class NpzWriter:
    """``.npz`` (and ``.npy`` for a single array read from one)."""

    name = "npz"

    def _single(self, plan: Plan) -> bool:
        return plan.inventory.format == "npy" and plan.options.to == "same"

    def default_target(self, plan: Plan, source: Path) -> Path:
        """``x.slim.npz`` (``x.slim.npy`` for a single array)."""
        if self._single(plan):
            return slim_name(source)
        return slim_name(source, ".npz")

    def prepare(self, plan: Plan, target: Path) -> NpzJob:
        """Headers for every array and the archive's size (exact unless compressed)."""
        realised = [(t, npy_header(descr(t), t.shape)) for t in plan.stored]
        aliases = plan.aliases
        if aliases:
            plan.notes.append(
                f"{len(aliases)} duplicate(s) stored once under the original's name (.npz "
                "members cannot share bytes): " + ", ".join(
                    f"{printable(a)} = {printable(o)}" for a, o in list(aliases.items())[:5])
            )
        single = self._single(plan)
        if single:
            if len(realised) != 1:
                raise UsageError("a .npy file holds one array")
            t, header = realised[0]
            return NpzJob([target.name], target.name, False, len(header) + output_nbytes(t),
                          realised, True, False)
        deflate = (plan.options.to == "same" and plan.inventory.format == "npz"
                   and _was_compressed(plan.inventory.files[0].path))
        members = [Member(f"{t.name}.npy", len(h) + output_nbytes(t)) for t, h in realised]
        predicted = None if deflate else plan_sizes(members)
        return NpzJob([target.name], target.name, False, predicted, realised, False, deflate)
