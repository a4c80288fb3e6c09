"""What keeps slim lean on large checkpoints does what the objects it replaced did.

* a plan keeps its tensors as columns until a writer asks for them: the rows it makes equal
  the planned tensors it makes;
* the safetensors writer writes its header an entry at a time: byte for byte what
  ``json.dumps`` of the header object gives;
* verification of a safetensors output goes through the reader's own accounting into a
  :class:`~modelsize.inventory.TotalsBuilder`: the totals equal the full read's, and a wrong
  byte, a wrong name or a missing tensor still fails it;
* the report's output inventory has its totals at once and reads its records from OUT when
  asked for.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import modelsize
from modelsize import formats
from modelsize.errors import VerificationError
from modelsize.formats.safetensors import account_file
from modelsize.inventory import LazyInventory, TotalsBuilder
from modelsize.slimming.core import plan_slim
from modelsize.slimming.plan import SlimOptions
from modelsize.slimming.result import KeptTensor

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def _checkpoint(path: Path, metadata: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """A state dict with what slim treats apart: optimizer slots, a copy, a constant copy,
    empty and one-element tensors, integers, names JSON must escape."""
    rng = np.random.default_rng(1)
    emb = rng.standard_normal((50, 8), dtype=np.float32)
    tensors = {
        "wte.weight": emb, "lm_head.weight": emb.copy(),
        "ln.weight": np.ones(8, np.float32), "ln2.weight": np.ones(8, np.float32),
        "h.0.attn.bias": rng.standard_normal(8).astype(np.float16),
        "h.0.exp_avg": rng.standard_normal(8).astype(np.float32),
        "empty": np.zeros((0, 3), np.float32), "one": np.array([2.5], np.float64),
        "step": np.array([3], np.int64), 'quo"te\\d\tname': np.arange(6, dtype=np.int32),
        "ünïcode.weight": rng.standard_normal(4).astype(np.float32),
    }
    safetensors_numpy.save_file(tensors, str(path), metadata=metadata)
    return tensors


OPTIONS: list[dict[str, Any]] = [
    {}, {"dedupe": True}, {"cast": "float16"}, {"to": "safetensors"},
    {"drop": ["optimizer_state"], "cast": "bfloat16"}, {"keep": ["h.0.*"]},
]


@pytest.mark.parametrize("options", OPTIONS)
def test_plan_rows_are_its_tensors(tmp_path: Path, options: dict[str, Any]) -> None:
    path = tmp_path / "m.safetensors"
    _checkpoint(path)
    inv = formats.read(path)
    opts = SlimOptions(drop=frozenset(options["drop"]) if "drop" in options else None,
                       dedupe=options.get("dedupe", False), cast=options.get("cast"),
                       to=options.get("to", "same"), keep=tuple(options.get("keep", ())))
    lean, full = plan_slim(inv, opts), plan_slim(inv, opts)
    rows = list(lean.rows())
    described = list(lean.described())
    tensors = full.tensors  # made as objects, as the writers of small models ask
    assert rows == tensors and len(lean) == len(tensors)
    assert described == [(i, t.record, t.name, t.dtype, t.alias_of)
                         for i, t in enumerate(tensors)]
    assert lean.aliases == full.aliases and lean.stored_count == len(full.stored)
    assert lean.output_bytes() == full.output_bytes() == sum(
        _nbytes(t.dtype, t.shape) for t in tensors if t.alias_of is None)
    assert [t.source_nbytes() for t in rows] == [
        t.source.nbytes if t.source is not None else 0 for t in tensors]


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * {"float64": 8, "float32": 4, "float16": 2,
                                                  "bfloat16": 2, "int64": 8, "int32": 4}[dtype]


@pytest.mark.parametrize("options", OPTIONS)
def test_report_kept_is_what_was_planned_and_written(tmp_path: Path,
                                                     options: dict[str, Any]) -> None:
    path = tmp_path / "m.safetensors"
    _checkpoint(path, {"format": "pt", "note": "kept"})
    out = tmp_path / "o.safetensors"
    report = modelsize.slim(path, out, **options)
    kept = list(report.kept)
    assert report.kept == tuple(kept) and len(report.kept) == len(kept)
    assert report.kept[-1] == kept[-1] and report.kept[1:3] == tuple(kept[1:3])
    assert all(isinstance(k, KeptTensor) for k in kept)
    # Each kept tensor's CRC is that of its bytes in the output, where the header puts them.
    if not report.copied:
        raw = out.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8 : 8 + n])
        for k in kept:
            if k.alias_of is None:
                a, b = header[k.name]["data_offsets"]
                assert k.crc32 == zlib.crc32(raw[8 + n + a : 8 + n + b]), k.name
    stored = [k for k in kept if k.alias_of is None]
    assert report.stored() == (len(stored), sum(k.nbytes for k in stored))
    assert report.aliases() == [(k.name, k.alias_of) for k in kept if k.alias_of]
    assert report.dropped_by_category() == _by_category(report)
    assert [d.name for d in report.dropped] == [d.name for d in list(report.dropped)]


def _by_category(report: Any) -> dict[Any, tuple[int, int]]:
    out: dict[Any, tuple[int, int]] = {}
    for d in list(report.dropped):
        n, b = out.get(d.category, (0, 0))
        out[d.category] = (n + 1, b + d.stored_nbytes)
    return out


def _reference_header(doc: dict[str, Any]) -> bytes:
    """The header as the writer wrote it before (``json.dumps`` of the whole object)."""
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize("options", OPTIONS)
def test_header_is_json_dumps_of_the_header_object(tmp_path: Path,
                                                    options: dict[str, Any]) -> None:
    path = tmp_path / "m.safetensors"
    _checkpoint(path, {"format": "pt", "note": "ünï \"q\""})
    out = tmp_path / "o.safetensors"
    modelsize.slim(path, out, **options)
    raw = out.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    doc = json.loads(raw[8 : 8 + n])  # keys in file order
    assert raw[: 8 + n] == _reference_header(doc)


def test_raw_dtypes_and_aliases_in_the_header(tmp_path: Path) -> None:
    """Metadata naming aliases and raw (packed) dtypes comes first, as json.dumps put it."""
    from modelsize.slimming.plan import PlannedTensor
    from modelsize.slimming.writers.safetensors import layout

    path = tmp_path / "m.safetensors"
    _checkpoint(path)
    plan = plan_slim(formats.read(path), SlimOptions(dedupe=True))
    tensors = list(plan.tensors)
    first = tensors[0]
    tensors.append(PlannedTensor(first.record, "packed", "int4", first.source))
    aliases = {t.name: t.alias_of for t in tensors if t.alias_of}
    lay = layout("x.safetensors", tensors, {"format": "pt"}, aliases)
    doc = json.loads(bytes(lay.header[8:]))
    assert json.loads(doc["__metadata__"]["modelsize.raw_dtypes"]) == {
        "packed": {"dtype": "int4", "shape": list(first.shape)}}
    assert next(iter(doc)) == "__metadata__" and aliases
    assert bytes(lay.header) == _reference_header(doc)


def _safetensors_totals(path: Path) -> dict[Any, int]:
    builder = TotalsBuilder("safetensors", [path], root=path)
    account_file(builder)
    from array import array

    crcs = array("I")
    raw = path.read_bytes()
    start = 8 + struct.unpack("<Q", raw[:8])[0]
    for offset, n in zip(builder.st_offset, builder.st_nbytes, strict=True):
        crcs.append(zlib.crc32(raw[offset : offset + n]))
    assert start <= min(builder.st_offset, default=start)
    return builder.build(crcs=crcs).bytes_by_category


def test_totals_builder_gives_the_full_reads_totals(tmp_path: Path) -> None:
    """Duplicates (found among equal CRCs the builder's way: a constant copy left alone),
    empty and one-element tensors, metadata and the header: the same bytes by category."""
    path = tmp_path / "m.safetensors"
    tensors = _checkpoint(path, {"format": "pt"})
    full = formats.read(path).bytes_by_category
    assert full[modelsize.Category.DUPLICATES] == tensors["lm_head.weight"].nbytes
    assert _safetensors_totals(path) == full


def test_totals_builder_counts_stray_bytes_as_the_reader_does(tmp_path: Path) -> None:
    path = tmp_path / "stray.safetensors"
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "F32", "shape": [1], "data_offsets": [16, 20]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(range(20)) + b"tail")
    assert _safetensors_totals(path) == formats.read(path).bytes_by_category


@pytest.mark.parametrize("options", [{"to": "safetensors"}, {"dedupe": True}, {}])
def test_output_inventory_is_read_when_asked_for(tmp_path: Path,
                                                 options: dict[str, Any]) -> None:
    path = tmp_path / "m.safetensors"
    _checkpoint(path)
    out = tmp_path / "o.safetensors"
    report = modelsize.slim(path, out, **options)
    assert isinstance(report.output, LazyInventory)
    full = formats.read(out)
    assert report.output.bytes_by_category == full.bytes_by_category
    assert report.output.file_bytes == full.file_bytes == out.stat().st_size
    assert report.output.path == out
    assert report.output.tensors == full.tensors  # read now, from OUT
    assert report.output.storages == full.storages


def test_output_inventory_of_a_changed_output_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    _checkpoint(path)
    out = tmp_path / "o.safetensors"
    report = modelsize.slim(path, out, to="safetensors")
    safetensors_numpy.save_file({"other": np.zeros(3, np.float32)}, str(out))
    with pytest.raises(modelsize.errors.AccountingError, match="changed since"):
        report.output.tensors  # noqa: B018


def test_streamed_verification_catches_a_wrong_byte(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from modelsize.slimming.writers import base

    real = base.write_tensors

    def corrupt(fh: Any, plan: Any, order: Any, meter: Any, written: Any) -> int:
        start = fh.tell()
        n = real(fh, plan, order, meter, written)
        fh.seek(start + 3)  # a byte of the first tensor's data
        fh.write(b"\xff")
        fh.seek(start + n)
        return n

    monkeypatch.setattr("modelsize.slimming.writers.safetensors.write_tensors", corrupt)
    path = tmp_path / "m.safetensors"
    _checkpoint(path)
    with pytest.raises(VerificationError, match="read back differ"):
        modelsize.slim(path, tmp_path / "o.safetensors", to="safetensors")
    assert not (tmp_path / "o.safetensors").exists()


def test_streamed_verification_catches_a_wrong_name(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import json.encoder

    real = json.encoder.encode_basestring  # type: ignore[attr-defined]
    monkeypatch.setattr(json.encoder, "encode_basestring",
                        lambda s: real(s + "x" if s == "ln.weight" else s))
    path = tmp_path / "m.safetensors"
    _checkpoint(path)
    with pytest.raises(VerificationError, match=r"ln\.weight is missing"):
        modelsize.slim(path, tmp_path / "o.safetensors", to="safetensors")


def test_streamed_verification_catches_a_missing_tensor(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A header that lists one tensor fewer than planned (its bytes left out too)."""
    from modelsize.slimming.writers import safetensors as writer

    real = writer.layout

    def short(name: str, tensors: Any, metadata: Any, aliases: Any) -> Any:
        lay = real(name, tensors, metadata, aliases)
        last = lay.order[-1]
        lay.order = lay.order[:-1]
        lay.data_bytes -= lay.plan.row(last).record.nbytes
        doc = json.loads(bytes(lay.header[8:]))
        doc.pop(lay.plan.row(last).name)
        lay.header = bytearray(_reference_header(doc))
        lay.header_nbytes = len(lay.header)
        return lay

    monkeypatch.setattr(writer, "layout", short)
    path = tmp_path / "m.safetensors"
    _checkpoint(path)
    with pytest.raises(VerificationError, match="is missing"):
        modelsize.slim(path, tmp_path / "o.safetensors", to="safetensors")


def test_a_limit_met_reading_the_output_back_names_out(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a 1M-tensor torch output back hit the pickle parser's memory limit, and the
    refusal named the hidden staging file: it names OUT (and the limit's variable)."""
    from modelsize.errors import LimitError
    from modelsize.slimming import verify

    real = verify.formats.read

    def limited(path: Any) -> Any:
        if ".modelsize-partial" in str(path) or "/proc/self/fd" in str(path):
            raise LimitError(path, "parsing data.pkl needs more than 8 bytes of memory "
                             "(the limit is 8 bytes; set MODELSIZE_MAX_MEMORY_BYTES to raise "
                             "it)", "MODELSIZE_MAX_MEMORY_BYTES")
        return real(path)

    monkeypatch.setattr(verify.formats, "read", limited)
    path = tmp_path / "m.safetensors"
    _checkpoint(path)
    out = tmp_path / "o.pt"
    with pytest.raises(LimitError) as info:
        modelsize.slim(path, out, to="pytorch")
    message = str(info.value)
    assert message.startswith(f"{out}: reading the output back to verify it: parsing data.pkl")
    assert "MODELSIZE_MAX_MEMORY_BYTES" in message and "partial" not in message
    assert info.value.path == out and not out.exists()
