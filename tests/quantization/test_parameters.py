"""Parameters and bits per weight: the counts every report carries (issue 21, item 1).

Unquantized checkpoints count each weight at its dtype, tied weights once; quantized layouts
are tested beside their fixtures (tests/quantization/test_layouts_*.py)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

import modelsize  # noqa: E402
from modelsize.quantization import count  # noqa: E402


def test_a_torch_state_dict_counts_what_the_model_counts(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64),
                                torch.nn.Linear(64, 8).to(torch.bfloat16))
    path = tmp_path / "m.pt"
    torch.save(model.state_dict(), path)
    report = modelsize.inspect(path)
    assert report.parameters == sum(p.numel() for p in model.parameters())
    fp32 = 32 * 64 + 64 + 64 + 64  # linear 1 and the BatchNorm's affine parameters
    bf16 = 64 * 8 + 8
    assert report.quantization.counted_bytes == fp32 * 4 + bf16 * 2
    labels = {g.label: g.parameters for g in report.quantization.groups}
    assert labels == {"float32": fp32, "bfloat16": bf16}


def test_tied_weights_count_once(tmp_path):
    emb = torch.nn.Embedding(100, 16)
    head = torch.nn.Linear(16, 100, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    path = tmp_path / "tied.pt"
    torch.save(model.state_dict(), path)
    report = modelsize.inspect(path)
    assert report.parameters == sum(p.numel() for p in model.parameters()) == 1600


def test_optimizer_state_is_not_parameters(tmp_path):
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    report = modelsize.inspect(path)
    assert report.parameters == 16 * 16 + 16
    assert report.bits_per_weight == 32


def _gptq_folder(folder, *, g_idx=True, config=True):
    folder.mkdir()
    in_f, out_f, bits, group = 256, 128, 4, 64
    tensors = {
        "layer.qweight": torch.zeros(in_f * bits // 32, out_f, dtype=torch.int32),
        "layer.qzeros": torch.zeros(in_f // group, out_f * bits // 32, dtype=torch.int32),
        "layer.scales": torch.zeros(in_f // group, out_f, dtype=torch.float16),
        "layer.bias": torch.zeros(out_f, dtype=torch.float16),
        "embed.weight": torch.zeros(100, 64, dtype=torch.float16),
    }
    if g_idx:
        tensors["layer.g_idx"] = torch.zeros(in_f, dtype=torch.int32)
    safetensors_torch.save_file(tensors, folder / "model.safetensors")
    if config:
        (folder / "config.json").write_text(json.dumps({"quantization_config": {
            "quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": True}}))
    return folder


@pytest.mark.parametrize("g_idx,config", [(True, True), (False, True), (True, False),
                                          (False, False)])
def test_gptq_with_and_without_its_config(tmp_path, g_idx, config):
    report = modelsize.inspect(_gptq_folder(tmp_path / "q", g_idx=g_idx, config=config))
    quant = report.quantization
    assert report.parameters == 256 * 128 + 128 + 100 * 64
    (gptq,) = quant.quantized
    assert gptq.parameters == 256 * 128
    # 4 bits, plus a float16 scale and a 4-bit zero per group of 64: g_idx is not counted.
    assert gptq.bits_per_weight == pytest.approx(4 + (16 + 4) / 64)
    assert gptq.label.startswith("4-bit GPTQ, group 64")
    assert ("act-order" in gptq.label) == config
    assert sum(report.inventory.bytes_by_category.values()) == report.file_bytes


def test_text_and_json_carry_the_counts(tmp_path, capsys):
    from modelsize.cli import main

    folder = _gptq_folder(tmp_path / "q")
    assert main(["inspect", str(folder)]) == 0
    text = capsys.readouterr().out
    params = 256 * 128 + 128 + 100 * 64
    assert f"{count(params)} parameters" in text and "4-bit GPTQ, group 64" in text
    assert main(["inspect", str(folder), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parameters"] == params
    assert data["quantization"]["groups"][0]["layout"] == "gptq"


@pytest.mark.parametrize("n,text", [(8_030_261_248, "8.03B"), (124_439_808, "124M"),
                                    (3_200, "3.20K"), (512, "512"), (70_553_706_496, "70.6B")])
def test_counts_read_as_people_say_them(n, text):
    assert count(n) == text


def test_layout_parts_equal_across_layers_are_not_duplicates(tmp_path):
    """Every bitsandbytes layer stores the same NF4 code table, every GPTQ layer without
    act-order the same g_idx, every compressed-tensors layer of one shape the same
    weight_shape: a loader needs each under its own name, so `slim --dedupe` must not be
    offered (it dropped them, and the output no longer loaded)."""
    code = torch.linspace(-1, 1, 16)
    tensors = {}
    for i in range(3):
        tensors[f"l{i}.weight.quant_map"] = code.clone()
        tensors[f"l{i}.g_idx"] = torch.arange(256, dtype=torch.int32) // 64
        tensors[f"l{i}.weight_shape"] = torch.tensor([128, 256])
        tensors[f"l{i}.weight"] = torch.randn(8, 8)
    tensors["head.weight"] = tensors["l0.weight"].clone()  # a real duplicate stays one
    path = tmp_path / "q.safetensors"
    safetensors_torch.save_file(tensors, path)
    report = modelsize.inspect(path)
    dups = [t.name for t in report.inventory.tensors if t.duplicate_of]
    assert dups == ["l0.weight"]  # safetensors stores names sorted: head.weight comes first
