"""Quantized checkpoint folders as MODEL: the layers their ``quantization_config`` names are
built on the meta device and their kernels traced; GPTQ and AWQ layers (modelsize's own, from
the libraries' torch kernels) checked against their packing and a real CPU run.

Before: a quantized folder's tensors were "held as stored", the model traced in its float
dtype with no dequantization scratch (``the dequantization kernels' temporaries are not
traced``), and ``--verify`` was refused. Ground truth: the bytes of the tensors written (and
modelsize's inspect of the file); the real CPU run of the same program (``--verify``, the
allocator's profiler); for bitsandbytes, the real library's own quantized model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from torch import nn  # noqa: E402

import modelsize  # noqa: E402
from modelsize.cli import main  # noqa: E402
from modelsize.estimation.quant_layers import (  # noqa: E402
    AWQLinear,
    GPTQLinear,
    pack_awq,
    pack_gptq,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*is an Enum subclass and is now natively supported:FutureWarning",
)

BASE = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "tie_word_embeddings": False}
ARGS = ("--infer", "--batch", "2", "--seq", "16", "--device", "cpu", "--no-suggest")


def _llama(dtype: torch.dtype) -> Any:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**BASE)).to(dtype).eval()


def _folder(path: Path, model: Any, state: dict[str, torch.Tensor], quant: dict[str, Any],
            dtype: str, binary: bool = False) -> Path:
    path.mkdir(parents=True)
    model.config.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw.update(dtype=dtype, quantization_config=quant)
    raw.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps(raw))
    if binary:
        torch.save(state, path / "pytorch_model.bin")
    else:
        safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()},
                                    str(path / "model.safetensors"))
    return path


def _estimate(capsys: Any, folder: Path, *extra: str) -> dict[str, Any]:
    code = main(["estimate", str(folder), *ARGS, "--json", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)  # type: ignore[no-any-return]


def _inspected_bytes(folder: Path) -> int:
    inv = modelsize.inspect(next(folder.glob("model*.safetensors")))
    return sum(t.nbytes for t in inv.inventory.tensors)


def _packed_state(model: Any, kind: str, bits: int, group: int) -> dict[str, torch.Tensor]:
    """The decoder's linear layers as GPTQ (GPTQModel's shapes) or AWQ GEMM (AutoAWQ's)
    tensors, packed from random integer weights; the rest float16."""
    torch.manual_seed(1)
    state: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if ".layers." not in k or not k.endswith("proj.weight"):
            state[k] = v.to(torch.float16)
            continue
        out_f, in_f = v.shape
        base = k.removesuffix(".weight")
        iw = torch.randint(0, 2 ** bits, (out_f, in_f))
        zeros = torch.randint(0, 2 ** bits, (in_f // group, out_f))
        if kind == "gptq":
            state[base + ".qweight"], state[base + ".qzeros"] = pack_gptq(iw, zeros, bits)
            state[base + ".g_idx"] = torch.randperm(in_f).to(torch.int32) // group  # act-order
        else:
            state[base + ".qweight"], state[base + ".qzeros"] = pack_awq(iw, zeros)
        state[base + ".scales"] = torch.rand(in_f // group, out_f, dtype=torch.float16)
    return state


# -- the layers ------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gptq_unpacking_reproduces_the_packed_values(bits: int) -> None:
    torch.manual_seed(0)
    out_f, in_f, group = 64, 256, 32
    iw = torch.randint(0, 2 ** bits, (out_f, in_f))
    zeros = torch.randint(0, 2 ** bits, (in_f // group, out_f))
    scales = torch.rand(in_f // group, out_f, dtype=torch.float16)
    g_idx = torch.randperm(in_f) // group
    layer = GPTQLinear(bits, group, in_f, out_f, bias=False)
    layer.qweight.data, layer.qzeros.data = pack_gptq(iw, zeros, bits)
    layer.scales.data, layer.g_idx.data = scales, g_idx.to(torch.int32)
    expected = scales[g_idx] * (iw.t() - zeros[g_idx]).to(torch.float16)
    assert torch.equal(layer.dequantize_weight(), expected)


def test_awq_gemm_unpacking_reproduces_the_packed_values() -> None:
    torch.manual_seed(0)
    out_f, in_f, group = 64, 256, 32
    iw = torch.randint(0, 16, (out_f, in_f))
    zeros = torch.randint(0, 16, (in_f // group, out_f))
    scales = torch.rand(in_f // group, out_f, dtype=torch.float16)
    layer = AWQLinear(4, group, in_f, out_f, bias=False)
    layer.qweight.data, layer.qzeros.data = pack_awq(iw, zeros)
    layer.scales.data = scales
    expected = ((iw.t() - zeros.repeat_interleave(group, 0)).to(torch.float16)
                * scales.repeat_interleave(group, 0))
    assert torch.equal(layer.dequantize_weight(), expected)


@pytest.mark.parametrize("kind", ["gptq", "awq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["infer", "train"])
def test_packed_layer_trace_matches_real_run(kind: str, dtype: torch.dtype, mode: str) -> None:
    layer = (GPTQLinear(4, 32, 256, 64, bias=True) if kind == "gptq"
             else AWQLinear(4, 32, 256, 64, bias=True))
    model = nn.Sequential(nn.Linear(64, 256).to(dtype), layer, nn.Linear(64, 8).to(dtype))
    est = modelsize.estimate(model, (torch.randn(4, 64, dtype=dtype),), mode=mode,
                             verify=True)
    v = est.verification
    assert v is not None and v.measured_bytes == est.peak_bytes, v


# -- checkpoint folders ----------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "bits"), [("gptq", 4), ("gptq", 8), ("awq", 4)])
def test_packed_checkpoint_folder_traces_its_kernels(tmp_path: Path, capsys: Any, kind: str,
                                                    bits: int) -> None:
    model = _llama(torch.float16)
    state = _packed_state(model, kind, bits, 32)
    quant = {"quant_method": kind, "bits": bits, "group_size": 32, "desc_act": True}
    if kind == "awq":
        quant = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm",
                 "zero_point": True}
    folder = _folder(tmp_path / kind, model, state, quant, "float16")
    got = _estimate(capsys, folder, "--verify")
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    assert got["categories"]["parameters"] == nbytes == _inspected_bytes(folder)
    assert got["verification"]["measured_bytes"] == got["peak_bytes"]
    layer = "GPTQLinear" if kind == "gptq" else "AWQLinear"
    assert any(f"14 {layer}" in n for n in got["notes"]), got["notes"]
    # the dequantized float16 weight of the largest layer (256 x 128) is scratch at the peak
    assert got["categories"]["temporaries"] >= 256 * 128 * 2


def test_awq_gemv_folder_has_the_packed_shapes(tmp_path: Path, capsys: Any) -> None:
    # AutoAWQ's WQLinear_GEMV: qweight [out, in/8], qzeros [out, w], scales [out, 8w] with
    # calculate_zeros_width(in, 32) = ceil(ceil(in/32) / 8 / 4) * 4
    model = _llama(torch.float16)
    state: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if ".layers." in k and k.endswith("proj.weight"):
            out_f, in_f = v.shape
            width = math.ceil(math.ceil(in_f // 32 / 8) / 4) * 4
            base = k.removesuffix(".weight")
            state[base + ".qweight"] = torch.zeros(out_f, in_f // 8, dtype=torch.int32)
            state[base + ".qzeros"] = torch.zeros(out_f, width, dtype=torch.int32)
            state[base + ".scales"] = torch.zeros(out_f, width * 8, dtype=torch.float16)
        else:
            state[k] = v.to(torch.float16)
    quant = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}
    folder = _folder(tmp_path / "gemv", model, state, quant, "float16")
    got = _estimate(capsys, folder)
    assert got["categories"]["parameters"] == _inspected_bytes(folder)


def _bnb_folder(tmp_path: Path, scheme: str) -> tuple[Path, Any]:
    pytest.importorskip("bitsandbytes")
    from modelsize.estimation.quantized import quantize_model, to_linear8bit

    model = _llama(torch.bfloat16)
    if scheme == "nf4":
        quantize_model(model, "nf4")
        quant = {"quant_method": "bitsandbytes", "load_in_4bit": True,
                 "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                 "bnb_4bit_compute_dtype": "bfloat16"}
    else:
        to_linear8bit(model, ("lm_head",), threshold=0.0)
        quant = {"quant_method": "bitsandbytes", "load_in_8bit": True,
                 "llm_int8_threshold": 0.0}
    state = model.state_dict()  # bitsandbytes' own serialization
    return _folder(tmp_path / scheme, model, state, quant, "bfloat16"), model


def test_bitsandbytes_nf4_folder_is_the_real_quantized_model(tmp_path: Path,
                                                            capsys: Any) -> None:
    folder, real = _bnb_folder(tmp_path, "nf4")
    got = _estimate(capsys, folder)
    # in memory: the checkpoint less each layer's serialized quant state (a JSON blob, read
    # into attributes) plus the float32 offset of the nested absmax it held
    blobs = [v for k, v in real.state_dict().items() if ".quant_state." in k]
    expected = _inspected_bytes(folder) - sum(b.numel() for b in blobs) + 4 * len(blobs)
    assert got["categories"]["parameters"] == expected
    ids = torch.zeros(2, 16, dtype=torch.long)
    from_real = modelsize.estimate(real, (ids,), mode="infer").to_dict()
    # (buffers differ: the real model was cast with .to(), which from_pretrained does not do
    # to the rotary inv_freq)
    for category in ("parameters", "activations", "temporaries"):
        assert got["categories"][category] == from_real["categories"][category], category
    assert got["setup"]["quantization"] == "nf4 (bitsandbytes Linear4bit)"


def test_bitsandbytes_int8_folder_matches_real_run(tmp_path: Path, capsys: Any) -> None:
    folder, real = _bnb_folder(tmp_path, "int8")
    got = _estimate(capsys, folder, "--verify")
    formats = [v for k, v in real.state_dict().items() if k.endswith("weight_format")]
    assert got["categories"]["parameters"] == _inspected_bytes(folder) - sum(
        f.numel() * f.element_size() for f in formats)
    assert got["verification"]["measured_bytes"] == got["peak_bytes"]


def test_torchao_int8_folder_matches_real_run(tmp_path: Path, capsys: Any) -> None:
    pytest.importorskip("torchao")
    from torchao.core.config import config_to_dict
    from torchao.quantization import Int8WeightOnlyConfig

    from modelsize.estimation.quantized import quantize_with_torchao, storages

    model = _llama(torch.bfloat16)
    quantize_with_torchao(model, Int8WeightOnlyConfig(), ("lm_head",))
    quant = {"quant_method": "torchao",
             "quant_type": {"default": config_to_dict(Int8WeightOnlyConfig())}}
    folder = _folder(tmp_path / "ao", model, model.state_dict(), quant, "bfloat16",
                     binary=True)
    got = _estimate(capsys, folder, "--verify")
    assert got["categories"]["parameters"] == sum(
        t.nbytes for p in model.parameters() for t in storages(p))
    assert got["verification"]["measured_bytes"] == got["peak_bytes"]
    assert got["setup"]["quantization"] == "int8 (torchao Int8Tensor)"


# -- fine-grained fp8 ------------------------------------------------------------------------

FP8_BLOCK = 32


def _fp8_folder(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The decoder's linear layers as transformers' fine-grained fp8 (float8_e4m3fn weights,
    float32 ``weight_scale_inv`` per 32 x 32 block), the rest bfloat16."""
    model = _llama(torch.bfloat16)
    state: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if ".layers." in k and k.endswith("proj.weight"):
            out_f, in_f = v.shape
            state[k] = v.float().to(torch.float8_e4m3fn)
            state[k.removesuffix("weight") + "weight_scale_inv"] = torch.rand(
                out_f // FP8_BLOCK, in_f // FP8_BLOCK) + 0.5
        else:
            state[k] = v
    quant = {"quant_method": "fp8", "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
             "activation_scheme": "dynamic"}
    return _folder(tmp_path / "fp8", model, state, quant, "bfloat16"), state


def test_fp8_folder_on_cpu_is_dequantized_as_loading_does(tmp_path: Path,
                                                         capsys: Any) -> None:
    pytest.importorskip("accelerate")
    folder, _ = _fp8_folder(tmp_path)
    got = _estimate(capsys, folder, "--verify")
    # transformers on CPU: FineGrainedFP8HfQuantizer sets dequantize=True, every weight bf16
    real = tf.AutoModelForCausalLM.from_pretrained(folder, device_map="cpu")
    assert {p.dtype for p in real.parameters()} == {torch.bfloat16}
    held = sum(p.numel() * p.element_size() for p in real.parameters())
    assert got["categories"]["parameters"] == held
    assert got["verification"]["measured_bytes"] == got["peak_bytes"]
    assert any("dequantized at load to bfloat16" in n and "14 nn.Linear" in n
               for n in got["notes"]), got["notes"]


def test_fp8_folder_on_cuda_holds_transformers_fp8_linears(tmp_path: Path,
                                                          capsys: Any) -> None:
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    folder, state = _fp8_folder(tmp_path)
    got = _estimate(capsys, folder, "--device", "cuda")
    # transformers' own FP8Linear layers (CUDA path) on the meta model: their parameters
    with torch.device("meta"):
        real = tf.LlamaForCausalLM(tf.AutoConfig.from_pretrained(folder)).to(torch.bfloat16)
    config = FineGrainedFP8Config(weight_block_size=[FP8_BLOCK, FP8_BLOCK])
    replace_with_fp8_linear(real, ["lm_head"], config, pre_quantized=True)
    held = sum(p.numel() * p.element_size() for p in real.parameters())
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    assert got["categories"]["parameters"] == held == nbytes == _inspected_bytes(folder)
    assert got["setup"]["quantization"] == "fp8 (modelsize FP8Linear)"
    assert any("14 FP8Linear" in n and "unvalidated on CUDA" in n for n in got["notes"])
    # the kernel's scratch at the largest layer's call: its input in float8 (1 byte per
    # element) and float32 scales per block of 32 input features
    assert got["categories"]["temporaries"] > 0


@pytest.mark.parametrize("block", [(32, 32), None])
def test_fp8_linear_backward_dequantizes_as_transformers(block: tuple[int, int] | None
                                                         ) -> None:
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from modelsize.estimation.quant_layers import dequantize_fp8_weight

    torch.manual_seed(0)
    w = (torch.randn(64, 96) * 4).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3) + 0.5 if block else torch.tensor(0.7)
    expected = _dequantize_fp8_weight(w, s, list(block) if block else None, torch.bfloat16)
    assert torch.equal(dequantize_fp8_weight(w, s, block, torch.bfloat16), expected)


# -- compressed-tensors ----------------------------------------------------------------------


def _ct_folder(tmp_path: Path, preset: str, fmt: str) -> Path:
    """A checkpoint written by compressed-tensors itself: its preset scheme applied to the
    decoder's linear layers (the head ignored), scales set, ``compress_model``'s state."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    model = _llama(torch.bfloat16)
    qconfig = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(
        preset, ["Linear"])}, ignore=["lm_head"], format=fmt)
    apply_quantization_config(model, qconfig)
    torch.manual_seed(2)
    for m in model.modules():
        if hasattr(m, "weight_scale"):
            m.weight_scale.data = torch.rand_like(m.weight_scale) * 0.01 + 0.001
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.zero_()
        if hasattr(m, "quantization_status"):
            m.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor(quantization_config=qconfig)
    compressor.compress_model(model)
    state = dict(model.state_dict())
    quant = {**qconfig.model_dump(), "quant_method": "compressed-tensors",
             "quantization_status": "compressed"}
    return _folder(tmp_path / preset, model, state, json.loads(json.dumps(quant, default=str)),
                   "bfloat16")


@pytest.mark.parametrize(("preset", "fmt"), [("W4A16", "pack-quantized"),
                                             ("W8A8", "int-quantized"),
                                             ("FP8_DYNAMIC", "float-quantized")])
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_compressed_tensors_folder_matches_loading_and_real_run(
        tmp_path: Path, capsys: Any, preset: str, fmt: str) -> None:
    folder = _ct_folder(tmp_path, preset, fmt)
    got = _estimate(capsys, folder, "--verify")
    # transformers' loading, then the first forward (compressed-tensors decompresses there)
    real = tf.AutoModelForCausalLM.from_pretrained(folder, device_map="cpu")
    with torch.no_grad():
        real(torch.zeros(1, 4, dtype=torch.long))
    held = sum(p.numel() * p.element_size() for p in real.parameters())
    assert got["categories"]["parameters"] == held
    assert got["verification"]["measured_bytes"] == got["peak_bytes"]
    assert any("compressed-tensors" in n and "14 Linear" in n for n in got["notes"]), \
        got["notes"]


@pytest.mark.parametrize("mode", ["infer", "train"])
def test_fp8_linear_trace_matches_its_real_run(mode: str) -> None:
    # modelsize's FP8Linear (the CUDA layout) run for real on CPU: the trace of its forward
    # and of its autograd backward (the weight dequantized) counts what the run allocates
    from modelsize.estimation.quant_layers import FP8Linear

    layer = FP8Linear(256, 64, (32, 32), bias=True, dtype=torch.bfloat16)
    model = nn.Sequential(nn.Linear(64, 256).to(torch.bfloat16), layer,
                          nn.Linear(64, 8).to(torch.bfloat16))
    est = modelsize.estimate(model, (torch.randn(4, 64, dtype=torch.bfloat16),), mode=mode,
                             verify=True)
    v = est.verification
    assert v is not None and v.measured_bytes == est.peak_bytes, v


def test_fp8_folder_generate_on_cpu_is_dequantized(tmp_path: Path, capsys: Any) -> None:
    folder, _ = _fp8_folder(tmp_path)
    code = main(["estimate", str(folder), "--generate", "3", "--batch", "2", "--seq", "10",
                 "--device", "cpu", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert any("dequantized at load to bfloat16" in n for n in json.loads(out)["notes"])
