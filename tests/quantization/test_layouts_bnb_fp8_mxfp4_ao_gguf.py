"""Parameters and bits per weight of bitsandbytes, fp8, MXFP4, torchao and GGUF checkpoints
(issue 21, item 1).

Fixtures are made by the real tools where they run on CPU here (bitsandbytes' Linear4bit /
Linear8bitLt, torchao's quantize_, gguf-py's GGUFWriter and quantizers); fp8 and MXFP4 are
written byte for byte by their specs with torch. Parameters are compared with the unquantized
model's ``sum(p.numel())``; bits per weight with each layout's arithmetic, worked out here."""

from __future__ import annotations

import itertools
import json
import math

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

import modelsize  # noqa: E402
from modelsize.diff import diff  # noqa: E402
from modelsize.dtypes import DTYPES  # noqa: E402
from modelsize.formats.gguf import GGML_TYPES  # noqa: E402
from modelsize.quantization import GGUF_FILE_TYPES  # noqa: E402


def _source(*dims: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in itertools.pairwise(dims)))


def _check_sums(report) -> None:
    assert sum(report.inventory.bytes_by_category.values()) == report.file_bytes


# -- bitsandbytes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bnb():
    return pytest.importorskip("bitsandbytes")


@pytest.mark.parametrize("quant_type,double", [("nf4", True), ("nf4", False), ("fp4", True),
                                               ("fp4", False)])
@pytest.mark.parametrize("ext", ["safetensors", "pt"])
def test_bitsandbytes_4bit(tmp_path, bnb, quant_type, double, ext):
    src = _source(1024, 512, 64)
    model = torch.nn.Sequential(*(bnb.nn.Linear4bit(m.in_features, m.out_features,
                                                    compress_statistics=double,
                                                    quant_type=quant_type) for m in src))
    model.load_state_dict(src.state_dict())
    model = model.to("cpu")  # Params4bit quantizes on the move
    state = model.state_dict()
    assert f"0.weight.quant_state.bitsandbytes__{quant_type}" in state
    path = tmp_path / f"m.{ext}"
    if ext == "pt":
        torch.save(state, path)
    else:
        safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()}, path)
    report = modelsize.inspect(path)
    assert report.parameters == sum(p.numel() for p in src.parameters())
    _check_sums(report)
    # QLoRA's arithmetic: 4-bit codes, a scale per block of 64 (8-bit under double
    # quantization, with a float32 scale per 256 of those), codebooks and quant state free.
    expected = 4 + (8 / 64 + 32 / (64 * 256) if double else 32 / 64)
    weights = report.quantization.by_name()
    big = weights["0.weight"]
    assert big.parameters == 1024 * 512
    assert big.bits_per_weight == pytest.approx(expected, rel=0.01)
    if double:
        assert big.bits_per_weight == pytest.approx(4.127, abs=5e-4)
    assert weights["1.weight"].bits_per_weight == pytest.approx(expected, rel=0.01)
    (group,) = report.quantization.quantized
    assert group.label == f"4-bit bitsandbytes {quant_type}, block 64" + (
        ", double quant" if double else "")
    assert group.weights == 2


def test_bitsandbytes_8bit(tmp_path, bnb):
    src = _source(512, 256, 64)
    model = torch.nn.Sequential(*(bnb.nn.Linear8bitLt(m.in_features, m.out_features,
                                                      has_fp16_weights=False) for m in src))
    model.load_state_dict(src.state_dict())
    model = model.to("cpu")
    state = model.state_dict()
    assert {"0.SCB", "0.weight_format"} <= set(state)
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()}, path)
    report = modelsize.inspect(path)
    assert report.parameters == sum(p.numel() for p in src.parameters())
    _check_sums(report)
    weights = report.quantization.by_name()
    # int8 codes and one float32 absmax per row; weight_format is a tag.
    assert weights["0.weight"].bits_per_weight == pytest.approx(8 + 32 / 512)
    assert weights["1.weight"].bits_per_weight == pytest.approx(8 + 32 / 256)
    assert report.quantization.quantized[0].label == "8-bit bitsandbytes LLM.int8()"


# -- fp8 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,name", [(torch.float8_e4m3fn, "e4m3"),
                                        (torch.float8_e5m2, "e5m2")])
def test_fp8_per_tensor_scale(tmp_path, dtype, name):
    # AutoFP8 / vLLM "fp8": weight in fp8, a float32 weight_scale and an input_scale.
    src = _source(256, 128)
    tensors = {}
    for key, value in src.state_dict().items():
        if key.endswith("weight"):
            scale = value.abs().max() / torch.finfo(dtype).max
            tensors[key] = (value / scale).to(dtype)
            tensors[key + "_scale"] = scale.reshape(())
            tensors[key.replace("weight", "input_scale")] = torch.ones(())
        else:
            tensors[key] = value.to(torch.bfloat16)
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file(tensors, path)
    report = modelsize.inspect(path)
    assert report.parameters == sum(p.numel() for p in src.parameters())
    _check_sums(report)
    w = report.quantization.by_name()["0.weight"]
    assert w.bits_per_weight == pytest.approx(8 + 32 / (256 * 128))
    assert w.label == f"fp8 {name}, per-tensor scale"


@pytest.mark.parametrize("config", [True, False])
@pytest.mark.parametrize("out_f,in_f", [(256, 384), (200, 300)])
def test_fp8_block_scales(tmp_path, config, out_f, in_f):
    # DeepSeek-V3: weight float8_e4m3fn, weight_scale_inv float32 per 128x128 tile.
    folder = tmp_path / "m"
    folder.mkdir()
    src = torch.nn.Linear(in_f, out_f, bias=False)
    tiles = (math.ceil(out_f / 128), math.ceil(in_f / 128))
    safetensors_torch.save_file({
        "layer.weight": src.weight.detach().to(torch.float8_e4m3fn),
        "layer.weight_scale_inv": torch.ones(tiles),
        "norm.weight": torch.ones(in_f, dtype=torch.bfloat16),
    }, folder / "model.safetensors")
    if config:
        (folder / "config.json").write_text(json.dumps({"quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}}))
    report = modelsize.inspect(folder)
    assert report.parameters == out_f * in_f + in_f
    _check_sums(report)
    w = report.quantization.by_name()["layer.weight"]
    assert w.label == "fp8 e4m3, block 128x128"
    assert w.bits_per_weight == pytest.approx(8 + 32 / (128 * 128), rel=0.01)
    assert w.counted_bytes == out_f * in_f + 4 * tiles[0] * tiles[1]


# -- MXFP4 -------------------------------------------------------------------------------------


def _gpt_oss_experts(experts: int, hidden: int, inter: int) -> dict[str, torch.Tensor]:
    """gpt-oss's unquantized experts (transformers GptOssExperts)."""
    return {
        "mlp.experts.gate_up_proj": torch.zeros(experts, hidden, 2 * inter, dtype=torch.bfloat16),
        "mlp.experts.gate_up_proj_bias": torch.zeros(experts, 2 * inter, dtype=torch.bfloat16),
        "mlp.experts.down_proj": torch.zeros(experts, inter, hidden, dtype=torch.bfloat16),
        "mlp.experts.down_proj_bias": torch.zeros(experts, hidden, dtype=torch.bfloat16),
    }


def _mxfp4(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The OCP MX layout as gpt-oss stores it: per output row, groups of 32 e2m1 codes in 16
    bytes (``_blocks``) and one e8m0 exponent per group (``_scales``)."""
    out = {}
    for key, value in tensors.items():
        if value.dim() != 3:
            out[key] = value
            continue
        experts, cols, rows = value.shape  # stored [E, in, out], quantized along in
        out[key + "_blocks"] = torch.zeros(experts, rows, cols // 32, 16, dtype=torch.uint8)
        out[key + "_scales"] = torch.full((experts, rows, cols // 32), 127, dtype=torch.uint8)
    return out


def test_mxfp4_gpt_oss_experts(tmp_path):
    dense = _gpt_oss_experts(4, 128, 64)
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file(_mxfp4(dense), path)
    report = modelsize.inspect(path)
    assert report.parameters == sum(t.numel() for t in dense.values())
    _check_sums(report)
    w = report.quantization.by_name()["mlp.experts.gate_up_proj"]
    assert w.shape == tuple(dense["mlp.experts.gate_up_proj"].shape)
    assert w.bits_per_weight == pytest.approx(4 + 8 / 32)
    assert w.label == "MXFP4, block 32"


# -- torchao -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torchao():
    return pytest.importorskip("torchao.quantization")


def _ao_config(ao, kind: str):
    if kind == "int8":
        return ao.Int8WeightOnlyConfig()
    if kind == "float8":
        return ao.Float8WeightOnlyConfig()
    from torchao.quantization.granularity import PerGroup

    return ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))


@pytest.mark.parametrize("kind,cls", [("int8", "Int8Tensor"), ("float8", "Float8Tensor"),
                                      ("int4", "IntxUnpackedToInt8Tensor")])
def test_torchao_subclasses(tmp_path, torchao, kind, cls):
    model = _source(256, 128, 64).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    torchao.quantize_(model, _ao_config(torchao, kind))
    state = model.state_dict()
    path = tmp_path / "m.pt"
    torch.save(state, path)
    # What each subclass stores, from the live objects: its data tensors' bytes.
    stored = {}
    for key, value in state.items():
        names = [*getattr(value, "tensor_data_names", ()),
                 *getattr(value, "optional_tensor_data_names", ())]
        parts = [getattr(value, n, None) for n in names] if names else [value]
        stored[key] = sum(p.numel() * p.element_size() for p in parts if p is not None)
    report = modelsize.inspect(path)
    assert report.parameters == params
    _check_sums(report)
    weights = report.quantization.by_name()
    for key in ("0.weight", "1.weight"):
        assert weights[key].counted_bytes == stored[key]
        assert weights[key].label.startswith(f"torchao {cls}")
    assert report.quantization.counted_bytes == sum(stored.values())
    # The torch reader keeps a subclass's parts under its name, of its category.
    parts = {t.key: t for t in report.inventory.tensors if t.name.startswith("0.weight.")}
    assert "0.weight.qdata" in parts and "0.weight.scale" in parts
    assert {t.category.value for t in parts.values()} == {"weights"}
    # The subclass is still a global torch.load(weights_only=True) refuses: said honestly.
    assert any(f.kind == "unsafe_code" and cls in f.message for f in report.findings)


# -- GGUF --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf():
    return pytest.importorskip("gguf")


def test_ggml_block_table_matches_gguf_py(gguf):
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

    for qtype, (block, block_bytes) in GGML_QUANT_SIZES.items():
        name = GGML_TYPES[qtype.value]
        d = DTYPES[name]
        if qtype is GGMLQuantizationType.Q8_1:
            # gguf-py keeps the float d and s of an old ggml (4 + 4 + 32); ggml-common.h
            # static_asserts sizeof(block_q8_1) == 2*sizeof(ggml_half) + QK8_1.
            assert (block, block_bytes) == (32, 40)
            assert (d.block, d.block_bytes) == (32, 2 * 2 + 32)
            continue
        assert (d.block, d.block_bytes) == (block, block_bytes), qtype.name
    assert set(GGML_TYPES) == {q.value for q in GGML_QUANT_SIZES}
    for ftype in LlamaFileType:
        if ftype is not LlamaFileType.GUESSED:
            name = ftype.name.removeprefix("MOSTLY_").removeprefix("ALL_")
            assert GGUF_FILE_TYPES[ftype.value] == name, ftype


def test_every_ggml_type(tmp_path, gguf):
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_K_M)
    expected = {}
    rng = __import__("numpy").random.default_rng(0)
    for qtype, (block, block_bytes) in GGML_QUANT_SIZES.items():
        if qtype is GGMLQuantizationType.Q8_1:
            continue  # gguf-py's stale 40-byte block (see above) cannot write ggml's q8_1
        rows, cols = 2, 512 if block > 1 else 8
        name = f"blk.{qtype.name}.weight"
        values = rng.standard_normal((rows, cols)).astype("float32")
        try:
            data = gguf.quants.quantize(values, qtype)  # the real quantizer where it has one
        except (NotImplementedError, gguf.quants.QuantError, KeyError, TypeError):
            data = __import__("numpy").zeros((rows, cols // block * block_bytes), "uint8")
        writer.add_tensor(name, data, raw_dtype=qtype)
        expected[name] = (rows * cols, block_bytes * 8 / block)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    report = modelsize.inspect(path)
    _check_sums(report)
    weights = report.quantization.by_name()
    assert report.parameters == sum(n for n, _ in expected.values())
    for name, (n, bits) in expected.items():
        assert weights[name].parameters == n, name
        assert weights[name].bits_per_weight == pytest.approx(bits), name
    assert "(GGUF Q4_K_M)" in report.quantization.headline()
    assert {"q4_K", "iq2_xxs", "tq1_0", "mxfp4"} <= {g.label for g in
                                                      report.quantization.quantized}


# -- diff: a quantized weight beside its source --------------------------------------------------


def test_diff_pairs_fp8_blocks_with_their_bfloat16_source(tmp_path, capsys):
    from modelsize.cli import main

    name = "model.layers.0.self_attn.q_proj.weight"
    dense = torch.zeros(256, 384, dtype=torch.bfloat16)
    safetensors_torch.save_file({name: dense, "model.norm.weight": torch.ones(384)},
                                tmp_path / "src.safetensors")
    safetensors_torch.save_file({name: dense.to(torch.float8_e4m3fn),
                                 name + "_scale_inv": torch.ones(2, 3),
                                 "model.norm.weight": torch.ones(384)},
                                tmp_path / "fp8.safetensors")
    d = diff(tmp_path / "src.safetensors", tmp_path / "fp8.safetensors")
    (pair,) = d.quantized
    assert pair.name == name and pair.a.label == "bfloat16" and pair.b.layout == "fp8-block"
    assert pair.a.parameters == pair.b.parameters == 256 * 384
    bits = 8 + 32 * 6 / (256 * 384)
    assert main(["diff", str(tmp_path / "src.safetensors"), str(tmp_path / "fp8.safetensors")]) == 0
    text = capsys.readouterr().out
    assert (f"{name}: bfloat16 256x384 (16 bits) -> fp8 e4m3, block 128x128 "
            f"({bits:.3f} bits)") in text
    assert main(["diff", str(tmp_path / "src.safetensors"), str(tmp_path / "fp8.safetensors"),
                 "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["quantized"]
    assert entry["b"]["bits_per_weight"] == pytest.approx(bits, abs=1e-4)


def test_diff_pairs_bitsandbytes_with_its_source(tmp_path, bnb):
    src = _source(512, 256, 64)
    torch.save(src.state_dict(), tmp_path / "src.pt")
    model = torch.nn.Sequential(*(bnb.nn.Linear4bit(m.in_features, m.out_features,
                                                    quant_type="nf4") for m in src))
    model.load_state_dict(src.state_dict())
    state = model.to("cpu").state_dict()
    safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()},
                                tmp_path / "nf4.safetensors")
    d = diff(tmp_path / "src.pt", tmp_path / "nf4.safetensors")
    pairs = {p.name: p for p in d.quantized}
    assert set(pairs) == {"0.weight", "1.weight"}
    assert pairs["0.weight"].a.shape == (256, 512)
    assert pairs["0.weight"].b.parameters == 256 * 512
    assert pairs["0.weight"].b.label.startswith("4-bit bitsandbytes nf4")
    # A weight of another size is not its source, even where the packed shape is not known.
    other = _source(512, 128)
    torch.save(other.state_dict(), tmp_path / "other.pt")
    assert diff(tmp_path / "other.pt", tmp_path / "nf4.safetensors").quantized == ()
