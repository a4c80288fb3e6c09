"""``modelsize slim`` of GGUF files, checked with gguf-py (a reader we did not write).

Inputs are the committed fixtures (tests/fixtures/gguf, made by gguf-py's writer) and files
written here by gguf-py's ``GGUFWriter``. Every expectation is computed from gguf-py's reader
or from NumPy/torch, never from modelsize.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

import modelsize
from modelsize.categories import Category
from modelsize.errors import CorruptFileError, UsageError
from tests.conftest import REPO, assert_one_line_error, cli_json, run_cli

np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf")

FIXTURES = REPO / "tests" / "fixtures" / "gguf"
Q = gguf.GGMLQuantizationType


def _pad(n: int, align: int) -> int:
    return -(-n // align) * align


def _write_model(path: Path, *, endian: Any = None, alignment: int | None = None,
                 extra_kv: tuple[tuple[str, Any, Any], ...] = ()) -> dict[str, Any]:
    """A small llama-like file: F32/F64 weights, norms, a router, a q4_K block, rope
    frequencies (``buffers``) and ``output.weight`` a copy of ``token_embd.weight``."""
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(path, arch="llama", endianess=endian or gguf.GGUFEndian.LITTLE)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_name("slim-test")
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_context_length(32)
    w.add_token_list(["<unk>", "<s>", "</s>", "a", "b"])
    for key, value, vtype in extra_kv:
        w.add_key_value(key, value, vtype)
    embd = rng.standard_normal((16, 8), dtype=np.float32)
    tensors: dict[str, Any] = {
        "token_embd.weight": embd,
        "rope_freqs.weight": np.linspace(1, 2, 4, dtype=np.float32),
        "blk.0.attn_norm.weight": rng.standard_normal(8, dtype=np.float32),
        "blk.0.attn_q.weight": (rng.standard_normal((8, 8)) * 100).astype(np.float32),
        "blk.0.ffn_gate_inp.weight": rng.standard_normal((4, 8), dtype=np.float32),
        "blk.0.ffn_down.weight": rng.standard_normal((8, 8)),  # float64 -> GGML F64
        "blk.0.ffn_up.weight": rng.integers(0, 255, (1, 144), dtype=np.uint8),
        "output_norm.weight": rng.standard_normal(8, dtype=np.float32),
        "output.weight": embd.copy(),
    }
    for name, array in tensors.items():
        raw = Q.Q4_K if name == "blk.0.ffn_up.weight" else None
        w.add_tensor(name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def _fields(path: Path) -> dict[str, Any]:
    """gguf-py's key/value fields and their values (the header's counts left out)."""
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """gguf-py's tensors: type name, ggml dims, raw data bytes as stored."""
    r = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape), t.data.tobytes())
            for t in r.tensors}


def _assert_llama_cpp_layout(path: Path) -> None:
    """What llama.cpp's gguf loader checks: every tensor at the padded end of the previous
    one (in info order), the data section aligned, and the file holding the padded data."""
    r = gguf.GGUFReader(path)
    align = int(r.alignment)
    assert r.data_offset % align == 0
    expected = 0
    for t in r.tensors:
        assert int(t.data_offset) - int(r.data_offset) == expected, t.name
        expected += _pad(int(t.n_bytes), align)
    assert path.stat().st_size == int(r.data_offset) + expected


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny.gguf", "big_endian.gguf"])
def test_nothing_to_drop_gives_the_same_bytes(tmp_path: Path, name: str) -> None:
    out = tmp_path / name
    report = modelsize.slim(FIXTURES / name, out)
    assert report.verified
    assert out.read_bytes() == (FIXTURES / name).read_bytes()


def test_default_slim_drops_the_duplicate(tmp_path: Path) -> None:
    src = FIXTURES / "aligned_dup.gguf"
    out = tmp_path / "dup.slim.gguf"
    report = modelsize.slim(src, out)
    before, after = _tensors(src), _tensors(out)
    assert set(after) == {"a.weight", "b.weight"}
    assert after == {k: before[k] for k in after}
    assert _fields(out) == _fields(src)
    assert gguf.GGUFReader(out).alignment == 64
    _assert_llama_cpp_layout(out)
    assert [d.name for d in report.dropped] == ["a_copy.weight"]
    assert any("GGUF cannot give two names one set of bytes" in n for n in report.notes)
    inv = modelsize.inspect(out).inventory
    assert inv.bytes_by_category[Category.DUPLICATES] == 0
    assert inv.bytes_by_category[Category.WEIGHTS] == 80 + 28  # f32 4x5 and 7


def test_dedupe_drops_tied_output_and_keeps_the_rest(tmp_path: Path) -> None:
    src, out = tmp_path / "m.gguf", tmp_path / "m.slim.gguf"
    _write_model(src)
    report = modelsize.slim(src, out, dedupe=True)
    before, after = _tensors(src), _tensors(out)
    assert set(before) - set(after) == {"output.weight"}
    assert after == {k: before[k] for k in after}  # q4_K, F64, F32: the same bytes
    assert _fields(out) == _fields(src)
    _assert_llama_cpp_layout(out)
    assert any("llama.cpp ties output.weight to token_embd.weight" in n for n in report.notes)
    assert modelsize.inspect(out).inventory.bytes_by_category[Category.DUPLICATES] == 0
    assert gguf.GGUFReader(out).fields["GGUF.tensor_count"].contents() == len(before) - 1


def test_metadata_is_copied_byte_for_byte(tmp_path: Path) -> None:
    src, out = tmp_path / "m.gguf", tmp_path / "m.slim.gguf"
    _write_model(src)
    modelsize.slim(src, out, drop=["buffers"], dedupe=True)

    def kv_bytes(path: Path) -> bytes:
        r = gguf.GGUFReader(path)
        first_kv = min(f.offset for k, f in r.fields.items() if not k.startswith("GGUF."))
        return path.read_bytes()[first_kv : r.tensors[0].field.offset]

    assert kv_bytes(out) == kv_bytes(src)
    assert set(_tensors(src)) - set(_tensors(out)) == {"rope_freqs.weight", "output.weight"}


def test_version_2_stays_version_2(tmp_path: Path) -> None:
    src, out = tmp_path / "v2.gguf", tmp_path / "v2.slim.gguf"
    data = bytearray((FIXTURES / "aligned_dup.gguf").read_bytes())
    data[4:8] = struct.pack("<I", 2)  # v2 and v3 little-endian files share one layout
    src.write_bytes(bytes(data))
    modelsize.slim(src, out)
    assert gguf.GGUFReader(out).fields["GGUF.version"].contents() == 2
    assert set(_tensors(out)) == {"a.weight", "b.weight"}


def test_split_tensor_count_follows_the_drops(tmp_path: Path) -> None:
    src, out = tmp_path / "m-00001-of-00002.gguf", tmp_path / "slim.gguf"
    vt = gguf.GGUFValueType
    _write_model(src, extra_kv=(("split.no", 0, vt.UINT16), ("split.count", 2, vt.UINT16),
                                ("split.tensors.count", 12, vt.INT32)))
    modelsize.slim(src, out, drop=["buffers", "duplicates"])
    before, after = _fields(src), _fields(out)
    assert after.pop("split.tensors.count") == 12 - 2  # rope_freqs and the tied output
    before.pop("split.tensors.count")
    assert after == before
    assert gguf.GGUFReader(out).fields["split.tensors.count"].types == [vt.INT32]


# -- casting -------------------------------------------------------------------------------


def test_cast_float16_narrows_matrices_and_keeps_what_llama_cpp_needs_in_f32(
    tmp_path: Path,
) -> None:
    src, out = tmp_path / "m.gguf", tmp_path / "m16.gguf"
    tensors = _write_model(src)
    report = modelsize.slim(src, out, cast="float16")
    r = gguf.GGUFReader(out)
    got = {t.name: t for t in r.tensors}
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight",
                 "output.weight"):
        t = got[name]
        assert t.tensor_type == Q.F16 and int(t.field.parts[4][0]) == 1
        x = np.asarray(tensors[name])
        y = np.asarray(t.data, dtype=np.float64)
        np.testing.assert_array_equal(t.data, x.astype(np.float16))
        assert np.all(np.abs(y - x) <= np.abs(x) * 2.0**-11 + 2.0**-25)  # half an f16 ulp
    before = _tensors(src)
    for name in ("rope_freqs.weight", "blk.0.attn_norm.weight", "blk.0.ffn_gate_inp.weight",
                 "output_norm.weight", "blk.0.ffn_up.weight"):
        assert _tensors(out)[name] == before[name], name
    assert r.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_F16)
    rest = {k: v for k, v in _fields(out).items() if k != "general.file_type"}
    assert rest == {k: v for k, v in _fields(src).items() if k != "general.file_type"}
    assert any("kept in float32" in n for n in report.notes)
    _assert_llama_cpp_layout(out)


def test_cast_bfloat16_rounds_like_ml_dtypes(tmp_path: Path) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")  # onnx's dependency; faster to load than torch
    src, out = tmp_path / "m.gguf", tmp_path / "mbf16.gguf"
    tensors = _write_model(src)
    modelsize.slim(src, out, cast="bfloat16")
    r = gguf.GGUFReader(out)
    t = next(t for t in r.tensors if t.name == "blk.0.attn_q.weight")
    assert t.tensor_type == Q.BF16 and int(t.field.parts[4][0]) == 30
    expected = tensors["blk.0.attn_q.weight"].astype(ml_dtypes.bfloat16)
    assert t.data.tobytes() == expected.tobytes()
    assert r.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_BF16)


def test_big_endian_stays_big_endian_through_a_cast(tmp_path: Path) -> None:
    src, out = tmp_path / "be.gguf", tmp_path / "be16.gguf"
    tensors = _write_model(src, endian=gguf.GGUFEndian.BIG)
    modelsize.slim(src, out, cast="float16", dedupe=True)
    r = gguf.GGUFReader(out)
    assert r.endianess == gguf.GGUFEndian.BIG
    got = {t.name: t for t in r.tensors}
    np.testing.assert_array_equal(got["blk.0.attn_q.weight"].data,
                                  tensors["blk.0.attn_q.weight"].astype(np.float16))
    np.testing.assert_array_equal(got["output_norm.weight"].data, tensors["output_norm.weight"])
    assert got["blk.0.ffn_up.weight"].data.tobytes() == tensors["blk.0.ffn_up.weight"].tobytes()
    assert "output.weight" not in got
    assert modelsize.inspect(out).inventory.facts["gguf.byte_order"] == "big-endian"
    _assert_llama_cpp_layout(out)


def test_big_endian_to_safetensors_is_little_endian(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.numpy")
    out = tmp_path / "be.safetensors"
    modelsize.slim(FIXTURES / "big_endian.gguf", out, to="safetensors")
    np.testing.assert_array_equal(st.load_file(str(out))["x.weight"],
                                  np.arange(6, dtype=np.float32).reshape(2, 3))


# -- dry run -------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [
    {}, {"dedupe": True}, {"cast": "float16"}, {"cast": "bfloat16", "drop": ["buffers"]},
])
@pytest.mark.parametrize("endian", ["little", "big"])
def test_dry_run_predicts_the_exact_size(tmp_path: Path, options: dict[str, Any],
                                         endian: str) -> None:
    src, out = tmp_path / "m.gguf", tmp_path / "out.gguf"
    _write_model(src, alignment=64, endian=gguf.GGUFEndian.BIG if endian == "big" else None)
    dry = modelsize.slim(src, out, dry_run=True, **options)
    assert not out.exists()
    modelsize.slim(src, out, **options)
    assert dry.predicted_bytes == out.stat().st_size


def test_cli_dry_run_json(tmp_path: Path) -> None:
    out = tmp_path / "dup.gguf"
    src = FIXTURES / "aligned_dup.gguf"
    doc = cli_json("slim", str(src), "-o", str(out), "--dry-run")
    r = gguf.GGUFReader(src)
    info_bytes = {t.name: sum(int(p.nbytes) for p in t.field.parts) for t in r.tensors}
    infos_end = r.tensors[-1].field.offset + info_bytes["a_copy.weight"]
    kept = [t for t in r.tensors if t.name != "a_copy.weight"]
    expected = _pad(infos_end - info_bytes["a_copy.weight"], 64) + sum(
        _pad(int(t.n_bytes), 64) for t in kept)
    assert doc["predicted_bytes"] == expected
    assert [d["name"] for d in doc["dropped"]] == ["a_copy.weight"]
    assert not out.exists()


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [100, 7424, 17455])
def test_truncated_input_is_refused(tmp_path: Path, cut: int) -> None:
    src = tmp_path / "cut.gguf"
    src.write_bytes((FIXTURES / "tiny.gguf").read_bytes()[:cut])
    with pytest.raises(CorruptFileError):
        modelsize.slim(src, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()
    assert_one_line_error(run_cli("slim", str(src), "-o", str(tmp_path / "o.gguf")), src)


def test_vocab_only_file_has_nothing_to_write(tmp_path: Path) -> None:
    src = tmp_path / "vocab.gguf"
    shutil.copy(FIXTURES / "vocab_only.gguf", src)
    with pytest.raises(UsageError, match=r"holds no tensor data|nothing would be left"):
        modelsize.slim(src, tmp_path / "out.gguf")


def test_writer_refuses_other_formats(tmp_path: Path) -> None:
    from modelsize import formats
    from modelsize.slimming.core import plan_slim
    from modelsize.slimming.plan import SlimOptions
    from modelsize.slimming.writers.gguf import GgufWriter

    st = pytest.importorskip("safetensors.numpy")
    src = tmp_path / "x.safetensors"
    st.save_file({"w": np.ones((2, 2), dtype=np.float32)}, str(src))
    plan = plan_slim(formats.read(src), SlimOptions())
    with pytest.raises(UsageError, match="GGUF inputs only"):
        GgufWriter().prepare(plan, tmp_path / "x.gguf")


def _s(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def test_unknown_ggml_type_is_copied_as_stored(tmp_path: Path) -> None:
    s = _s
    infos = (s("new") + struct.pack("<IQIQ", 1, 64, 99, 0)
             + s("old.weight") + struct.pack("<IQQIQ", 2, 4, 2, 0, 64))
    head = b"GGUF" + struct.pack("<IQQ", 3, 2, 0) + infos
    head += bytes(-len(head) % 32)
    new, old = bytes(range(64)), np.arange(8, dtype=np.float32) / 3
    src = tmp_path / "crafted.gguf"
    src.write_bytes(head + new + old.tobytes())
    out = tmp_path / "out.gguf"
    report = modelsize.slim(src, out, cast="float16")
    data = out.read_bytes()
    assert data[len(head) : len(head) + 64] == new
    assert data[len(head) + 64 :] == old.astype(np.float16).tobytes() + bytes(16)
    assert report.predicted_bytes == len(data)


def test_two_names_at_one_offset_get_their_own_bytes(tmp_path: Path) -> None:
    """gguf-py reads two infos with one offset; llama.cpp does not: the output separates them."""
    infos = b"".join(_s(n) + struct.pack("<IQQIQ", 2, 2, 2, 0, 0) for n in ("a.weight", "b.weight"))
    head = b"GGUF" + struct.pack("<IQQ", 3, 2, 0) + infos
    head += bytes(-len(head) % 32)
    values = np.array([[1, 2], [3, 4]], dtype=np.float32)
    src, out = tmp_path / "shared.gguf", tmp_path / "out.gguf"
    src.write_bytes(head + values.tobytes() + bytes(16))
    assert [int(t.data_offset) for t in gguf.GGUFReader(src).tensors] == [len(head)] * 2
    report = modelsize.slim(src, out)
    got = _tensors(out)
    assert got["a.weight"][2] == got["b.weight"][2] == values.tobytes()
    _assert_llama_cpp_layout(out)
    assert any("its own bytes" in n for n in report.notes)


def test_ggml_c_loader_reads_the_output(tmp_path: Path) -> None:
    """ggml's own loader (``gguf_init_from_file``, the one llama.cpp uses) reads every output
    and its bytes; it refuses the two-names-one-offset layout the writer never produces.
    Needs ggml-python (built from source: not a dev dependency), so it usually skips."""
    import ctypes

    ggml = pytest.importorskip("ggml")

    def load(path: Path) -> dict[str, bytes] | None:
        ctx = ctypes.c_void_p()
        g = ggml.gguf_init_from_file(str(path).encode(),
                                     ggml.gguf_init_params(no_alloc=False, ctx=ctypes.pointer(ctx)))
        if not g:
            return None
        try:
            out = {}
            for i in range(ggml.gguf_get_n_tensors(g)):
                t = ggml.ggml_get_tensor(ctx, ggml.gguf_get_tensor_name(g, i))
                out[ggml.gguf_get_tensor_name(g, i).decode()] = ctypes.string_at(
                    ggml.ggml_get_data(t), ggml.ggml_nbytes(t))
            return out
        finally:
            ggml.gguf_free(g)
            ggml.ggml_free(ctx)

    src = tmp_path / "m.gguf"
    _write_model(src, alignment=64)
    for i, options in enumerate([{"dedupe": True}, {"cast": "float16"}, {"cast": "bfloat16"}]):
        out = tmp_path / f"out{i}.gguf"
        modelsize.slim(src, out, **options)
        assert load(out) == {name: data for name, (_, _, data) in _tensors(out).items()}
    test_two_names_at_one_offset_get_their_own_bytes(tmp_path)  # writes shared.gguf, out.gguf
    assert load(tmp_path / "shared.gguf") is None
    assert load(tmp_path / "out.gguf") is not None


def test_tensor_of_an_unknown_type_is_not_rewritten(tmp_path: Path) -> None:
    """A tensor whose ggml type is unknown (735: one integer changed by the fuzz target) is read
    with a note, its size taken up to the next tensor (here the end of the file, 18 bytes):
    padded to the alignment in a rewrite it would read back larger, and verification failed
    with an internal error (exit 1) before. Refused in one line."""
    src = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(src, arch="llama")
    w.add_tensor("a.weight", np.ones((4, 8), dtype=np.float32))
    w.add_tensor("b.weight", np.ones(9, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = bytearray(src.read_bytes())
    at = data.index(b"b.weight") + len(b"b.weight") + 4 + 8  # past n_dims and its one dim
    assert struct.unpack_from("<I", data, at)[0] == int(Q.F16)
    struct.pack_into("<I", data, at, 735)
    del data[-(32 - 18):]  # the last tensor's padding: its 18 bytes end the file
    src.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="735"):
        gguf.GGUFReader(src)
    proc = run_cli("slim", str(src), "--cast", "float16", "-o", str(tmp_path / "o.gguf"))
    assert_one_line_error(proc, src)
    assert "b.weight has ggml type 735, unknown to modelsize, and 18 bytes" in proc.stderr
    assert not (tmp_path / "o.gguf").exists()


def test_a_split_model_is_refused_in_one_line_and_written_whole_to_safetensors(
        tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "llama", split_max_tensors=2)
    for i in range(5):
        w.add_tensor(f"blk.{i}.w", np.full((4, 8), i, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    first = tmp_path / "m-00001-of-00003.gguf"
    proc = run_cli("slim", str(first))
    assert_one_line_error(proc, first)
    assert "split GGUF" in proc.stderr and "--merge" in proc.stderr
    assert not list(tmp_path.glob("*.slim.*"))
    out = tmp_path / "whole.safetensors"
    modelsize.slim(first, out, to="safetensors")
    from safetensors.numpy import load_file

    got = load_file(out)
    assert sorted(got) == [f"blk.{i}.w" for i in range(5)]
    assert all((got[f"blk.{i}.w"] == i).all() for i in range(5))
