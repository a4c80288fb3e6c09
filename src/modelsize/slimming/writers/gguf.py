"""GGUF output (llama.cpp, ggml): the input's header and metadata, the kept tensors, aligned.

The file is laid out as gguf-py's ``GGUFWriter`` lays it out, in the input's version (2 or 3)
and byte order::

    "GGUF" u32 version, u64 tensor_count (the kept tensors), u64 kv_count (unchanged)
    the input's key/value pairs, copied byte for byte
    one tensor info per kept tensor, in the input's order; offset = the padded end of the last
    zero padding to general.alignment (default 32)
    each tensor's bytes followed by zero padding to general.alignment (the last one's too)

llama.cpp's loader requires exactly this: every tensor info's offset must equal the sum of the
padded sizes of the tensors before it ("tensor '%s' has offset %lu, expected %zu").

Metadata that must change, and nothing else, is rewritten in place with the same value type
(so every other byte keeps its position): ``split.tensors.count`` of a shard of a split model
loses the tensors dropped here (llama.cpp checks it against the tensors it finds), and
``general.file_type`` ``ALL_F32`` becomes ``MOSTLY_F16`` / ``MOSTLY_BF16`` when ``--cast``
narrowed tensors.

Duplicates: GGUF cannot give two tensor names one set of bytes. gguf-py's reader would accept
two infos with one offset, llama.cpp's refuses them (offsets must follow one another), so a
deduplicated copy is *dropped* (with a note), not aliased: llama.cpp ties ``output.weight`` to
``token_embd.weight`` when the former is missing, for most architectures. A loader that needs
another copy by name needs the input's copy: slim without ``--dedupe`` and with a ``--drop``
that does not name ``duplicates``. An input whose two tensor infos share one offset (which
llama.cpp refuses) gives an output where each has its own bytes.

Casting: ``--cast float16|bfloat16`` narrows F32/F64 tensors (GGML types 0 and 28 become 1 or
30), except those llama.cpp's converter keeps in F32 (``convert_hf_to_gguf.py``): 1-D tensors,
``*_norm.weight``, names not ending in ``.weight`` and a few named kinds (MoE routers, position
embeddings, SSM convolutions...). ggml's CPU kernels multiply F32 activations by F32 norms and
biases only (``binary_op``: "unsupported types"), so an F16 norm would stop llama.cpp.

Byte order: a big-endian input gives a big-endian output. The reader hands over plain tensors
little-endian (:func:`~modelsize.formats.gguf.storage_chunks`), :func:`stream` casts and
checksums them so, and this writer swaps them back as it writes; the metadata is copied as it
is and quantized blocks are copied as stored.

Quantized blocks (q4_K, q8_0, ...) and types unknown to modelsize are copied as they are.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from modelsize import inputs
from modelsize.categories import Category
from modelsize.dtypes import DTYPES
from modelsize.errors import CorruptFileError, UsageError, printable
from modelsize.formats.gguf import (
    GGML_TYPES,
    MAGIC,
    KeyValue,
    Layout,
    read_layout,
    storage_chunks,
    swap_bytes,
)
from modelsize.slimming.output import Output
from modelsize.slimming.plan import DroppedTensor, Plan, PlannedTensor
from modelsize.slimming.source import CHUNK, tensor_source
from modelsize.slimming.writers.base import Meter, Written, output_nbytes, slim_name, stream

#: canonical dtype -> GGML type id (``ggml.h`` ``enum ggml_type``; F32=0, F16=1, F64=28, BF16=30).
GGML_IDS: dict[str, int] = {name: type_id for type_id, name in GGML_TYPES.items()}

SPLIT_TENSORS_COUNT = "split.tensors.count"
FILE_TYPE = "general.file_type"
#: ``LlamaFileType``: ALL_F32 = 0, MOSTLY_F16 = 1, MOSTLY_BF16 = 32.
_ALL_F32 = 0
_FILE_TYPE_AFTER_CAST = {"float16": 1, "bfloat16": 32}
#: Integer metadata value types -> struct codes (GGUF ``GGUFValueType``).
_INT_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 10: "Q", 11: "q"}

#: Tensors llama.cpp's converter always writes in F32 (its ``MODEL_TENSOR`` list, by name).
_ALWAYS_F32 = re.compile(
    r"^(?:blk\.\d+\.(?:ffn_gate_inp|ffn_gate_inp_shexp|ssm_conv1d|ssm_conv1d_[qkv]"
    r"|shortconv\.conv|time_mix_first|time_mix_w1|time_mix_w2|time_mix_decay_w1"
    r"|time_mix_decay_w2|time_mix_lerp_fused|altup_correct_coef|altup_predict_coef"
    r"|indexer\.proj)"
    r"|position_embd|token_types|v\.position_embd|a\.position_embd|posnet\.\d+\.norm[12])"
    r"\.weight$"
)
_NARROW = frozenset({"float16", "bfloat16"})


def keeps_f32(name: str, n_dims: int) -> bool:
    """Whether llama.cpp needs this tensor in F32 (``convert_hf_to_gguf.py``'s rule)."""
    return (
        n_dims <= 1
        or name.endswith("_norm.weight")
        or not name.endswith((".weight", ".lora_a", ".lora_b"))
        or _ALWAYS_F32.match(name) is not None
    )


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _string(text: str, endian: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack(endian + "Q", len(raw)) + raw


def _swap_size(dtype: str) -> int:
    """Bytes per element the byte order applies to (1: bytes, quantized blocks, unknown)."""
    dt = DTYPES.get(dtype)
    return dt.block_bytes if dt is not None and dt.block == 1 else 1


@dataclass
class GgufJob:
    """One ``.gguf`` file, laid out to the byte before anything is written."""

    files: list[str]
    main: str
    directory: bool
    predicted_bytes: int | None
    source: Path
    layout: Layout
    head: bytes
    patches: dict[int, bytes]
    infos: bytes
    tensors: list[PlannedTensor] = field(default_factory=list)

    def write(self, out: Output, meter: Meter) -> dict[str, Written]:
        """Header, metadata (patched where it must change), tensor infos, aligned data."""
        fh = out.open(self.main)
        fh.write(self.head)
        for piece in self._metadata():
            fh.write(piece)
        fh.write(self.infos)
        align = self.layout.alignment
        fh.write(bytes(_pad(fh.tell(), align) - fh.tell()))
        written: dict[str, Written] = {}
        big = self.layout.endian == ">"
        for t in self.tensors:
            s = stream(t, meter)
            itemsize = _swap_size(t.dtype) if big else 1
            n = 0
            for chunk in s.chunks():
                fh.write(swap_bytes(chunk, itemsize) if itemsize > 1 else chunk)
                n += len(chunk)
            fh.write(bytes(_pad(n, align) - n))
            written[t.name] = s.written
        _check_size(fh, self.predicted_bytes)
        return written

    def _metadata(self) -> Iterator[bytes]:
        """The input's key/value bytes, a chunk at a time, with the patched values swapped in."""
        start, end = self.layout.kv_start, self.layout.kv_end
        fd = inputs.open_fd(self.source)
        try:
            pos = start
            for at, value in [*sorted(self.patches.items()), (end, b"")]:
                while pos < at:
                    data = os.pread(fd, min(CHUNK, at - pos), pos)
                    if not data:
                        raise CorruptFileError(self.source, "gguf", "the file got shorter "
                                               "while it was being slimmed", pos)
                    pos += len(data)
                    yield data
                yield value
                pos += len(value)
        finally:
            os.close(fd)

    def output_name(self, name: str) -> str:
        """Names are kept as they are."""
        return name


def _check_size(fh: BinaryIO, predicted: int | None) -> None:
    if predicted is not None and fh.tell() != predicted:
        raise ValueError(f"wrote {fh.tell()} bytes, laid out {predicted}")


class GgufWriter:
    """``.gguf`` (same format only: every GGUF input is written back as GGUF)."""

    name = "gguf"

    def default_target(self, plan: Plan, source: Path) -> Path:
        """``x.slim.gguf``."""
        return slim_name(source)

    def prepare(self, plan: Plan, target: Path) -> GgufJob:
        """Fit the plan to what GGUF and llama.cpp accept, then lay out every byte."""
        inv = plan.inventory
        if inv.format != "gguf":
            raise UsageError(f"the gguf writer writes GGUF inputs only, not {inv.format}; "
                             "use --to safetensors, --to pytorch or --to npz")
        if len(inv.files) != 1:
            first = inv.files[0].path
            raise UsageError(
                f"{first.name} is the first of {len(inv.files)} shards of a split GGUF model, "
                "and slim writes one GGUF file: merge them first (llama-gguf-split --merge "
                f"{first.name} merged.gguf) and slim that, or write the whole model with "
                "--to safetensors")
        source = inv.files[0].path
        layout = read_layout(source)
        infos = {info.name: info for info in layout.infos}
        _resolve_aliases(plan)
        _keep_f32(plan, {t.name: len(infos[t.record.name].dims) for t in plan.tensors
                         if t.record.name in infos})
        e = layout.endian
        blob = bytearray()
        offset = 0
        for t in plan.tensors:
            info = infos.get(t.record.name)
            if info is None:
                raise UsageError(f"{printable(t.record.name)} is not a tensor of {source.name}")
            ggml_type = info.ggml_type
            if (GGML_TYPES.get(ggml_type) not in DTYPES
                    and output_nbytes(t) % layout.alignment):
                # Its size is read as up to the next tensor: padded to the alignment in the
                # output, it would read back larger than it is.
                raise UsageError(
                    f"{printable(t.record.name)} has ggml type {ggml_type}, unknown to modelsize, "
                    f"and {output_nbytes(t)} bytes up to the next tensor, not a multiple of the "
                    f"alignment {layout.alignment}: where its bytes end is a guess that a rewrite "
                    "would change, so slim does not rewrite the file")
            if t.cast:
                if t.dtype not in GGML_IDS:
                    raise UsageError(f"{printable(t.name)}: GGUF has no type for {t.dtype}")
                ggml_type = GGML_IDS[t.dtype]
            blob += _string(t.name, e) + struct.pack(e + "I", len(info.dims))
            blob += struct.pack(f"{e}{len(info.dims)}Q", *info.dims)
            blob += struct.pack(e + "IQ", ggml_type, offset)
            offset += _pad(output_nbytes(t), layout.alignment)
        patches = _patches(plan, layout, len(layout.infos) - len(plan.tensors))
        head = MAGIC + struct.pack(e + "IQQ", layout.version, len(plan.tensors), layout.kv_count)
        data_start = _pad(len(head) + layout.kv_end - layout.kv_start + len(blob),
                          layout.alignment)
        return GgufJob([target.name], target.name, False, data_start + offset, source, layout,
                       head, patches, bytes(blob), list(plan.tensors))


def _resolve_aliases(plan: Plan) -> None:
    """GGUF cannot share bytes between tensors: a deduplicated copy leaves the output, and a
    second name for the same bytes of the input (two infos, one offset) gets its own copy."""
    copies: list[PlannedTensor] = []
    shared: list[str] = []
    for t in plan.tensors:
        if t.alias_of is None:
            continue
        if t.record.category is Category.DUPLICATES:
            copies.append(t)
        else:
            t.source = tensor_source(plan.inventory, t.record, storage_chunks)
            t.alias_of = None
            shared.append(t.name)
    if shared:
        plan.notes.append(
            f"{len(shared)} tensor(s) shared another's offset in the input, which llama.cpp "
            f"refuses ({', '.join(printable(n) for n in shared[:3])}): each has its own bytes now"
        )
    if not copies:
        return
    plan.tensors[:] = [t for t in plan.tensors if t.alias_of is None]
    for t in copies:
        plan.dropped.append(DroppedTensor(t.record, f"duplicates (a copy of {t.alias_of}; GGUF "
                                                    "tensors cannot share bytes)"))
    tied = any(t.name == "output.weight" and t.alias_of == "token_embd.weight" for t in copies)
    names = ", ".join(printable(t.name) for t in copies[:3])
    more = f" and {len(copies) - 3} more" if len(copies) > 3 else ""
    plan.notes.append(
        f"{len(copies)} duplicate tensor(s) dropped, not aliased ({names}{more}): GGUF cannot "
        "give two names one set of bytes"
        + ("; llama.cpp ties output.weight to token_embd.weight when it is missing" if tied
           else "; a loader that needs them by name needs the input's copies (slim without "
                "--dedupe and without --drop duplicates)")
    )


def _keep_f32(plan: Plan, n_dims: dict[str, int]) -> None:
    """Undo the casts llama.cpp cannot run: 1-D tensors, norms and its always-F32 tensors."""
    kept: list[str] = []
    for t in plan.tensors:
        if t.cast and t.dtype in _NARROW and keeps_f32(t.record.name, n_dims.get(t.name, 1)):
            t.dtype = "float32"
            kept.append(t.name)
    if kept:
        names = ", ".join(printable(n) for n in kept[:3])
        more = f" and {len(kept) - 3} more" if len(kept) > 3 else ""
        plan.notes.append(
            f"{len(kept)} tensor(s) kept in float32 ({names}{more}): llama.cpp needs 1-D "
            "tensors, norms and biases in F32, as its converter writes them"
        )


def _patches(plan: Plan, layout: Layout, dropped: int) -> dict[int, bytes]:
    """New values (same type and size) of the metadata that must change, by file offset."""
    patches: dict[int, bytes] = {}
    casts = {t.dtype for t in plan.tensors if t.cast}
    for kv in layout.kvs:
        if kv.key == SPLIT_TENSORS_COUNT and dropped and isinstance(kv.value, int):
            _patch(patches, kv, max(0, kv.value - dropped), layout.endian)
            plan.notes.append(
                f"{SPLIT_TENSORS_COUNT} {kv.value} -> {max(0, kv.value - dropped)}: llama.cpp "
                "reads it from the first shard of a split model, which must say the same"
            )
        elif kv.key == FILE_TYPE and kv.value == _ALL_F32 and len(casts & _NARROW) == 1:
            _patch(patches, kv, _FILE_TYPE_AFTER_CAST[next(iter(casts & _NARROW))],
                   layout.endian)
    return patches


def _patch(patches: dict[int, bytes], kv: KeyValue, value: int, endian: str) -> None:
    code = _INT_CODES.get(kv.value_type)
    if code is None:
        return
    try:
        patches[kv.value_start] = struct.pack(endian + code, value)
    except struct.error:
        return  # the new value does not fit the key's type: leave the input's
