"""MODEL as weights: a model folder's dtypes, quantized tensors held as stored, GGUF files.

Ground truth is independent of modelsize: the real ``from_pretrained`` (the dtypes it gives
every parameter) and the real ``generate()`` of the loaded model measured by the CPU
allocator's profiler; tensor bytes summed from the tensors written; for GGUF files the
tensor bytes gguf-py's own reader reported when the fixtures were written (MANIFEST.json).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from modelsize.cli import main
from modelsize.estimation.generate import generation_inputs
from tests.estimation.generators import BASE, measure

tf = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

FIXTURES = Path(__file__).parent / "fixtures"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
GEN = ("--generate", "3", "--batch", "2", "--seq", "10", "--device", "cpu")


def _json(capsys: Any, *args: str) -> dict[str, Any]:
    code = main(["estimate", *args, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def _save(folder: Path, model: Any, state: dict[str, torch.Tensor],
          config_extra: dict[str, Any] | None = None, drop_dtype: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    if drop_dtype:
        raw.pop("dtype", None)
        raw.pop("torch_dtype", None)
    raw.update(config_extra or {})
    (folder / "config.json").write_text(json.dumps(raw))
    safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()},
                                str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _llama() -> Any:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**BASE)).eval()


def test_bf16_checkpoint_with_float32_norms_as_from_pretrained_loads_it(
        tmp_path: Path, capsys: Any) -> None:
    """The config names no dtype: from_pretrained takes the first floating tensor's
    (lm_head, bfloat16) and casts the float32 norms to it. The estimate equals the real
    generate() of the loaded model, and the report says where the dtype came from."""
    model = _llama()
    state = {k: (v.float() if "norm" in k else v.to(torch.bfloat16))
             for k, v in model.state_dict().items()}
    folder = _save(tmp_path / "mixed", model, state)
    loaded = tf.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    got = _json(capsys, str(folder), *GEN)
    assert got["peak_bytes"] == measure(loaded, generation_inputs(loaded, 2, 10), 3)
    weights = got["weights"]
    assert weights["dtype"] == "bfloat16" and "first floating-point tensor" in weights["dtype_from"]
    norms = [k for k in state if "norm" in k]
    assert weights["cast_on_loading"] == {
        "float32": {"tensors": len(norms), "bytes": sum(state[k].nbytes for k in norms)}}
    assert got["setup"]["sources"]["dtype"] == "model"
    assert main(["estimate", str(folder), *GEN]) == 0
    text = capsys.readouterr().out
    assert f"loading casts {len(norms)} float32 tensors" in text


def test_the_first_floating_tensor_decides_even_when_it_is_a_norm(tmp_path: Path,
                                                                  capsys: Any) -> None:
    """Tied embeddings (no lm_head): the first tensor by name is ``model.embed_tokens``,
    here float32 among bfloat16 tensors, so from_pretrained builds the whole model in
    float32."""
    config = tf.LlamaConfig(**{**BASE, "tie_word_embeddings": True})
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).eval()
    state = {k: (v.float() if "embed" in k else v.to(torch.bfloat16))
             for k, v in model.state_dict().items() if k != "lm_head.weight"}
    folder = _save(tmp_path / "f32first", model, state)
    loaded = tf.AutoModelForCausalLM.from_pretrained(folder)
    expected = {str(p.dtype).removeprefix("torch.") for p in loaded.parameters()}
    got = _json(capsys, str(folder), *GEN)
    assert {got["weights"]["dtype"]} == expected == {"float32"}
    assert got["categories"]["parameters"] == sum(p.nbytes for p in loaded.parameters())


def test_config_dtype_and_keep_in_float32_modules(tmp_path: Path, capsys: Any) -> None:
    """Dots1 keeps its router weights in float32 (``_keep_in_fp32_modules_strict``) in a
    bfloat16 model: the parameters are what from_pretrained leaves in memory."""
    torch.manual_seed(0)
    config = tf.Dots1Config(**{**BASE, "num_key_value_heads": 2}, n_routed_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32,
                            first_k_dense_replace=1, n_shared_experts=1, n_group=1,
                            topk_group=1)
    model = tf.Dots1ForCausalLM(config).to(torch.bfloat16)
    folder = _save(tmp_path / "dots1", model, model.state_dict(),
                   config_extra={"dtype": "bfloat16"}, drop_dtype=False)
    loaded = tf.AutoModelForCausalLM.from_pretrained(folder)
    fp32 = [n for n, p in loaded.named_parameters() if p.dtype == torch.float32]
    assert fp32  # the rule is exercised
    got = _json(capsys, str(folder), *GEN)
    assert got["weights"]["dtype_from"] == "config.json's dtype"
    assert sorted(got["weights"]["kept_float32"]) == sorted(fp32)
    assert got["categories"]["parameters"] == sum(p.nbytes for p in loaded.parameters())


def _fp8_checkpoint(model: Any) -> tuple[dict[str, torch.Tensor], int]:
    """Every linear layer of the decoder as float8 with a float32 row scale (the layout of
    ``quant_method: fbgemm_fp8`` checkpoints, a method modelsize builds no layer for); the
    rest bfloat16. Returns the state and the bytes it holds. (``quant_method: fp8`` folders
    are built as loading builds them: tests/estimation/test_quant_checkpoint.py.)"""
    state: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if ".layers." in k and k.endswith("proj.weight"):
            state[k] = v.to(torch.float8_e4m3fn)
            state[k.replace(".weight", ".weight_scale")] = torch.ones(v.shape[0], 1)
        else:
            state[k] = v.to(torch.bfloat16)
    return state, sum(t.numel() * t.element_size() for t in state.values())


def test_quantized_tensors_are_counted_as_stored(tmp_path: Path, capsys: Any) -> None:
    model = _llama()
    state, nbytes = _fp8_checkpoint(model)
    quant = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}
    folder = _save(tmp_path / "fp8", model, state,
                   config_extra={"dtype": "bfloat16", "quantization_config": quant},
                   drop_dtype=False)
    got = _json(capsys, str(folder), *GEN)
    # the parameters in memory are the checkpoint's tensors, byte for byte (tied none)
    assert got["categories"]["parameters"] == nbytes
    fp8 = [k for k in state if state[k].dtype == torch.float8_e4m3fn]
    assert got["weights"]["replaced_parameters"] == len(fp8)
    assert got["weights"]["stored_tensors"] == 2 * len(fp8)
    assert got["weights"]["quant_method"] == "fbgemm_fp8"
    assert any("dequantization" in n for n in got["notes"])
    # verify would run the float model: refused in one line
    assert main(["estimate", str(folder), *GEN, "--verify"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_gptq_tensors_named_apart_from_the_weights(tmp_path: Path, capsys: Any) -> None:
    """GPTQ stores ``qweight``/``qzeros``/``scales``/``g_idx`` where the model has
    ``weight``: the module's tensors replace its parameter."""
    model = _llama()
    state: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if ".layers." in k and k.endswith("proj.weight"):
            out_f, in_f = v.shape
            base = k.removesuffix(".weight")
            state[base + ".qweight"] = torch.zeros(in_f // 8, out_f, dtype=torch.int32)
            state[base + ".qzeros"] = torch.zeros(in_f // 32, out_f // 8, dtype=torch.int32)
            state[base + ".scales"] = torch.zeros(in_f // 32, out_f, dtype=torch.float16)
            state[base + ".g_idx"] = torch.zeros(in_f, dtype=torch.int32)
        else:
            state[k] = v.to(torch.float16)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    quant = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    folder = _save(tmp_path / "gptq", model, state,
                   config_extra={"dtype": "float16", "quantization_config": quant},
                   drop_dtype=False)
    got = _json(capsys, str(folder), *GEN)
    assert got["categories"]["parameters"] == nbytes


@pytest.mark.parametrize("name", sorted(MANIFEST["files"]))
def test_gguf_parameters_are_the_files_tensor_bytes(name: str, capsys: Any) -> None:
    truth = MANIFEST["files"][name]
    got = _json(capsys, str(FIXTURES / name), *GEN)
    assert got["categories"]["parameters"] == truth["tensor_bytes"]
    assert got["weights"]["stored_tensors"] == truth["tensor_count"]
    assert got["weights"]["source"] == "gguf" and got["weights"]["dtype"] == "float16"


def test_gguf_metadata_becomes_the_model(capsys: Any) -> None:
    """The llama fixture was written with 2 layers, 64 hidden, 4 heads over 2 KV heads of
    16, a 256-token vocabulary and an untied F16 head; deepseek2 with MLA (kv_lora_rank 32,
    rope 16) and 4 experts after one dense layer (tests/estimation/fixtures/gguf_models.py)."""
    llama = _json(capsys, str(FIXTURES / "tiny-llama-q8.gguf"), *GEN)
    (group,) = llama["generation"]["groups"]
    assert group["kind"] == "full_attention" and group["layers"] == 2
    assert group["bytes_per_token"] == 2 * 2 * 16 * 2 * 2  # layers x kv x head x k,v x fp16
    ds = _json(capsys, str(FIXTURES / "tiny-deepseek2-q8.gguf"), *GEN)
    (latent,) = ds["generation"]["groups"]
    assert latent["kind"] == "latent" and latent["layers"] == 2
    assert latent["latent_bytes_per_token"] == 2 * (32 + 16) * 2
    assert "DeepseekV2ForCausalLM" in ds["description"]


def test_an_unmapped_gguf_architecture_is_one_line(capsys: Any) -> None:
    path = Path(__file__).parents[1] / "fixtures" / "gguf" / "aligned_dup.gguf"
    assert main(["estimate", str(path), *GEN]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'gpt2'" in err and "llama" in err
