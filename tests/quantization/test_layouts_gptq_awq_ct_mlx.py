"""Parameters and bits per weight of GPTQ, AWQ, compressed-tensors and MLX checkpoints.

Each layout's fixture starts from an unquantized torch (or MLX) model whose parameter count is
``sum(p.numel())``; the bits are each layout's arithmetic, written out here:

- compressed-tensors: the real ``ModelCompressor`` compresses the model (CPU), saved as
  transformers saves it (the compressed state dict, ``update_config`` for config.json).
- MLX: committed fixtures written by the real ``mlx.nn.quantize`` (tests/fixtures/mlx).
- GPTQ and AWQ (CUDA-only tools): written here byte for byte as the tools pack: GPTQModel
  ``gptqmodel/nn_modules/qlinear/__init__.py`` ``pack_original`` (and the shapes of
  ``_register_gptq_buffers``), AutoAWQ ``awq/modules/linear/gemm.py``
  ``WQLinear_GEMM.from_linear`` and ``awq/modules/linear/gemv.py`` ``WQLinear_GEMV.from_linear``.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
safetensors_torch = pytest.importorskip("safetensors.torch")

import modelsize  # noqa: E402
from modelsize.categories import Category  # noqa: E402
from modelsize.quantization import count  # noqa: E402

MLX_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "mlx"
IN, OUT = 256, 128


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _file_bytes_add_up(report) -> bool:
    return sum(report.inventory.bytes_by_category.values()) == report.file_bytes


def _weight(report, name):
    return report.quantization.by_name()[name]


# ---------------------------------------------------------------------------------------------
# GPTQ: GPTQModel pack_original, byte for byte


def _gptq_pack(linear, bits: int, group: int, *, act_order: bool, v2: bool = False):
    """GPTQModel ``PackedGroupedQuantLinear.pack_original`` with pack_dtype int32: scales and
    zeros per group, ``g_idx`` the group of each input column (permuted by act-order), the
    integer weight packed along the input dimension, zeros along the output dimension; the
    ``gptq`` (v1) format stores each zero minus one (``convert_gptq_v2_to_v1_format``)."""
    W = linear.weight.data.float()
    out_f, in_f = W.shape
    groups = math.ceil(in_f / group)
    maxq = 2**bits - 1
    if act_order:
        perm = torch.argsort(W.abs().sum(0), descending=True)
        g_idx = torch.empty(in_f, dtype=torch.int32)
        g_idx[perm] = torch.arange(in_f, dtype=torch.int32) // group
    else:
        g_idx = torch.arange(in_f, dtype=torch.int32) // group
    scales = torch.rand(out_f, groups) * 0.01 + 0.001  # [out, groups], as GPTQ.quantize gives
    zeros = torch.randint(1, maxq, (out_f, groups)).float()
    scales, zeros = scales.T.contiguous(), zeros.T.contiguous()
    scale_zeros = zeros * scales
    int_weight = torch.round((W + scale_zeros[g_idx].T) / scales[g_idx].T).clamp_(0, maxq)
    int_weight = int_weight.to(torch.int32).T.contiguous().numpy().astype(np.uint32)
    word = 32
    pack_factor = word // bits
    qweight = np.zeros((math.ceil(in_f * bits / word), out_f), dtype=np.uint32)
    if bits in (2, 4, 8):
        for row in range(qweight.shape[0]):
            for j in range(pack_factor):
                qweight[row] |= int_weight[row * pack_factor + j] << (bits * j)
    else:  # bits == 3: 32 values in three words
        i = row = 0
        while row < qweight.shape[0]:
            for j in range(i, i + 10):
                qweight[row] |= int_weight[j] << (3 * (j - i))
            i += 10
            qweight[row] |= int_weight[i] << 30
            row += 1
            qweight[row] |= (int_weight[i] >> 2) & 1
            i += 1
            for j in range(i, i + 10):
                qweight[row] |= int_weight[j] << (3 * (j - i) + 1)
            i += 10
            qweight[row] |= int_weight[i] << 31
            row += 1
            qweight[row] |= (int_weight[i] >> 1) & 0x3
            i += 1
            for j in range(i, i + 10):
                qweight[row] |= int_weight[j] << (3 * (j - i) + 2)
            i += 10
            row += 1
    stored = zeros.numpy().astype(np.uint32) - (0 if v2 else 1)
    qzeros = np.zeros((groups, math.ceil(out_f * bits / word)), dtype=np.uint32)
    if bits in (2, 4, 8):
        for col in range(qzeros.shape[1]):
            for j in range(pack_factor):
                qzeros[:, col] |= stored[:, col * pack_factor + j] << (bits * j)
    else:
        i = col = 0
        while col < qzeros.shape[1]:
            for j in range(i, i + 10):
                qzeros[:, col] |= stored[:, j] << (3 * (j - i))
            i += 10
            qzeros[:, col] |= stored[:, i] << 30
            col += 1
            qzeros[:, col] |= (stored[:, i] >> 2) & 1
            i += 1
            for j in range(i, i + 10):
                qzeros[:, col] |= stored[:, j] << (3 * (j - i) + 1)
            i += 10
            qzeros[:, col] |= stored[:, i] << 31
            col += 1
            qzeros[:, col] |= (stored[:, i] >> 1) & 0x3
            i += 1
            for j in range(i, i + 10):
                qzeros[:, col] |= stored[:, j] << (3 * (j - i) + 2)
            i += 10
            col += 1
    out = {"qweight": torch.from_numpy(qweight.astype(np.int32)),
           "qzeros": torch.from_numpy(qzeros.astype(np.int32)),
           "scales": scales.to(torch.float16), "g_idx": g_idx}
    if linear.bias is not None:
        out["bias"] = linear.bias.data.to(torch.float16)
    return out


def _gptq_config(bits, group, act_order, fmt="gptq"):
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
            "sym": True, "checkpoint_format": fmt, "pack_dtype": "int32"}


def _save(folder: Path, tensors: dict, quantization_config: dict | None) -> Path:
    folder.mkdir(parents=True)
    safetensors_torch.save_file({k: v.contiguous() for k, v in tensors.items()},
                                folder / "model.safetensors")
    if quantization_config is not None:
        (folder / "config.json").write_text(json.dumps(
            {"model_type": "llama", "quantization_config": quantization_config}))
    return folder


@pytest.mark.parametrize("bits,group,act_order,fmt", [
    (4, 128, True, "gptq"), (4, 64, False, "gptq"), (8, 128, False, "gptq"),
    (3, 64, True, "gptq"), (4, 128, True, "gptq_v2")])
def test_gptq_packed_as_gptqmodel_packs(tmp_path, bits, group, act_order, fmt):
    torch.manual_seed(0)
    linear = torch.nn.Linear(IN, OUT)
    tensors = {f"layer.{k}": v for k, v in
               _gptq_pack(linear, bits, group, act_order=act_order, v2=fmt == "gptq_v2").items()}
    folder = _save(tmp_path / "q", tensors, _gptq_config(bits, group, act_order, fmt))
    report = modelsize.inspect(folder)
    assert report.parameters == _params(linear)
    w = _weight(report, "layer.weight")
    assert w.shape == (OUT, IN)
    groups = IN // group
    # bits per weight: the packed bits, a float16 scale and a packed zero per group of inputs
    expected = bits + 16 / group + bits / group
    assert w.bits_per_weight == pytest.approx(expected, rel=0.01)
    version = " v2" if fmt == "gptq_v2" else ""
    order = ", act-order" if act_order else ""
    assert w.label == f"{bits}-bit GPTQ{version}, group {group}{order}"
    assert w.counted_bytes == (IN * bits // 32 * OUT * 4 + groups * OUT * 2
                               + groups * math.ceil(OUT * bits / 32) * 4)
    assert "layer.g_idx" in w.tensors  # claimed, not counted
    assert _file_bytes_add_up(report)


def test_gptq_without_a_config_reads_bits_from_the_shapes(tmp_path):
    torch.manual_seed(0)
    linear = torch.nn.Linear(IN, OUT, bias=False)
    tensors = {f"layer.{k}": v for k, v in _gptq_pack(linear, 8, 64, act_order=False).items()}
    report = modelsize.inspect(_save(tmp_path / "q", tensors, None))
    w = _weight(report, "layer.weight")
    assert (report.parameters, w.label) == (IN * OUT, "8-bit GPTQ, group 64")
    assert w.bits_per_weight == pytest.approx(8 + 16 / 64 + 8 / 64, rel=0.01)


# ---------------------------------------------------------------------------------------------
# AWQ: AutoAWQ WQLinear_GEMM / WQLinear_GEMV from_linear, byte for byte


def _awq_intweight(linear, group, scales, zeros):
    scale_zeros = zeros * scales
    W = linear.weight.data.float()
    cols = [torch.round((W[:, i] + scale_zeros[i // group]) / scales[i // group]).to(torch.int)
            for i in range(W.shape[1])]
    return torch.stack(cols, dim=1).clamp(0, 15)  # [out, in]


def _awq_gemm(linear, group):
    """``WQLinear_GEMM.from_linear``: scales/zeros ``[in/group, out]``, the integer weight
    transposed to ``[in, out]`` and eight output columns a word in order 0 2 4 6 1 3 5 7."""
    out_f, in_f = linear.weight.shape
    scales = (torch.rand(in_f // group, out_f) * 0.01 + 0.001).half()
    zeros = torch.randint(0, 16, (in_f // group, out_f))
    intweight = _awq_intweight(linear, group, scales.float(), zeros.float()).t().contiguous()
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    qweight = torch.zeros(in_f, out_f // 8, dtype=torch.int32)
    for col in range(out_f // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + order_map[i]].to(torch.int32) << (i * 4)
    qzeros = torch.zeros(in_f // group, out_f // 8, dtype=torch.int32)
    for col in range(out_f // 8):
        for i in range(8):
            qzeros[:, col] |= zeros[:, col * 8 + order_map[i]].to(torch.int32) << (i * 4)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales,
            "bias": linear.bias.data.half()}


def _zeros_width(in_f, group):
    """AutoAWQ gemv.py ``calculate_zeros_width`` (pack_num 8)."""
    multiplier = {32: 4, 64: 2}.get(group, 1)
    width = (in_f // group + 7) // 8
    return (width + multiplier - 1) // multiplier * multiplier


def _awq_gemv(linear, group):
    """``WQLinear_GEMV.from_linear``: scales/zeros ``[out, in/group]`` padded to
    ``calculate_zeros_width`` words, the weight ``[out, in]`` packed eight inputs a word."""
    out_f, in_f = linear.weight.shape
    width = _zeros_width(in_f, group)
    scales = (torch.rand(out_f, in_f // group) * 0.01 + 0.001)
    zeros = torch.randint(0, 16, (out_f, in_f // group))
    qscales = torch.zeros(out_f, width * 8, dtype=torch.float16)
    qscales[:, : scales.shape[1]] = scales
    W = linear.weight.data.float()
    sz = zeros * scales
    intweight = torch.stack(
        [torch.round((W[:, i] + sz[:, i // group]) / qscales[:, i // group].float())
         .to(torch.int) for i in range(in_f)], dim=1).clamp(0, 15).to(torch.int32)
    qweight = torch.zeros(out_f, in_f // 8, dtype=torch.int32)
    for col in range(in_f // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + i] << (i * 4)
    qzeros = torch.zeros(out_f, width, dtype=torch.int32)
    for col in range((zeros.shape[1] + 7) // 8):
        for i in range(8):
            if col * 8 + i < zeros.shape[1]:
                qzeros[:, col] |= zeros[:, col * 8 + i].to(torch.int32) << (i * 4)
    return {"qweight": qweight, "qzeros": qzeros, "scales": qscales,
            "bias": linear.bias.data.half()}


@pytest.mark.parametrize("with_config", [True, False])
@pytest.mark.parametrize("group", [128, 64])
def test_awq_gemm_packed_as_autoawq_packs(tmp_path, group, with_config):
    torch.manual_seed(0)
    linear = torch.nn.Linear(IN, OUT)
    tensors = {f"layer.{k}": v for k, v in _awq_gemm(linear, group).items()}
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm"} if with_config else None
    report = modelsize.inspect(_save(tmp_path / "q", tensors, config))
    assert report.parameters == _params(linear)
    w = _weight(report, "layer.weight")
    assert w.label == f"4-bit AWQ GEMM, group {group}"
    # 4 bits, a float16 scale and a 4-bit zero per group of inputs
    assert w.bits_per_weight == pytest.approx(4 + 16 / group + 4 / group, rel=0.01)
    assert _file_bytes_add_up(report)


@pytest.mark.parametrize("with_config", [True, False])
@pytest.mark.parametrize("in_f,group", [(256, 64), (1024, 128), (512, 32)])
def test_awq_gemv_packed_as_autoawq_packs(tmp_path, in_f, group, with_config):
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_f, 64)
    tensors = {f"layer.{k}": v for k, v in _awq_gemv(linear, group).items()}
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemv"} if with_config else None
    report = modelsize.inspect(_save(tmp_path / "q", tensors, config))
    assert report.parameters == _params(linear)
    w = _weight(report, "layer.weight")
    assert w.label == f"4-bit AWQ GEMV, group {group}"
    # GEMV stores its groups padded to whole words: width int32 zeros and width * 8 float16
    # scales a row, whatever the group count (AutoAWQ calculate_zeros_width).
    width = _zeros_width(in_f, group)
    expected = 4 + (width * 32 + width * 8 * 16) / in_f
    assert w.bits_per_weight == pytest.approx(expected, rel=0.01)
    assert _file_bytes_add_up(report)


# ---------------------------------------------------------------------------------------------
# compressed-tensors: the real ModelCompressor


def _ct_compress(model, scheme, folder: Path, ignore=()) -> Path:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
    )

    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore))
    apply_quantization_config(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("weight_scale", "input_scale")):
                p.fill_(0.01)
            elif name.endswith("global_scale"):
                p.fill_(1.0)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    folder.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors_torch.save_file(state, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    compressor.update_config(str(folder))
    return folder


def _preset(name):
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(name, ["Linear"])


def _two_linears():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, OUT), torch.nn.ReLU(),
                               torch.nn.Linear(OUT, IN, bias=False)).to(torch.bfloat16)


# (preset, label of the first linear, bits of the first linear [IN -> OUT], bf16 model)
CT_CASES = [
    # pack-quantized: int32 words, a bfloat16 scale per group of 128
    ("W4A16", "4-bit compressed-tensors pack-quantized, group 128", 4 + 16 / 128),
    ("W8A16", "8-bit compressed-tensors pack-quantized, group 128", 8 + 16 / 128),
    ("W3A16", "3-bit compressed-tensors pack-quantized, group 128", 3 + 16 / 128),
    # asymmetric: the zero points packed 8 a word along the output dimension
    ("W4A16_ASYM", "4-bit compressed-tensors pack-quantized, group 128", 4 + 16 / 128 + 4 / 128),
    # int-quantized: int8 and one bfloat16 scale per output channel
    ("W8A8", "8-bit compressed-tensors int-quantized, per-channel", 8 + 16 / IN),
    # float-quantized: fp8 with one scale per tensor, channel, or 128x128 block
    ("FP8", "fp8 e4m3fn compressed-tensors float-quantized, per-tensor", 8 + 16 / (IN * OUT)),
    ("FP8_DYNAMIC", "fp8 e4m3fn compressed-tensors float-quantized, per-channel", 8 + 16 / IN),
    ("FP8_BLOCK", "fp8 e4m3fn compressed-tensors float-quantized, block 128x128",
     8 + 16 * (OUT // 128) * (IN // 128) / (IN * OUT)),
    # nvfp4: two e2m1 a byte, an e4m3 scale per 16, a float32 global scale per tensor
    ("NVFP4A16", "NVFP4 compressed-tensors nvfp4-pack-quantized, group 16",
     4 + 8 / 16 + 32 / (IN * OUT)),
    ("NVFP4", "NVFP4 compressed-tensors nvfp4-pack-quantized, group 16",
     4 + 8 / 16 + 32 / (IN * OUT)),
    # mxfp4: an e8m0 exponent per 32
    ("MXFP4A16", "MXFP4 compressed-tensors mxfp4-pack-quantized, group 32", 4 + 8 / 32),
]


@pytest.fixture(scope="module")
def ct_folders(tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    root = tmp_path_factory.mktemp("ct")
    out = {}
    for preset, _, _ in CT_CASES:
        model = _two_linears()
        params = _params(model)
        out[preset] = (_ct_compress(model, _preset(preset), root / preset), params)
    return out


@pytest.mark.parametrize("preset,label,bits", CT_CASES, ids=[c[0] for c in CT_CASES])
def test_compressed_tensors_formats(ct_folders, preset, label, bits):
    folder, params = ct_folders[preset]
    report = modelsize.inspect(folder)
    assert report.parameters == params
    first = _weight(report, "0.weight")
    assert first.shape == (OUT, IN)
    assert first.label == label
    assert first.bits_per_weight == pytest.approx(bits, rel=0.01)
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert report.quantization.config["format"] == config["format"]
    assert _file_bytes_add_up(report)


def test_compressed_tensors_older_compression_config(ct_folders, tmp_path):
    """Older checkpoints nest the settings as compression_config.quantization_config."""
    folder, params = ct_folders["W4A16_ASYM"]
    copy = tmp_path / "old"
    shutil.copytree(folder, copy)
    data = json.loads((copy / "config.json").read_text())
    data["compression_config"] = {"quantization_config": data.pop("quantization_config"),
                                  "sparsity_config": None}
    (copy / "config.json").write_text(json.dumps(data))
    report = modelsize.inspect(copy)
    first = _weight(report, "0.weight")
    assert report.parameters == params
    assert first.label == "4-bit compressed-tensors pack-quantized, group 128"


def test_compressed_tensors_without_a_config_assumes_4_bits(ct_folders, tmp_path):
    folder, params = ct_folders["W4A16"]
    copy = tmp_path / "bare"
    copy.mkdir()
    shutil.copy(folder / "model.safetensors", copy)
    report = modelsize.inspect(copy)
    assert report.parameters == params
    assert _weight(report, "0.weight").label.endswith("(bits assumed: no quantization_config)")


def test_compressed_tensors_activation_scales_are_not_parameters(ct_folders):
    folder, params = ct_folders["FP8"]
    report = modelsize.inspect(folder)
    names = {n for w in report.quantization.weights for n in w.tensors}
    assert "0.input_scale" in names and report.parameters == params
    assert not any(w.name == "0.input_scale" for w in report.quantization.weights)


# ---------------------------------------------------------------------------------------------
# MLX: fixtures written by mlx.nn.quantize (tests/fixtures/mlx/generate.py)


def _mlx_manifest():
    return json.loads((MLX_FIXTURES / "MANIFEST.json").read_text())["fixtures"]


def test_mlx_llama_with_a_per_layer_override():
    fixture = _mlx_manifest()["llama_affine"]
    report = modelsize.inspect(MLX_FIXTURES / "llama_affine")
    assert report.parameters == fixture["unquantized_parameters"]
    quant = report.quantization
    down = _weight(report, "model.layers.0.mlp.down_proj.weight")
    q = _weight(report, "model.layers.0.self_attn.q_proj.weight")
    emb = _weight(report, "model.embed_tokens.weight")
    # affine: bits, plus a bfloat16 scale and a bfloat16 bias per group
    assert (q.label, q.shape) == ("4-bit MLX affine, group 32", (64, 64))
    assert q.bits_per_weight == pytest.approx(4 + 32 / 32, rel=0.01)
    assert (down.label, down.shape) == ("8-bit MLX affine, group 64", (64, 128))
    assert down.bits_per_weight == pytest.approx(8 + 32 / 64, rel=0.01)
    assert (emb.label, emb.shape) == ("4-bit MLX affine, group 32", (96, 64))
    norm = _weight(report, "model.norm.weight")
    assert (norm.label, norm.bits_per_weight) == ("bfloat16", 16)
    # the whole model, from the tensors' shapes in the manifest
    t = fixture["tensors"]
    size = {"uint32": 4, "bfloat16": 2}
    stored = sum(math.prod(v["shape"]) * size[v["dtype"]] for v in t.values())
    assert quant.counted_bytes == stored
    assert quant.bits_per_weight == pytest.approx(stored * 8 / report.parameters, rel=1e-9)
    assert quant.headline() == (f"{count(report.parameters)} parameters, "
                                f"{stored * 8 / report.parameters:.2f} bits per weight "
                                "(4-bit MLX affine, group 32 and 1 more quantized layout)")
    assert _file_bytes_add_up(report)


@pytest.mark.parametrize("mode,label,bits", [
    ("mxfp4", "MXFP4 MLX, group 32", 4 + 8 / 32), ("nvfp4", "NVFP4 MLX, group 16", 4 + 8 / 16),
    ("mxfp8", "MXFP8 MLX, group 32", 8 + 8 / 32)])
def test_mlx_fp_modes(tmp_path, mode, label, bits):
    fixture = _mlx_manifest()[mode]
    for with_config in (True, False):
        folder = tmp_path / f"{mode}{with_config}"
        folder.mkdir()
        shutil.copy(MLX_FIXTURES / mode / "model.safetensors", folder)
        if with_config:
            shutil.copy(MLX_FIXTURES / mode / "config.json", folder)
        report = modelsize.inspect(folder)
        assert report.parameters == fixture["unquantized_parameters"]
        (w,) = report.quantization.weights
        assert (w.label, w.shape) == (label, (32, 128))
        assert w.bits_per_weight == pytest.approx(bits, rel=0.01)
        # MLX's uint8 scales are part of the weight, not buffers
        assert report.inventory.bytes_by_category[Category.BUFFERS] == 0
        assert _file_bytes_add_up(report)


def test_mlx_without_its_config_assumes_and_says_so(tmp_path):
    """Only bits x group size is in MLX's shapes (4-bit group 32 is stored as 2-bit group 64):
    without the config the likeliest pair is taken (4 bits first) and the label says so."""
    folder = tmp_path / "bare"
    folder.mkdir()
    shutil.copy(MLX_FIXTURES / "llama_affine" / "model.safetensors", folder)
    report = modelsize.inspect(folder)
    q = _weight(report, "model.layers.0.self_attn.q_proj.weight")
    assert q.label == "4-bit MLX affine, group 32 (bits assumed: no quantization config)"
    assert q.parameters == 64 * 64
    # down_proj, 8-bit group 64, reads as 4-bit group 128: assumed, and labelled so
    down = _weight(report, "model.layers.0.mlp.down_proj.weight")
    assert down.label.endswith("(bits assumed: no quantization config)")


# ---------------------------------------------------------------------------------------------
# The headline on a Llama-shaped checkpoint: quantized linears, unquantized embeddings and norms


class _Attention(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, n, torch.nn.Linear(h, h, bias=False))


class _MLP(torch.nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.gate_proj = torch.nn.Linear(h, i, bias=False)
        self.up_proj = torch.nn.Linear(h, i, bias=False)
        self.down_proj = torch.nn.Linear(i, h, bias=False)


class _Block(torch.nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.self_attn = _Attention(h)
        self.mlp = _MLP(h, i)
        self.input_layernorm = torch.nn.RMSNorm(h)
        self.post_attention_layernorm = torch.nn.RMSNorm(h)


class _Inner(torch.nn.Module):
    def __init__(self, h, i, vocab, layers):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, h)
        self.layers = torch.nn.ModuleList(_Block(h, i) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(h)


class _Llama(torch.nn.Module):
    """The module names of transformers' LlamaForCausalLM, at a tiny size."""

    def __init__(self, h=256, i=512, vocab=512, layers=2):
        super().__init__()
        self.model = _Inner(h, i, vocab, layers)
        self.lm_head = torch.nn.Linear(h, vocab, bias=False)


def test_gptq_llama_headline(tmp_path, capsys):
    from modelsize.cli import main

    torch.manual_seed(0)
    model = _Llama().half()
    tensors, quantized, plain_bytes = {}, 0, 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            for k, v in _gptq_pack(module, 4, 128, act_order=True).items():
                tensors[f"{name}.{k}"] = v
            quantized += module.weight.numel()
    for name, p in model.named_parameters():
        if not any(name.startswith(k.rsplit(".", 1)[0] + ".") for k in tensors):
            tensors[name] = p.data
            plain_bytes += p.numel() * 2
    folder = _save(tmp_path / "llama", tensors, _gptq_config(4, 128, True))
    report = modelsize.inspect(folder)
    params = _params(model)
    assert report.parameters == params
    # 4-bit GPTQ group 128: 4 + 16/128 + 4/128 bits; the rest float16
    bits = (quantized * (4 + 16 / 128 + 4 / 128) + plain_bytes * 8) / params
    assert report.bits_per_weight == pytest.approx(bits, rel=1e-9)
    headline = f"{count(params)} parameters, {bits:.2f} bits per weight " \
               "(4-bit GPTQ, group 128, act-order)"
    assert report.quantization.headline() == headline
    assert main(["inspect", str(folder)]) == 0
    assert headline in capsys.readouterr().out
    assert _file_bytes_add_up(report)


def test_compressed_tensors_llama_headline(tmp_path):
    pytest.importorskip("compressed_tensors")
    torch.manual_seed(0)
    model = _Llama().to(torch.bfloat16)
    params = _params(model)
    linears = sum(m.weight.numel() for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and n != "lm_head")
    folder = _ct_compress(model, _preset("W4A16"), tmp_path / "llama", ignore=["lm_head"])
    report = modelsize.inspect(folder)
    assert report.parameters == params
    bits = (linears * (4 + 16 / 128) + (params - linears) * 16) / params
    assert report.bits_per_weight == pytest.approx(bits, rel=1e-9)
    assert report.quantization.headline() == (
        f"{count(params)} parameters, {bits:.2f} bits per weight "
        "(4-bit compressed-tensors pack-quantized, group 128)")
    assert _file_bytes_add_up(report)
